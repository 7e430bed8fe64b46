"""The admin API of a running fleet, fuzzed from its own `/openapi.json` by schemathesis:
requests made to fit the document and requests made to break it, each answered with no 5xx,
a documented status, and a body the document describes.

A hand-written list of calls (tests/unit/test_admin_api.py) checks each route once; this one
sends what nobody thought of. Before it existed it found limits past int64 and durations of
10^20 weeks (500s from SQLite), 404 and 405 answers in FastAPI's own shape rather than an
`ErrorAnswer`, and a 405 whose `Allow` named one method of several. Every check runs, that
a request the document allows is accepted (ST202) too: it found `since`s, join token ttls,
key expiries and limits refused where the document had said nothing against them.

The operations are walked by hand rather than by schemathesis' pytest plugin, which fails to
collect under this project's pytest. The examples are the same at every run, so that CI is
repeatable; `MODELFLEET_FUZZ_RANDOM=1` draws new ones each run, to look further.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from .conftest import fleet_of, wait_for

MODELS = [
    {"name": "sim-chat", "engine": "sim", "replicas": 2},
    {"name": "sim-wide", "engine": "sim", "gpus_per_shard": 8},  # pending: no node fits it
]
EXAMPLES = 50  # per operation and mode: about 900 requests in all
RANDOM = bool(os.environ.get("MODELFLEET_FUZZ_RANDOM"))
# Every check runs on every operation. One is tuned: that a request the document allows is
# accepted (ST202) takes, for a catalog, also a 422 naming its problems, since no document
# can state all of `Catalog`'s rules (a known engine, rules across fields and models); a
# malformed request (400) or any other refusal still fails it.
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis' default
CONFIG = SchemathesisConfig.from_dict(
    {
        "operations": [
            {
                "include-name": "PUT /v1/catalog",
                "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "422"]}},
            }
        ]
    }
)


def test_no_input_makes_the_admin_api_fail_or_answer_off_its_document(tmp_path: Path) -> None:
    with fleet_of(tmp_path, MODELS) as fleet:
        token = {"authorization": f"Bearer {fleet.admin_token}"}

        def serving() -> bool:
            replicas = httpx.get(f"{fleet.admin_url}/v1/replicas", headers=token).json()
            return sum(r["state"] == "ready" for r in replicas["replicas"]) == 2

        wait_for("both replicas of sim-chat to serve", serving, timeout=60)
        url = f"{fleet.admin_url}/openapi.json"
        schema = schemathesis.openapi.from_url(url, headers=token, config=CONFIG)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 15
        calls = 0
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @given(operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=EXAMPLES,
                    deadline=None,
                    database=None,
                    derandomize=not RANDOM,
                    suppress_health_check=list(HealthCheck),
                )
                def fuzz(case: schemathesis.Case) -> None:
                    nonlocal calls
                    calls += 1
                    case.call_and_validate(headers=token)  # every check: see CONFIG

                try:
                    fuzz()
                except Unsatisfiable:
                    # Nothing of the operation can be made invalid (no parameters, no body).
                    assert mode is GenerationMode.NEGATIVE, operation.label
        assert calls >= len(operations) * 10  # the fuzzer ran, it did not skip its cases
        # And the fleet lived through it: the control plane still answers.
        assert httpx.get(f"{fleet.admin_url}/v1/status", headers=token).status_code == 200
