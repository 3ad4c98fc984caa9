"""The bus client's header parse (``shared.bus._Client._parse_header_lines``): a cheaper
copy of nats-py's own, which must give the same headers for every block."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from shared.bus import _Client

reference = getattr(Client, "_parse_header_lines", None)
pytestmark = pytest.mark.skipif(
    reference is None, reason="this nats-py parses headers another way (never calls ours)"
)

BLOCKS = [
    b"",
    b"\r\n",
    b"Rollbus-Request-Id: 0123456789abcdef\r\n\r\n",
    b"Rollbus-Request-Id: abc\r\nRollbus-Deadline: 1764612345678\r\n\r\n",
    b"Rollbus-Rank: 3\r\nRollbus-Request-Id: x.y *z\r\n\r\n",
    b"A:b\r\nC:\tD \r\nE:  \r\n\r\n",  # no space after the colon; tab; empty value
    b"Url: http://h:1/p?q=a:b\r\n\r\n",  # colons in the value
    b"no colon here\r\nK: v\r\n\r\n",
    b"Bad Name: v\r\nGood: w\r\n\r\n",  # whitespace inside a name: skipped
    b"Tab\tName: v\r\nVt\x0bName: v\r\nFs\x1cName: v\r\nUs\x1fName: v\r\nOk: 1\r\n\r\n",
    b"  Padded  : v\r\n\r\n",  # whitespace around a name is stripped, not inside
    "Ünicode: v\r\nK: v\r\n\r\n".encode(),  # a non-ASCII name: skipped
    b"K: \xff\xfe bytes\r\n\r\n",  # a value that is not UTF-8: replaced
    "K: caf\u00e9 \u2603\r\n\r\n".encode(),  # UTF-8 values kept
    b"Dup: 1\r\nDup: 2\r\n\r\n",  # the last one wins
    b": no name\r\n\r\n",
    b"K: v",  # no final CRLF
    b"K: v\r\n\r\nAfter: blank\r\n",  # lines after an empty one still read
]


@pytest.mark.parametrize("raw", BLOCKS)
def test_same_headers_as_nats_py(raw: bytes) -> None:
    assert reference is not None
    assert _Client._parse_header_lines(raw) == reference(raw)


def test_every_ascii_character_in_a_name() -> None:
    assert reference is not None
    for c in range(128):
        raw = b"A" + bytes([c]) + b"B: v\r\nOk: 1\r\n\r\n"
        assert _Client._parse_header_lines(raw) == reference(raw), hex(c)


def test_the_client_parses_incoming_headers_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bytes] = []

    def spy(raw: bytes) -> dict[str, str]:
        seen.append(raw)
        return {"Spied": "1"}

    monkeypatch.setattr(_Client, "_parse_header_lines", staticmethod(spy))
    monkeypatch.setattr("nats.aio.client.parse_email", None, raising=False)
    got = asyncio.run(_Client()._process_headers(b"NATS/1.0\r\nK: v\r\n\r\n"))
    assert seen == [b"K: v\r\n\r\n"]
    assert got == {"Spied": "1"}


# ---------------------------------------------------------------- the header block we send

HEADER_DICTS: list[dict[str, str]] = [
    {},
    {"Rollbus-Request-Id": "0123456789abcdef"},
    {"Rollbus-Request-Id": "x.y *z", "Rollbus-Actor": "http:127.0.0.1:5", "Rollbus-Deadline": "1"},
    {"  Padded  ": "  v  "},  # names and values stripped
    {"K": "a\r\nb\rc\nd"},  # CR and LF in a value: spaces
    {"": "skipped", "K": "v"},  # an empty name: skipped
    {"   ": "skipped"},
    {"K": "caf\u00e9 \u2603"},  # UTF-8 values
    {"K": ""},
    {"Rollbus-Rank": "3", "Rollbus-Request-Id": "\u00fcn\u00ef"},
]


async def _sent(client: Client, headers: dict[str, str] | None) -> bytes:
    """The command ``client.publish`` hands to the socket for ``headers``."""
    out: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        out.append(cmd)

    client._send_command = capture  # type: ignore[method-assign]
    client._status = Client.CONNECTED
    client._flush_queue = None
    await client.publish("s.t", b"payload", reply="_INBOX.r", headers=headers)
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("headers", HEADER_DICTS)
def test_same_bytes_sent_as_nats_py(
    headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shared.bus

    built: list[bytes] = []
    real = shared.bus.header_block

    def spy(h: dict[str, str]) -> bytes:
        built.append(real(h))
        return built[-1]

    monkeypatch.setattr(shared.bus, "header_block", spy)
    ours = asyncio.run(_sent(_Client(), dict(headers)))
    theirs = asyncio.run(_sent(Client(), dict(headers)))
    assert ours == theirs
    assert len(built) == 1 and built[0] in ours  # our block went out, not nats-py's build


def test_bad_header_name_refused_as_nats_py() -> None:
    import nats.errors

    for client in (_Client(), Client()):
        with pytest.raises(nats.errors.BadHeaderError):
            asyncio.run(_sent(client, {"Bad Name": "v"}))


def test_no_headers_sent_as_nats_py() -> None:
    assert asyncio.run(_sent(_Client(), None)) == asyncio.run(_sent(Client(), None))


def test_hostile_headers_sent_as_nats_py() -> None:
    """Seeded random header dicts built from what could break a hand-built block: CR and
    LF (line injection), NUL, Unicode whitespace that ``str.strip`` removes (``\\x85``,
    ``\\u2028``, ``\\u3000``), non-ASCII, separators, empty and very long values. The bytes
    sent, or the error raised, are nats-py's own."""
    import random

    import nats.errors

    pieces = ["\r", "\n", "\r\n", " ", "\t", "\x00", "\x0b", "\x1c", "\x85", "\u2028",
              "\u3000", "é", "\u2603", ":", "-", "K", "x"]  # fmt: skip
    rng = random.Random(12)

    async def check() -> None:
        for case in range(1500):
            headers: dict[str, str] = {}
            for _ in range(rng.randint(0, 3)):
                name = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))
                headers[name] = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
            if case % 100 == 0:
                headers["Long"] = "v\r\n" * 40_000
            got: list[bytes | type[Exception]] = []
            for client in (_Client(), Client()):
                try:
                    got.append(await _sent(client, dict(headers)))
                except nats.errors.BadHeaderError:
                    got.append(nats.errors.BadHeaderError)
            assert got[0] == got[1], repr(headers)

    asyncio.run(check())
