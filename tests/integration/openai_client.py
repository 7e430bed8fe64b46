"""The official openai client, through a router over TLS, as a client on another host would
use it: run as a script inside a host's network namespace (`hosts.py`).

    python openai_client.py BASE_URL CA_FILE KEY MODEL once
        one chat completion; prints its text, exits 1 if it fails
    python openai_client.py BASE_URL CA_FILE KEY MODEL load RATE STOP_FILE OUT_FILE
        RATE requests a second until STOP_FILE exists (at most 600 s); writes
        {"requests": N, "failed": N, "errors": [...]} to OUT_FILE
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import openai

from modelfleet.pki import client_context

MAX_LOAD_S = 600.0


def client(base_url: str, ca_file: str, key: str) -> openai.OpenAI:
    http = httpx.Client(verify=client_context(Path(ca_file).read_bytes()), timeout=30)
    return openai.OpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)


def ask(c: openai.OpenAI, model: str) -> str:
    done = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    return done.choices[0].message.content or ""


def main(argv: list[str]) -> int:
    base_url, ca_file, key, model, mode, *rest = argv
    c = client(base_url, ca_file, key)
    if mode == "once":
        try:
            print(ask(c, model))
        except openai.OpenAIError as exc:
            print(f"failed: {exc}")
            return 1
        return 0
    rate, stop_file, out_file = float(rest[0]), Path(rest[1]), Path(rest[2])
    requests, failed, errors = 0, 0, []
    began = time.monotonic()
    while not stop_file.exists() and time.monotonic() - began < MAX_LOAD_S:
        requests += 1
        try:
            ask(c, model)
        except openai.OpenAIError as exc:
            failed += 1
            errors.append(f"{time.monotonic() - began:.1f}s: {exc}"[:300])
        time.sleep(max(0.0, began + requests / rate - time.monotonic()))
    out_file.write_text(json.dumps({"requests": requests, "failed": failed, "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
