"""HTTP as every modelfleet process speaks it.

The router's own HTTP/1.1 server (`http1.py`), running a service's listeners and its one
ordered shutdown (`serving.py`), the pieces every listener uses (`web.py`), the OpenAI API's
shapes (`openai_api.py`), engines' metrics under one set of names (`engine_metrics.py`),
traces (`tracing.py`, and `otlp.py` to send them), and a steady test client (`loadgen.py`).

May import: security (TLS contexts), host, the messages and the pure core.
"""
