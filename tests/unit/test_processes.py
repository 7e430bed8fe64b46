"""Ports for listeners are picked where outgoing connections do not take them."""

from __future__ import annotations

import socket

from modelfleet.processes import _ephemeral_low, free_port


def test_a_free_port_is_below_the_range_of_outgoing_connections_and_bindable() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
