"""A rendezvous port is one paddle can bind: paddle's TCP store server listens on every
interface (``0.0.0.0``) whatever host it is given, so a port some other process holds on
one address only (here 127.0.0.2, loopback too on Linux) is not free for it, though a
bind on 127.0.0.1 succeeds."""

from __future__ import annotations

import random
import socket

import pytest

from services.worker import ports


def test_a_port_held_on_another_address_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    try:
        held.bind(("127.0.0.2", 0))
    except OSError:
        held.close()
        pytest.skip("127.0.0.2 cannot be bound here")
    with held:
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as other:  # a port nothing holds, for the second draw
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        draws = iter([taken, free])
        monkeypatch.setattr(random, "randint", lambda a, b: next(draws))
        assert ports.rendezvous_port() == free
