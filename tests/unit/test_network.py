"""Which address reaches a host, and which interface holds an address (`network.py`)."""

from __future__ import annotations

import psutil

from modelfleet.host.network import interface_of, route_address


def test_the_address_that_reaches_loopback_is_loopback_on_its_interface() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])


def test_an_address_no_interface_holds_has_none() -> None:
    assert interface_of("198.51.100.77") is None  # TEST-NET-2, for documentation only
    assert interface_of("not an address") is None


def test_an_agent_without_address_takes_its_own_on_the_route_to_the_control_plane() -> None:
    """The agent's default `--address`: 127.0.0.1 for a control plane on loopback, else this
    host's address on its route there (a UDP socket is connected, nothing is sent), which
    one of its interfaces holds."""
    from modelfleet.cli import _address_towards

    assert _address_towards("http://127.0.0.1:7070") == "127.0.0.1"
    towards = _address_towards("https://198.51.100.7:7070")  # TEST-NET-2, by the default route
    assert interface_of(towards) is not None and towards == route_address("198.51.100.7")
