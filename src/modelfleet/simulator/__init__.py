"""The engine simulator: an OpenAI-compatible server that behaves like vLLM (latency from
prompt and output length, a concurrency limit with a queue, a prefix cache, vLLM's metrics,
faults on request). `engine.py` is the model of an engine, apart from HTTP; `server.py` serves
it; `checks.py` checks requests as vLLM does.

May import: http and itself.
"""
