"""Ports for listeners are picked where outgoing connections do not take them."""

from __future__ import annotations

import socket

from modelfleet.host.processes import _ephemeral_low, free_port


def test_a_free_port_is_below_the_range_of_outgoing_connections_and_bindable() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_services_and_engines_pick_ports_in_bands_of_their_own() -> None:
    """`up` picks its services' ports before they bind them and agents pick their engines'
    meanwhile: no engine may take a port promised to a service."""
    low = _ephemeral_low()
    services = {free_port("127.0.0.1", "services") for _ in range(200)}
    engines = {free_port("127.0.0.1", "engines") for _ in range(200)}
    anywhere = {free_port("127.0.0.1") for _ in range(200)}
    assert max(engines) < min(services) and max(services) < low
    assert min(anywhere) < min(services) and max(anywhere) > max(engines)
