"""The fast wire's frame parsing, pure: a ``MSG``/``HMSG`` line's sizes must be
``0 <= hlen <= total`` (a negative size would move the parser backwards: a loop on the
same line, or bytes read as the wrong frame)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shared import _fastwire
from shared.objstore import ObjectReadError


def test_msg_line_sizes() -> None:
    assert _fastwire._msg_line(b"MSG a.b 1 12")[1:] == (0, 12)
    assert _fastwire._msg_line(b"MSG a.b 1 r.x 0")[1:] == (0, 0)
    assert _fastwire._msg_line(b"HMSG a.b 1 r.x 12 30")[1:] == (12, 30)
    for bad in (b"MSG a 1 -5", b"MSG a 1 r -1", b"HMSG a 1 -2 10", b"HMSG a 1 12 -30",
                b"HMSG a 1 20 10", b"HMSG a 1 0 10", b"MSG a 1", b"HMSG a 1 2",
                b"MSG a 1 x"):
        with pytest.raises(ValueError):
            _fastwire._msg_line(bad)


@pytest.mark.parametrize("frame", [b"MSG _INBOX.x 1 -5\r\n", b"HMSG _INBOX.x 1 -12 -2\r\n"])
async def test_reader_frames_refuse_negative_sizes(frame: bytes) -> None:
    fr = _fastwire._Frames()
    buf = fr.get_buffer(-1)
    buf[: len(frame)] = frame
    fr.buffer_updated(len(frame))
    assert isinstance(fr.error, ObjectReadError) and "sizes" in str(fr.error)


@pytest.mark.parametrize("frame", [b"MSG _INBOX.x.0 1 -5\r\n{}\r\n",
                                   b"HMSG _INBOX.x.0 1 -4 2\r\n{}\r\n"])
async def test_writer_link_refuses_negative_sizes(frame: bytes) -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    lk = _fastwire.Link(a)
    closed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    lk.on_close = closed.set_result
    lk.task = asyncio.ensure_future(lk._read_loop())
    try:
        b.sendall(frame)
        exc = await asyncio.wait_for(closed, 5)  # not a parser looping on the same line
        assert isinstance(exc, ObjectReadError) and "sizes" in str(exc)
    finally:
        await lk.close()
        b.close()


def test_server_error_names_a_refused_publish_as_the_bus_does() -> None:
    """nats-server's two refusals of a publish (its subject, or a reply subject it
    reserves) read as the 403 of :class:`shared.errors.PublishDenied`, subject unquoted
    (Go's %q); any other -ERR as the server's text."""
    err = _fastwire._server_error(
        b"-ERR 'Permissions Violation for Publish to \"$JS.API.DIRECT.GET.OBJ_b\"'", "x"
    )
    assert str(err) == (
        "permission denied: these NATS credentials lack publish permission on "
        "$JS.API.DIRECT.GET.OBJ_b"
    )
    err = _fastwire._server_error(
        b'-ERR \'Permissions Violation for Publish with Reply of "_R_.A\\"b"\'', "api.s"
    )
    assert 'publish to api.s: its reply subject _R_.A"b is one the server reserves' in str(err)
    err = _fastwire._server_error(b"-ERR 'Authorization Violation'", "x")
    assert str(err) == "server error: 'Authorization Violation'"
