"""The official openai client, through a router over TLS, as a client on another host would
use it: run as a script inside a host's network namespace (`hosts.py`).

    python openai_client.py BASE_URL CA_FILE KEY MODEL once
        one chat completion; prints its text, exits 1 if it fails
    python openai_client.py BASE_URL CA_FILE KEY MODEL load RATE STOP_FILE OUT_FILE
        RATE requests a second until STOP_FILE exists (at most 600 s), each sent on time
        whether those before it have ended or not (up to MAX_IN_FLIGHT at once), as
        independent clients send them; each is a line of JSON in OUT_FILE as it ends: its
        start and end (wall-clock seconds), the replica that answered (the router's
        x-modelfleet-replica) and its error ("" when none). bench/multihost.py runs it too.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import httpx
import openai

from modelfleet.security.pki import client_context

MAX_LOAD_S = 600.0
MAX_IN_FLIGHT = 64


def client(base_url: str, ca_file: str, key: str) -> openai.OpenAI:
    verify = True if ca_file == "-" else client_context(Path(ca_file).read_bytes())  # -: http
    http = httpx.Client(verify=verify, timeout=30)
    return openai.OpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)


def ask(c: openai.OpenAI, model: str) -> tuple[str, str]:
    """One chat completion: its text, and the replica that answered."""
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    done = raw.parse()
    return done.choices[0].message.content or "", raw.headers.get("x-modelfleet-replica", "")


def main(argv: list[str]) -> int:
    base_url, ca_file, key, model, mode, *rest = argv
    c = client(base_url, ca_file, key)
    if mode == "once":
        try:
            print(ask(c, model)[0])
        except openai.OpenAIError as exc:
            print(f"failed: {exc}")
            return 1
        return 0
    rate, stop_file, out_file = float(rest[0]), Path(rest[1]), Path(rest[2])
    lock = threading.Lock()

    def one(out: TextIO) -> None:
        start, replica, error = time.time(), "", ""
        try:
            replica = ask(c, model)[1]
        except openai.OpenAIError as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        line = {"start": start, "end": time.time(), "replica": replica, "error": error}
        with lock:
            out.write(json.dumps(line) + "\n")
            out.flush()

    began, sent = time.monotonic(), 0
    with out_file.open("a") as out, ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        while not stop_file.exists() and time.monotonic() - began < MAX_LOAD_S:
            sent += 1
            pool.submit(one, out)
            time.sleep(max(0.0, began + sent / rate - time.monotonic()))
    return 0


def outcomes(path: Path) -> list[dict[str, Any]]:
    """The requests a load run wrote to `path`."""
    return [json.loads(line) for line in path.read_text().splitlines() if line]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
