"""After a drain and an uncordon every replica stays where the drain put it; `ctl rebalance`
spreads them out again, make-before-break, with no request lost."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from modelfleet.http.loadgen import SteadyClient

from .conftest import Operator, fleet_of, wait_for

MODEL = {"name": "sim-chat", "engine": "sim", "replicas": 3, "args": ["--ttft", "0.01"]}


def test_rebalance_spreads_replicas_again_after_an_uncordon(tmp_path: Path) -> None:
    with fleet_of(tmp_path, [MODEL]) as fleet:
        op = Operator(fleet, tmp_path)

        def spread() -> Counter[str]:
            return Counter(
                r["shards"][0]["node"] for r in op.replicas("sim-chat") if r["state"] == "ready"
            )

        wait_for("three replicas to serve", lambda: sum(spread().values()) == 3, timeout=60)
        op.ctl("drain", "node-2", "--wait")
        assert spread() == {"node-1": 3}
        op.ctl("uncordon", "node-2")
        assert spread() == {"node-1": 3}  # an uncordon moves nothing back

        dry = json.loads(op.ctl("rebalance", "--dry-run", "-o", "json").stdout)
        assert dry["dry_run"] and len(dry["moves"]) == 1
        assert dry["moves"][0]["from_node"] == "node-1" and dry["moves"][0]["to_node"] == "node-2"
        assert spread() == {"node-1": 3}  # a dry run changes nothing

        client = SteadyClient(fleet.router_url, fleet.api_key, "sim-chat", max_tokens=2)
        client.start()
        try:
            printed = op.ctl("rebalance").stdout
            assert "moving" in printed and "from node-1 to node-2" in printed
            wait_for(
                "the replicas to spread out",
                lambda: (
                    spread() == {"node-1": 2, "node-2": 1} and len(op.replicas("sim-chat")) == 3
                ),
                timeout=60,
            )
            done = client.ok
            wait_for("requests after the move", lambda: client.ok >= done + 10)
        finally:
            client.stop()
        assert client.failures == [], client.failures[:5]
        again = json.loads(op.ctl("rebalance", "-o", "json").stdout)
        assert again["moves"] == []  # even now
