"""An agent forgets its join token once it holds a credential (`agent/credential.py`)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import httpx

from modelfleet.agent.credential import HeldToken
from modelfleet.agent.settings import AgentSettings
from modelfleet.agent.uplink import Uplink
from modelfleet.messages.wire import AgentReport, NodeAssignment

TOKEN = "mfjoin.0123456789ab." + "1" * 32 + "." + "2" * 64


def test_a_forgotten_token_leaves_the_environment_and_the_files_it_was_given_in(
    tmp_path: Path,
) -> None:
    env_file = tmp_path / "modelfleet-agent.env"
    env_file.write_text(f'HF_HOME="/models"\nMODELFLEET_AGENT_TOKEN="{TOKEN}"\nOTHER=1\n')
    env_file.chmod(0o600)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    environ = {"MODELFLEET_AGENT_TOKEN": TOKEN, "PATH": "/usr/bin"}
    missing = tmp_path / "gone"
    held = HeldToken(f" {TOKEN}\n", (env_file, token_file, missing), environ)
    assert held.token == TOKEN and TOKEN not in repr(held)

    assert held.forget() == []
    assert held.token is None and environ == {"PATH": "/usr/bin"}
    assert env_file.read_text() == 'HF_HOME="/models"\nOTHER=1\n'  # the rest is kept
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert token_file.read_text() == ""
    assert held.forget() == []  # once is enough


def test_a_file_the_agent_cannot_rewrite_is_named_in_what_is_left(tmp_path: Path) -> None:
    folder = tmp_path / "not-a-file"
    folder.mkdir()
    left = HeldToken(TOKEN, (folder,), {}).forget()
    assert len(left) == 1 and left[0].startswith(f"{folder} still holds the join token")


def test_the_agent_forgets_a_token_held_beside_its_credential_once_that_is_taken(
    tmp_path: Path,
) -> None:
    """An agent restarted with a join token beside a credential it kept holds the token
    until the control plane answers: taken, the token is forgotten in every copy of its
    settings and in its environment; the agent no longer holds anything to join with."""
    environ = {"MODELFLEET_AGENT_TOKEN": TOKEN}
    held = HeldToken(TOKEN, (), environ)

    def answer(request: httpx.Request) -> httpx.Response:
        made = NodeAssignment(node="n1", shards=[], version="v", epoch=1)
        return httpx.Response(200, content=made.model_dump_json())

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="mfnode.kept",
        state_dir=tmp_path,
        transport=httpx.MockTransport(answer),
        join_token=held,
    )
    report = AgentReport(node="n1", boot_id="b", seq=1, address="127.0.0.1", gpus=[], shards=[])

    async def exchange() -> None:
        link = Uplink(settings, "b", asyncio.Event())
        assert await link.send_report(report) is not None
        assert link.settings.join_token.token is None
        await link.aclose()

    asyncio.run(exchange())
    assert settings.join_token.token is None and environ == {}
    assert os.environ.get("MODELFLEET_AGENT_TOKEN") != TOKEN
