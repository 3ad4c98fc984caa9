"""Ports for paddle's rendezvous stores (no paddle import: the launcher uses it too)."""

from __future__ import annotations

import random
import socket


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A free port *below* the ephemeral range, for a store paddle's ranks rendezvous on.

    A port from ``bind(0)`` is ephemeral: between our check and paddle's bind, any
    outgoing connection on the host may take it, and the ranks then wait for each other
    forever. Ports under ``ip_local_port_range`` are never handed out that way.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                # paddle's TCP store server listens on every interface (0.0.0.0), whatever
                # host it is given: a port held on any one address is not free for it
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
