"""A request whose publish nats-server refuses (a permissions violation, which nats-py
only hands to ``error_cb``: the connection stays up) fails at once with
:class:`PublishDenied` naming that subject, instead of waiting out its timeout for a
reply that cannot come; a request on another subject waiting at the same time is left
alone. Real nats-server with ``infra/nats/auth.conf``.

No timing is asserted: without the fix each call below ends in ``Timeout`` (or
``nats.errors.TimeoutError``) after its timeout, which the assertions refuse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest

from shared import objstore
from shared.bus import REQUEST_ID, Bus, _Client
from shared.errors import FORBIDDEN, PublishDenied
from tests import natsconf

I = "default"  # noqa: E741 - the instance token, as in rollbus.<i>.…
# operator may publish rollbus.*.ctl.> but not rollbus.*.worker.> (README, role table);
# mixed case: the subject is named in its own case (nats-py lowercases the -ERR text)
DENIED = f"rollbus.{I}.worker.Denied"
ALLOWED = f"rollbus.{I}.ctl.allowed"
WAIT_S = 20.0  # what each call would wait without the fix


@pytest.fixture
async def roles(tmp_path: Path) -> AsyncIterator[tuple[Bus, Bus]]:
    """An operator's bus (the caller) and an engine's (a responder on ALLOWED)."""
    async with natsconf.role_buses(tmp_path, ("operator", "engine")) as (_, buses):
        yield buses["operator"], buses["engine"]


async def _held_responder(engine: Bus) -> tuple[asyncio.Event, asyncio.Event]:
    """The engine answers requests on ALLOWED only once ``release`` is set (the request
    stays waiting meanwhile); ``asked`` is set when one came: ``(release, asked)``."""
    release, asked = asyncio.Event(), asyncio.Event()

    async def answer(msg: object) -> None:
        asked.set()
        await release.wait()
        await engine.nc.publish(msg.reply, b"b", headers={REQUEST_ID: msg.headers[REQUEST_ID]})  # type: ignore[attr-defined]

    await engine.nc.subscribe(ALLOWED, cb=answer)
    await engine.nc.flush()
    return release, asked


async def test_a_refused_publish_fails_its_request_at_once_and_no_other(
    roles: tuple[Bus, Bus],
) -> None:
    op, engine = roles
    release, asked = await _held_responder(engine)

    other = asyncio.ensure_future(op.request(ALLOWED, b"{}", timeout=WAIT_S))
    await asyncio.wait_for(asked.wait(), WAIT_S)  # B is out and waiting
    with pytest.raises(PublishDenied) as denied:
        await op.request(DENIED, b"{}", timeout=WAIT_S)
    assert denied.value.code == FORBIDDEN and denied.value.subject == DENIED
    assert f"lack publish permission on {DENIED}" in denied.value.message
    assert DENIED in op.denied
    assert not other.done()  # B's waiter was not failed by A's violation
    release.set()
    assert (await other).data == b"b"

    # a scatter and nats-py's own request (every JetStream API call) alike
    with pytest.raises(PublishDenied):
        await op.scatter(DENIED, b"{}", expected=2, timeout=WAIT_S)
    js_create = "$JS.API.STREAM.CREATE.EVIL"
    with pytest.raises(PublishDenied) as denied:
        await op.nc.request(js_create, b"{}", timeout=WAIT_S)
    assert denied.value.subject == js_create
    assert op.pending == 0 and not op.nc._asked  # type: ignore[attr-defined]


@pytest.mark.parametrize("tail", ['a"b', "a'b", "a\\b", "zero\u200bwidth", "é"])
async def test_a_subject_the_server_quotes_with_escapes_is_matched(
    roles: tuple[Bus, Bus], tail: str
) -> None:
    """nats-server quotes the subject with Go's %q: a '"' or '\\' in it, or a character
    Go deems unprintable, arrives escaped. Matched on the escaped text, such a request
    waited out its timeout and ``denied`` named a subject never sent."""
    op, _ = roles
    subject = f"rollbus.{I}.worker.{tail}"
    with pytest.raises(PublishDenied) as denied:
        await op.request(subject, b"{}", timeout=WAIT_S)
    assert denied.value.subject == subject
    assert list(op.denied) == [subject]


async def test_a_request_whose_publish_raises_leaves_no_waiter(roles: tuple[Bus, Bus]) -> None:
    """nats-py registers its request's future before publishing and, when the publish
    raises (here: larger than the server's max_payload), never resolves it: the watch
    kept it (and nats-py's own map) for the connection's life."""
    op, _ = roles
    with pytest.raises(nats.errors.MaxPayloadError):
        await op.nc.request(DENIED, b"x" * (op.max_payload + 1), timeout=WAIT_S)
    assert not op.nc._asked  # type: ignore[attr-defined]
    assert not op.nc._resp_map  # type: ignore[attr-defined]


async def test_object_present_without_the_permission_is_refused_not_unknown(
    roles: tuple[Bus, Bus],
) -> None:
    """``object_present`` is None when it cannot be told (no answer); a look the server
    refuses is known at once and raised as such (403, naming the subject), so that its
    caller (the auto-update's ``pending``) can say "refused" rather than "no answer"."""
    op, _ = roles  # the operator may not direct-get the bucket's metas
    with pytest.raises(PublishDenied) as denied:
        await objstore.object_present(op.nc, "rollbus_ckpt", "m/v1/manifest.json", WAIT_S)
    assert denied.value.subject.startswith("$JS.API.DIRECT.GET.OBJ_rollbus_ckpt.$O.")
    assert op.pending == 0 and not op.nc._asked  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunk", [0, 1, 7])
async def test_refusals_read_together_or_split_each_name_their_own_subject(
    roles: tuple[Bus, Bus], chunk: int
) -> None:
    """The subject's own case comes from nats-py's parser buffer, whose head must be the
    -ERR line being handled: several -ERR lines read at once (chunk 0: the reads as they
    come, all the requests' refusals together), or one split across reads (the reads fed
    to the parser ``chunk`` bytes at a time), each names its own subject."""
    op, _ = roles
    parse = op.nc._ps.parse  # type: ignore[attr-defined]

    async def split(data: bytes = b"") -> None:
        for i in range(0, len(data), chunk):
            await parse(data[i : i + chunk])

    if chunk:
        op.nc._ps.parse = split  # type: ignore[attr-defined]
    subjects = [f"rollbus.{I}.worker.Case{i}x" for i in range(5)] + [f"rollbus.{I}.worker.CASE0X"]
    got = await asyncio.gather(
        *(op.request(s, b"{}", timeout=WAIT_S) for s in subjects), return_exceptions=True
    )
    assert [getattr(e, "subject", e) for e in got] == subjects
    assert sorted(op.denied) == sorted(subjects)


async def test_a_refused_subscription_fails_no_request(roles: tuple[Bus, Bus]) -> None:
    """nats-server refuses a subscription with a like -ERR (``Permissions Violation for
    Subscription to "<subject>"``): a request waiting on that very subject is not failed."""
    op, engine = roles
    release, asked = await _held_responder(engine)
    waiting = asyncio.ensure_future(op.request(ALLOWED, b"{}", timeout=WAIT_S))
    await asyncio.wait_for(asked.wait(), WAIT_S)
    await op.nc.subscribe(ALLOWED)  # the operator may publish there, not subscribe

    async def refused() -> None:  # its -ERR may come after a flush's PONG: wait for it
        while "subscription to" not in str(op.nc.last_error).lower():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(refused(), WAIT_S)
    assert not waiting.done() and not op.denied
    release.set()
    assert (await waiting).data == b"b"


async def test_a_refused_stream_fails_at_once(roles: tuple[Bus, Bus]) -> None:
    op, _ = roles
    with pytest.raises(PublishDenied) as denied:
        async for _ in op.stream(DENIED, b"{}", idle_timeout=WAIT_S):
            pass
    assert denied.value.subject == DENIED
    assert op.pending == 0


async def test_a_refused_reply_subject_fails_its_request_at_once(tmp_path: Path) -> None:
    """nats-server refuses a publish whose reply subject it reserves for itself (``_R_.``:
    service imports' replies), whatever the permissions, with its own wording:
    ``Permissions Violation for Publish with Reply of "<reply>"``. That -ERR names the
    reply, not the subject: unmatched, such a request waited out its timeout. Here a
    client whose inbox prefix is ``_R_`` (an operator allowed to read it)."""
    passwords = natsconf.role_passwords()
    op_perms = natsconf.without("operator")
    op_perms["subscribe"].append("_R_.>")
    node = natsconf.single_with_perms(tmp_path, passwords, {"operator": op_perms})
    node.start()
    nc = _Client()
    try:
        url = f"nats://operator:{passwords['operator']}@127.0.0.1:{node.port}"
        await nc.connect(servers=[url], inbox_prefix="_R_", allow_reconnect=False)
        op = Bus(nc, "test-operator")
        await op._start()
        with pytest.raises(PublishDenied) as denied:
            await op.request(ALLOWED, b"{}", timeout=WAIT_S)
        assert denied.value.code == FORBIDDEN and denied.value.subject == ALLOWED
        assert denied.value.reply.startswith(f"{op._inbox_prefix}.")
        assert f"reply subject {denied.value.reply} is one the server reserves" in str(denied.value)
        assert passwords["operator"] not in str(denied.value)
        with pytest.raises(PublishDenied) as denied:  # nats-py's own request alike
            await nc.request(ALLOWED, b"{}", timeout=WAIT_S)
        assert denied.value.reply.startswith("_R_.")
        assert not op.denied  # the subject itself was not refused
        assert op.pending == 0 and not nc._asked
    finally:
        await nc.close()
        node.stop()
