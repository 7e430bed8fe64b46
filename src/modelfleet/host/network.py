"""Which of a machine's addresses and interfaces the fleet's processes use.

A multi-homed GPU host has several interfaces (a management network, a fast fabric, docker's
bridges). Two questions are answered here, by asking the kernel rather than guessing: which
local address reaches a given host (the one an agent advertises for its engines when told
none), and which interface holds an address (the one NCCL and Gloo must use, since left to
themselves they may pick another).
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def route_address(host: str) -> str:
    """The local address the kernel's routes use to reach `host` (nothing is sent: a UDP
    socket is only connected). Raises OSError when `host` cannot be resolved or reached."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        address: str = probe.getsockname()[0]
    return address


def address_beyond_loopback() -> str | None:
    """This machine's address on its default route (where another host would reach it), or
    None when it has none beyond loopback. Nothing is sent."""
    try:
        address = route_address("192.0.2.1")  # a documentation address
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address`, or None when none does."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for held in addresses:
            if held.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(held.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
