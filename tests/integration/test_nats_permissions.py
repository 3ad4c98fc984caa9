"""Proof of every role's NATS permissions, against the embedded server's generated config
and against ``infra/nats/single.conf`` + ``auth.conf`` (an external server as deployed).

Each forbidden publish and subscribe of the table must come back as a permissions
violation from the server (nats-py's error callback), not as a timeout; each allowed path
must work; a client without or with wrong credentials is refused at connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from services import natsd
from shared import creds, objstore
from shared.bus import Bus
from shared.errors import NoResponders, Timeout
from shared.messages import VersionPublished
from tests import natsconf

I = "default"  # noqa: E741 - the instance token, as in rollbus.<i>.…
BUCKET = "rollbus_ckpt"


@dataclass
class Server:
    kind: str
    base: str
    users: dict[str, tuple[str, str]]

    def url(self, role: str) -> str:
        return creds.with_creds(self.base, *self.users[role])


@pytest.fixture(scope="module", params=["embedded", "auth_conf"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    Server
]:
    tmp = Path(tmp_path_factory.mktemp(f"auth-{request.param}"))
    if request.param == "embedded":
        users = creds.ensure(tmp / "creds")
        srv = natsd.start(tmp / "nats", port=0, users=users)
        try:
            yield Server("embedded", srv.url, users)
        finally:
            srv.stop()
        return
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp, passwords)
    node.start()
    try:
        yield Server("auth_conf", node.url, {r: (r, p) for r, p in passwords.items()})
    finally:
        node.stop()


class Client_:
    """A raw nats-py client logged in as a role, collecting the server's -ERRs."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    async def violation(self, what: str, subject: str) -> None:
        """The server's permissions violation for ``what`` ("publish"/"subscription")."""
        want = f'permissions violation for {what} to "{subject}"'.lower()
        await until(lambda: any(want in e.lower() for e in self.errors),
                    f"no violation for {what} to {subject}: {self.errors}", timeout=15)


async def routed(bus: Bus, subject: str) -> None:
    """Wait until a fresh responder's subscription is routed to this client's publishes
    (README: now and then a flushed subscription is not yet seen by another connection).
    The bound is generous: a loaded machine may take seconds to answer."""
    for _ in range(50):
        try:
            await bus.request(subject, b"{}", timeout=15)
            return
        except NoResponders:
            await asyncio.sleep(0.05)
    raise AssertionError(f"no responder on {subject}")


async def until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(0.02)


async def connect(url: str, role: str = "", inbox: str | None = None) -> Client_:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(
        url,
        error_cb=on_error,
        inbox_prefix=inbox or creds.inbox_prefix(role),
        allow_reconnect=False,
        connect_timeout=15,
    )
    return Client_(nc, errors)


@pytest.fixture
async def as_role(server: Server) -> AsyncIterator[object]:
    opened: list[Client_] = []

    async def open_(role: str, inbox: str | None = None) -> Client_:
        c = await connect(server.url(role), role, inbox)
        opened.append(c)
        return c

    yield open_
    for c in opened:
        await c.nc.close()


# ---------------------------------------------------------------------- the table

OTHER_INBOXES = {
    r: [f"_INBOX_{o}.>" for o in creds.ROLES if o != r] + ["_INBOX.>"] for r in creds.ROLES
}
OTHER_INBOXES["operator"].remove("_INBOX.>")  # the nats CLI's inbox, kept for ops

FORBIDDEN_PUBLISH = {
    "operator": [
        f"rollbus.{I}.worker.ctl.commit",
        f"rollbus.{I}.worker.ctl.ping",
        f"rollbus.{I}.worker.step",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.events.control",
        f"$O.{BUCKET}.C.forged",
        f"$O.{BUCKET}.M.forged",
        f"$JS.API.STREAM.INFO.OBJ_{BUCKET}",
        f"$JS.API.CONSUMER.CREATE.OBJ_{BUCKET}",
        f"$JS.API.STREAM.PURGE.OBJ_{BUCKET}",
        "rollbus.ckpt.tiny.published",
        # forged version events of models named ctl/events (they match rollbus.*.ctl.>)
        "rollbus.ckpt.ctl.published",
        "rollbus.ckpt.events.published",
        "_INBOX_api.x.y",
        "_INBOX_api.x.batch",  # the engine's batched token chunks: no forged tokens
        "_INBOX_engine.x.y",
        "$KV.rollbus_state.x",
        f"rollbus.{I}.weights.get.x",  # only the two read-only weights subjects
        # the fleet bucket: read and CAS only, never create, purge or delete
        "$JS.API.STREAM.CREATE.KV_rollbus_fleet",
        "$JS.API.STREAM.PURGE.KV_rollbus_fleet",
        "$JS.API.STREAM.DELETE.KV_rollbus_fleet",
    ],
    "trainer": [
        f"rollbus.{I}.ctl.pause",
        f"rollbus.{I}.ctl.update_weights",
        f"rollbus.{I}.ctl.sleep",
        f"rollbus.{I}.worker.ctl.commit",
        f"rollbus.{I}.worker.step",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.events.control",
        "_INBOX_engine.x.y",
        "_INBOX_api.x.y",
        "_INBOX_api.x.batch",
        "$JS.API.STREAM.DELETE.OBJ_rollbus_ckpt",
        "$JS.API.STREAM.INFO.ROLLBUS_EVENTS",
        "$KV.rollbus_state.x",
        f"rollbus.{I}.weights.0.x",
        "$KV.rollbus_fleet.x",
        "$JS.API.STREAM.INFO.KV_rollbus_fleet",
    ],
    "api": [
        f"rollbus.{I}.worker.ctl.commit",
        f"rollbus.{I}.worker.ctl.sleep",
        f"rollbus.{I}.worker.step",
        f"rollbus.{I}.events.control",
        f"$O.{BUCKET}.C.forged",
        "rollbus.ckpt.tiny.published",
        "rollbus.ckpt.ctl.published",
        "_INBOX_engine.x.y",
        # not even its own inboxes: another API process's tokens come from the engine only
        "_INBOX_api.x.y",
        "_INBOX_api.x.batch",
        "$JS.API.STREAM.INFO.ROLLBUS_EVENTS",
        f"rollbus.{I}.weights.get",
        f"rollbus.{I}.weights.0",
        "$KV.rollbus_state.x",
        "$JS.API.STREAM.CREATE.KV_rollbus_fleet",
        "$JS.API.STREAM.PURGE.KV_rollbus_fleet",
        "$JS.API.STREAM.DELETE.KV_rollbus_fleet",
    ],
    "engine": [
        f"$O.{BUCKET}.C.forged",
        # it reads objects' metas, never their chunks (the weights) nor batched gets
        f"$JS.API.DIRECT.GET.OBJ_{BUCKET}.$O.{BUCKET}.C.x",
        f"$JS.API.DIRECT.GET.OBJ_{BUCKET}",
        f"$JS.API.STREAM.MSG.GET.OBJ_{BUCKET}",
        "rollbus.ckpt.tiny.published",
        "rollbus.ckpt.worker.published",
        "rollbus.ckpt.events.published",
        "$JS.API.STREAM.PURGE.OBJ_rollbus_ckpt",
        "$JS.API.STREAM.DELETE.ROLLBUS_EVENTS",
        "$JS.API.STREAM.DELETE.KV_rollbus_fleet",
        "_INBOX_worker.x.y",
        f"rollbus.{I}.weights.get",
    ],
    "worker": [
        f"rollbus.{I}.ctl.pause",
        f"rollbus.{I}.ctl.update_weights",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.worker.step",
        f"rollbus.{I}.worker.ctl.commit",
        f"rollbus.{I}.events.control",
        f"$O.{BUCKET}.C.forged",
        f"$JS.API.STREAM.PURGE.OBJ_{BUCKET}",
        f"$JS.API.STREAM.MSG.DELETE.OBJ_{BUCKET}",
        "rollbus.ckpt.tiny.published",
        "_INBOX_api.x.y",
        "_INBOX_api.x.batch",
        "_INBOX_operator.x.y",
        "_INBOX_engine.x.y",  # unasked: a reply only to a request it received
        f"rollbus.{I}.weights.get",
        f"rollbus.{I}.weights.1",
        "$KV.rollbus_fleet.x",
        "$JS.API.STREAM.INFO.KV_rollbus_fleet",
    ],
}

FORBIDDEN_SUBSCRIBE = {
    "operator": [
        f"rollbus.{I}.ctl.>",
        f"rollbus.{I}.worker.>",
        f"rollbus.{I}.gen",
        f"$O.{BUCKET}.>",
        "rollbus.ckpt.>",
        ">",
        f"rollbus.{I}.weights.get",
        f"rollbus.{I}.weights.0",
        *OTHER_INBOXES["operator"],
    ],
    "trainer": [
        f"rollbus.{I}.ctl.>",
        f"rollbus.{I}.worker.>",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.events.>",
        f"rollbus.{I}.weights.get",
        f"rollbus.{I}.weights.0",
        *OTHER_INBOXES["trainer"],
    ],
    "api": [
        f"rollbus.{I}.ctl.>",
        f"rollbus.{I}.worker.>",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.weights.get",
        *OTHER_INBOXES["api"],
    ],
    "engine": [
        f"$O.{BUCKET}.>",
        "rollbus.ckpt.>",
        f"rollbus.{I}.weights.get",
        *OTHER_INBOXES["engine"],
    ],
    "worker": [
        f"rollbus.{I}.ctl.>",
        f"rollbus.{I}.gen",
        f"rollbus.{I}.events.>",
        "rollbus.ckpt.weights.published",  # matches rollbus.*.weights.*: denied
        "rollbus.ckpt.worker.published",
        *OTHER_INBOXES["worker"],
    ],
}


@pytest.mark.parametrize("role", creds.ROLES)
async def test_every_forbidden_publish_is_a_violation(role: str, as_role: object) -> None:
    c = await as_role(role)  # type: ignore[operator]
    for subject in FORBIDDEN_PUBLISH[role]:
        await c.nc.publish(subject, b"{}", reply=c.nc.new_inbox())
        await c.nc.flush()
        await c.violation("publish", subject)


@pytest.mark.parametrize("role", creds.ROLES)
async def test_every_forbidden_subscribe_is_a_violation(role: str, as_role: object) -> None:
    c = await as_role(role)  # type: ignore[operator]
    for subject in FORBIDDEN_SUBSCRIBE[role]:
        await c.nc.subscribe(subject)
        await c.nc.flush()
        await c.violation("subscription", subject)
    # joining the engine's or a rank's queue group to take calls away: refused too
    if role not in ("engine", "worker"):
        await c.nc.subscribe(f"rollbus.{I}.ctl.pause", queue="engine")
        await c.nc.flush()
        await c.violation("subscription", f"rollbus.{I}.ctl.pause")


async def test_a_request_on_a_forbidden_subject_reports_the_violation(as_role: object) -> None:
    c = await as_role("trainer")  # type: ignore[operator]
    with pytest.raises(TimeoutError):
        await c.nc.request(f"rollbus.{I}.ctl.pause", b"{}", timeout=0.5)
    await c.violation("publish", f"rollbus.{I}.ctl.pause")


async def test_without_or_with_wrong_credentials_connect_is_refused(server: Server) -> None:
    for url in (server.base, creds.with_creds(server.base, "operator", "S3cretNotShown")):
        with pytest.raises(nats.errors.Error, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=3)
        with pytest.raises(Exception) as e:
            start = time.monotonic()
            await Bus.connect(url, "test", timeout=30)
        # a refused login is final: no retrying until the timeout
        assert time.monotonic() - start < 10
        assert "authorization violation" in str(e.value)
        assert "S3cretNotShown" not in str(e.value)  # never the password


# ---------------------------------------------------------------------- what is allowed


async def test_allowed_control_gen_and_rank_paths(server: Server) -> None:
    """api -> engine control and streamed gen; engine -> ranks scatter; operator control
    with the nats CLI's own inbox; `$SRV.PING` discovery of engine and ranks."""
    engine = await Bus.connect(server.url("engine"), "engine")
    workers = [await Bus.connect(server.url("worker"), f"worker-{r}") for r in range(2)]
    api = await Bus.connect(server.url("api"), "api")
    try:
        svc = await engine.add_service("rollbus-engine", "0.1.0")

        async def pong(data: bytes, headers: dict[str, str]) -> bytes:
            return b'{"ok": true}'

        await engine.serve(svc, "pause", f"rollbus.{I}.ctl.pause", pong, queue="engine")

        async def on_gen(msg: nats.aio.msg.Msg) -> None:
            for i in range(3):  # several replies to one request: a streamed generation
                await engine.publish(msg.reply, str(i).encode())

        await engine.subscribe(f"rollbus.{I}.gen", on_gen, queue="engine")
        for r, w in enumerate(workers):
            wsvc = await w.add_service("rollbus-worker", "0.1.0")

            async def ping(data: bytes, headers: dict[str, str]) -> bytes:
                return b"{}"

            await w.serve(
                wsvc, "ping", f"rollbus.{I}.worker.ctl.ping", ping, queue=f"rank{r}",
                reply_headers={"Rollbus-Rank": str(r)},
            )
        await engine.flush()
        for w in workers:
            await w.flush()

        await routed(api, f"rollbus.{I}.ctl.pause")
        assert (await api.request(f"rollbus.{I}.ctl.pause", b"{}", timeout=5)).data
        got = []
        async for rep in api.stream(f"rollbus.{I}.gen", b"{}", idle_timeout=5):
            got.append(rep.data)
            if len(got) == 3:
                break
        assert got == [b"0", b"1", b"2"]
        for attempt in range(3):  # fresh ranks' subscriptions: see routed()
            try:
                reps = await engine.scatter(
                    f"rollbus.{I}.worker.ctl.ping", b"{}", expected=2, timeout=2
                )
                break
            except Timeout:
                if attempt == 2:
                    raise
        assert sorted(reps) == [0, 1]

        # an operator, as `nats req --server "$(rollbus creds operator)"` (inbox _INBOX.)
        op = await connect(server.url("operator"), inbox="_INBOX")
        try:
            rep = await op.nc.request(f"rollbus.{I}.ctl.pause", b"{}", timeout=5)
            assert json.loads(rep.data) == {"ok": True}
            # micro discovery: engine and both ranks answer $SRV.PING
            inbox = op.nc.new_inbox()
            seen: list[str] = []

            async def on_ping(msg: nats.aio.msg.Msg) -> None:
                seen.append(json.loads(msg.data)["name"])

            await op.nc.subscribe(inbox, cb=on_ping)
            await op.nc.publish("$SRV.PING", b"", reply=inbox)
            for _ in range(100):
                if len(seen) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert sorted(seen) == ["rollbus-engine", "rollbus-worker", "rollbus-worker"]
            assert op.errors == []
        finally:
            await op.nc.close()
    finally:
        for b in (api, *workers, engine):
            await b.close()


async def test_allowed_checkpoint_paths(server: Server) -> None:
    """trainer writes the bucket and the version event; a worker reads the bucket with our
    own reader; the engine follows versions, writes events and its KV; an operator reads
    the events."""
    # bounds here are for a loaded machine (connects, JetStream answers, deliveries)
    trainer = await Bus.connect(server.url("trainer"), "trainer", timeout=15)
    engine = await Bus.connect(server.url("engine"), "engine", timeout=15)
    worker = await Bus.connect(server.url("worker"), "worker", timeout=15)
    op = await connect(server.url("operator"), "operator")
    try:
        # the engine creates the stream and the bucket at start; the trainer only finds them
        await objstore.ensure_ckpt_stream(engine.nc, "tiny")
        await objstore.ensure_bucket(engine.nc, BUCKET)
        tnc = trainer.nc
        await objstore.ensure_ckpt_stream(tnc, "tiny")
        await objstore.ensure_bucket(tnc, BUCKET)
        data = bytes(range(256)) * 20000  # several chunks: flow control on the read
        meta = await objstore.put_object(tnc, BUCKET, f"tiny/{server.kind}/x", data)
        await objstore.put_object(tnc, BUCKET, f"tiny/{server.kind}/x", data)  # replace+purge
        ev = VersionPublished("tiny", server.kind, 2, len(data), publisher="test")
        seq = await objstore.publish_version(tnc, ev)
        assert [v.version for _, v in await objstore.list_versions(tnc, "tiny")][-1] == server.kind

        buf = await objstore.read_object(
            worker.nc, BUCKET, f"tiny/{server.kind}/x", expect_sha256=meta.digest,
            stall_timeout=30,
        )
        assert buf[: len(data)] == data

        enc = engine.nc
        # auto-update looks for an announced version's manifest (its meta only): there,
        # not there — a definite answer, not a timeout (None)
        assert await objstore.object_present(enc, BUCKET, f"tiny/{server.kind}/x", 10) is True
        assert await objstore.object_present(enc, BUCKET, "tiny/none/x", 10) is False
        await objstore.ensure_ckpt_stream(enc, "tiny")
        seen: list[int] = []

        async def on_version(s: int, e: VersionPublished) -> None:
            seen.append(s)

        # auto-update's durable feed and its catch-up list, as the engine runs them
        feed = objstore.VersionFeed(enc, "tiny", f"rollbus_test_{server.kind}")
        await feed.start()
        fetched = await feed.fetch(timeout=30)
        assert seq in [s for s, _, _ in fetched]
        for _, _, msg in fetched:
            await objstore.VersionFeed.ack(msg)
        assert seq in [s for s, _ in await objstore.list_versions(enc, "tiny")]
        sub = await objstore.watch_versions(enc, "tiny", on_version)
        await until(lambda: seq in seen, "the version event through watch_versions")
        await sub.unsubscribe()

        await objstore.ensure_events_stream(enc, f"rollbus.{I}.events.>")
        got: list[bytes] = []

        async def on_event(msg: nats.aio.msg.Msg) -> None:
            got.append(msg.data)

        # the operator follows events live (core subscription) and reads the stored ones
        # by direct get (no consumer: it may not create one)
        esub = await op.nc.subscribe(f"rollbus.{I}.events.>", cb=on_event)
        await op.nc.flush()
        # published again until it arrives: a flushed subscription may not yet be seen by
        # another connection (see routed)
        deadline = asyncio.get_running_loop().time() + 30
        while b'{"kind": "x"}' not in got:
            assert asyncio.get_running_loop().time() < deadline, "no event reached the operator"
            await engine.publish(f"rollbus.{I}.events.control", b'{"kind": "x"}')
            with contextlib.suppress(AssertionError):
                await until(lambda: bool(got), "the event", timeout=1)
        await esub.unsubscribe()
        stored = await op.nc.jetstream().get_last_msg(
            "ROLLBUS_EVENTS", f"rollbus.{I}.events.control", direct=True
        )
        assert stored.data == b'{"kind": "x"}'
        history = await objstore._direct_all(
            op.nc, "ROLLBUS_EVENTS", f"rollbus.{I}.events.>", timeout=30
        )
        assert b'{"kind": "x"}' in [h.data for h in history]

        kv = await enc.jetstream().create_key_value(bucket=natsd.KV_BUCKET)
        await kv.put(f"{I}.state", b"serving")
        assert (await kv.get(f"{I}.state")).value == b"serving"
        await kv.delete(f"{I}.state")
        assert op.errors == []
    finally:
        await op.nc.close()
        for b in (trainer, engine, worker):
            await b.close()


async def test_a_second_instance_joins_with_the_same_credentials(server: Server) -> None:
    """Grants are for every instance (`rollbus.*.`): instance B beside A works as is."""
    engine = await Bus.connect(server.url("engine"), "engine-b")
    api = await Bus.connect(server.url("api"), "api-b")
    try:
        svc = await engine.add_service("rollbus-engine", "0.1.0")

        async def ok(data: bytes, headers: dict[str, str]) -> bytes:
            return b"b"

        await engine.serve(svc, "ping", "rollbus.b.ctl.ping", ok, queue="engine")
        await engine.flush()
        await routed(api, "rollbus.b.ctl.ping")
        assert (await api.request("rollbus.b.ctl.ping", b"{}", timeout=5)).data == b"b"
    finally:
        await api.close()
        await engine.close()


async def test_fleet_discovery_and_record_paths(server: Server) -> None:
    """The engine creates the fleet bucket and is discovered by its service metadata; api
    and operator create and compare-and-set transaction records; the engine reads and
    CAS-writes them too (the instance's side of the protocol)."""
    from shared import fleet

    engine = await Bus.connect(server.url("engine"), "engine-f")
    api = await Bus.connect(server.url("api"), "api-f")
    op = await Bus.connect(server.url("operator"), "operator-f")
    try:
        await fleet.ensure_bucket(engine.nc, 1)
        await engine.add_service(fleet.SERVICE, "0.1.0", metadata={"instance": "fa"})
        await engine.flush()
        for bus in (api, op):
            found = await fleet.discover(bus.nc, 1.0)
            assert "fa" in [i.instance for i in found]
        rec = fleet.Record(fleet.new_txn_id(), "v1", ["fa"], "staged")
        await fleet.FleetBucket(api.nc).create(rec)
        got = await fleet.FleetBucket(op.nc).get(rec.txn)
        assert got is not None and got[0].decision == "staged"
        # an instance's abort is first; the coordinator's late commit loses
        by_engine = await fleet.FleetBucket(engine.nc).decide(rec.txn, "abort", "instance", "t")
        assert by_engine is not None and by_engine.decision == "abort"
        late = await fleet.FleetBucket(api.nc).decide(rec.txn, "commit", "coordinator", "t")
        assert late is not None and late.decision == "abort"
        rec2 = fleet.Record(fleet.new_txn_id(), "v1", ["fa"], "staged")
        await fleet.FleetBucket(op.nc).create(rec2)
        assert (await fleet.FleetBucket(op.nc).decide(rec2.txn, "commit", "coordinator", "t")
                ).decision == "commit"  # type: ignore[union-attr]
    finally:
        for b in (op, api, engine):
            await b.close()


async def test_fleet_member_records_paths(server: Server) -> None:
    """The engine writes and deletes its member record; api and operator list them (stream
    info by subject, no consumer) and read them; the model travels in the metadata."""
    import time

    from shared import fleet

    engine = await Bus.connect(server.url("engine"), "engine-m")
    api = await Bus.connect(server.url("api"), "api-m")
    op = await Bus.connect(server.url("operator"), "operator-m")
    try:
        await fleet.ensure_bucket(engine.nc, 1)
        await engine.add_service(fleet.SERVICE, "0.1.0",
                                 metadata={"instance": "fm", "model": "tiny"})
        await engine.flush()
        found = {i.instance: i for i in await fleet.discover(op.nc, 1.0)}
        assert found["fm"].model == "tiny"
        now = time.time()
        for name in ("fm", "fm.silent/x"):
            await fleet.FleetBucket(engine.nc).put_member(
                fleet.Member(name, "tiny", 123, now, now))
        for bus in (api, op):
            got = {m.instance: m for m in await fleet.FleetBucket(bus.nc).members()}
            assert {"fm", "fm.silent/x"} <= set(got) and got["fm"].pid == 123
        await fleet.FleetBucket(engine.nc).delete_member("fm.silent/x")
        got = {m.instance for m in await fleet.FleetBucket(op.nc).members()}
        assert "fm" in got and "fm.silent/x" not in got
    finally:
        for b in (op, api, engine):
            await b.close()


async def test_fleet_cas_race_has_one_winner(server: Server) -> None:
    """Two writers at once on a ``staged`` record: exactly one decision lands."""
    from shared import fleet

    engine = await Bus.connect(server.url("engine"), "engine-r")
    api = await Bus.connect(server.url("api"), "api-r")
    try:
        await fleet.ensure_bucket(engine.nc, 1)
        for _ in range(5):
            rec = fleet.Record(fleet.new_txn_id(), "v1", ["a"], "staged")
            await fleet.FleetBucket(api.nc).create(rec)
            a, b = await asyncio.gather(
                fleet.FleetBucket(api.nc).decide(rec.txn, "commit", "coordinator", "c"),
                fleet.FleetBucket(engine.nc).decide(rec.txn, "abort", "instance", "i"),
            )
            assert a is not None and b is not None and a.decision == b.decision
            final = await fleet.FleetBucket(api.nc).get(rec.txn)
            assert final is not None and final[0].decision == a.decision
    finally:
        await api.close()
        await engine.close()


def test_rollbus_creds_finds_the_running_servers_port(tmp_path: Path) -> None:
    """`NATS_PORT=0` (any free port): `rollbus creds` reads the port the server took."""
    from shared.settings import Settings

    data = tmp_path / "data"
    users = creds.ensure(data / "creds")
    srv = natsd.start(data / "nats", port=0, users=users)
    try:
        s = Settings(data_dir=data, nats_port=0)
        assert creds.local_server_url(s) == srv.url
    finally:
        srv.stop()
    assert creds.local_server_url(s) == "nats://127.0.0.1:0"  # stopped: the setting again


# ---------------------------------------------------------------------- bypasses found in review

# subjects a role must not publish to, as push-consumer deliver subjects (with the queue
# group of their real subscribers)
TARGETS = [
    (f"rollbus.{I}.ctl.pause", "engine"),
    (f"rollbus.{I}.worker.ctl.sleep", "rank0"),
    (f"rollbus.{I}.gen", "engine"),
    (f"rollbus.{I}.worker.step", "rank0"),
]
STREAMS = {
    "trainer": [f"OBJ_{BUCKET}", "ROLLBUS_CKPT"],
    "worker": [f"OBJ_{BUCKET}"],
    "operator": ["ROLLBUS_EVENTS"],
    "api": [f"OBJ_{BUCKET}", "ROLLBUS_EVENTS"],
}


async def _stored(server: Server) -> None:
    """The streams, as the engine creates them at start, each with something stored."""
    engine = await Bus.connect(server.url("engine"), "engine-setup")
    trainer = await Bus.connect(server.url("trainer"), "trainer-setup")
    try:
        await objstore.ensure_ckpt_stream(engine.nc, "tiny")
        await objstore.ensure_bucket(engine.nc, BUCKET)
        await objstore.ensure_events_stream(engine.nc, f"rollbus.{I}.events.>")
        await engine.publish(f"rollbus.{I}.events.control", b'{"mode": "abort"}')
        await objstore.put_object(trainer.nc, BUCKET, "tiny/bypass/x", b'{"mode": "abort"}')
        ev = VersionPublished("tiny", "bypass", 1, 1, publisher="test")
        await objstore.publish_version(trainer.nc, ev)
    finally:
        await trainer.close()
        await engine.close()


async def _spies(as_role: object) -> list[bytes]:
    """The real subscribers of TARGETS (engine and rank queue groups): what reaches them."""
    got: list[bytes] = []

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)

    engine = await as_role("engine")  # type: ignore[operator]
    worker = await as_role("worker")  # type: ignore[operator]
    for subject, queue in TARGETS:
        spy = worker if ".worker." in subject else engine
        await spy.nc.subscribe(subject, queue=queue, cb=on_msg)
    for c in (engine, worker):
        await c.nc.flush()
    return got


@pytest.mark.parametrize("role", list(STREAMS))
async def test_push_consumer_into_a_forbidden_subject_is_refused(
    role: str, server: Server, as_role: object
) -> None:
    """Bypass 1: a push consumer whose deliver subject is a subject the role may not
    publish to (the server does not check it): no role but the engine may create one."""
    await _stored(server)
    got = await _spies(as_role)
    c = await as_role(role)  # type: ignore[operator]
    for stream in STREAMS[role]:
        for subject, queue in TARGETS:
            cfg = {
                "deliver_subject": subject, "deliver_group": queue, "deliver_policy": "all",
                "ack_policy": "none", "name": "evil",
            }
            body = json.dumps({"stream_name": stream, "config": cfg}).encode()
            for api_subject in (
                f"$JS.API.CONSUMER.CREATE.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}.evil",
                f"$JS.API.CONSUMER.CREATE.{stream}.evil.{subject}",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.evil",
            ):
                await c.nc.publish(api_subject, body, reply=c.nc.new_inbox())
                await c.nc.flush()
                await c.violation("publish", api_subject)
    # and nats-py's own call fails (no answer), it does not create the consumer
    with pytest.raises(nats.errors.TimeoutError):
        await c.nc.jetstream(timeout=1).add_consumer(
            STREAMS[role][0], deliver_subject=TARGETS[0][0], deliver_group="engine"
        )
    await asyncio.sleep(0.5)
    assert got == []


@pytest.mark.parametrize("role", ["trainer", "worker", "operator", "api"])
async def test_stream_create_or_update_is_refused(
    role: str, server: Server, as_role: object
) -> None:
    """Bypass 2: the trainer added `gen`, `worker.step`, `ctl.update_weights` to its
    stream's subjects and read every prompt back. Only the engine creates or changes a
    stream; the subjects stay what it set."""
    await _stored(server)
    c = await as_role(role)  # type: ignore[operator]
    grab = [f"rollbus.{I}.gen", f"rollbus.{I}.worker.step", f"rollbus.{I}.ctl.update_weights"]
    for stream in ("ROLLBUS_CKPT", f"OBJ_{BUCKET}", "ROLLBUS_EVENTS", "EVIL"):
        body = json.dumps({"name": stream, "subjects": grab}).encode()
        for op in ("CREATE", "UPDATE"):
            subject = f"$JS.API.STREAM.{op}.{stream}"
            await c.nc.publish(subject, body, reply=c.nc.new_inbox())
            await c.nc.flush()
            await c.violation("publish", subject)
    engine = await as_role("engine")  # type: ignore[operator]
    js = engine.nc.jetstream()
    assert (await js.stream_info("ROLLBUS_CKPT")).config.subjects == ["rollbus.ckpt.*.published"]
    assert (await js.stream_info(f"OBJ_{BUCKET}")).config.subjects == [f"$O.{BUCKET}.C.>",
                                                                       f"$O.{BUCKET}.M.>"]


async def test_reflected_messages_reach_no_handler(server: Server, as_role: object) -> None:
    """A JetStream API answer, a direct get or another responder's reply sent to a
    subject named as reply (the server and responders publish wherever a reply subject
    says) is not a request: the bus drops it before any handler runs, and a responder
    never answers into anything but an inbox."""
    await _stored(server)
    engine = await Bus.connect(server.url("engine"), "engine")
    worker = await Bus.connect(server.url("worker"), "worker")
    calls: list[str] = []
    try:
        svc = await engine.add_service("rollbus-engine", "0.1.0")
        wsvc = await worker.add_service("rollbus-worker", "0.1.0")

        def handler(name: str):  # type: ignore[no-untyped-def]
            async def h(data: bytes, headers: dict[str, str]) -> bytes:
                calls.append(name)
                return b'{"ok": true}'

            return h

        await engine.serve(svc, "pause", f"rollbus.{I}.ctl.pause", handler("pause"),
                           queue="engine")
        await engine.serve(svc, "is_paused", f"rollbus.{I}.ctl.is_paused",
                           handler("is_paused"), queue="engine")
        await worker.serve(wsvc, "sleep", f"rollbus.{I}.worker.ctl.sleep", handler("sleep"),
                           queue="rank0")
        steps: list[bytes] = []

        async def on_step(msg: nats.aio.msg.Msg) -> None:
            steps.append(msg.data)

        await worker.subscribe(f"rollbus.{I}.worker.step", on_step, queue="rank0")
        await engine.flush()
        await worker.flush()

        w = await as_role("worker")  # type: ignore[operator]
        meta = await objstore.get_meta(w.nc, BUCKET, "tiny/bypass/x")
        get = json.dumps({"last_by_subj": f"$O.{BUCKET}.C.{meta.nuid}"}).encode()
        for target in (f"rollbus.{I}.ctl.pause", f"rollbus.{I}.worker.step"):
            await w.nc.publish(f"$JS.API.DIRECT.GET.OBJ_{BUCKET}", get, reply=target)
            await w.nc.publish(f"$JS.API.STREAM.INFO.OBJ_{BUCKET}", b"", reply=target)
        # the api makes the engine answer into a rank's subject
        a = await as_role("api")  # type: ignore[operator]
        await a.nc.publish(f"rollbus.{I}.ctl.is_paused", b"{}",
                           reply=f"rollbus.{I}.worker.ctl.sleep")
        # the operator makes the engine answer into an API process's batch inbox (where
        # only the engine's batched token chunks belong)
        o = await as_role("operator")  # type: ignore[operator]
        await o.nc.publish(f"rollbus.{I}.ctl.is_paused", b"{}", reply="_INBOX_api.x.batch")
        await w.nc.flush()
        await a.nc.flush()
        await o.nc.flush()
        for _ in range(100):
            if engine.dropped_requests >= 4 and worker.dropped_requests >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert calls == [] and steps == []
        assert engine.dropped_requests >= 4 and worker.dropped_requests >= 2
        # a real request still works
        api = await Bus.connect(server.url("api"), "api")
        try:
            await routed(api, f"rollbus.{I}.ctl.pause")
        finally:
            await api.close()
        assert "pause" in calls
    finally:
        await worker.close()
        await engine.close()


async def test_micro_discovery_answers_only_into_an_inbox(server: Server, as_role: object) -> None:
    """nats micro answers `$SRV.PING/INFO/STATS` with the responder's own permissions: an
    operator (or the api) naming the events stream, the engine's KV or a rank's subject as
    reply would make the engine publish there (a forged event, a KV entry, a purge). The
    bus answers discovery only into an inbox."""
    engine = await Bus.connect(server.url("engine"), "engine")
    try:
        await engine.add_service("rollbus-engine", "0.1.0")
        await engine.flush()
        op = await as_role("operator", inbox="_INBOX")  # type: ignore[operator]
        forged: list[str] = []

        async def on_event(msg: nats.aio.msg.Msg) -> None:
            forged.append(msg.subject)

        await op.nc.subscribe(f"rollbus.{I}.events.>", cb=on_event)
        await op.nc.flush()
        for verb in ("PING", "INFO", "STATS"):
            for subject in (f"$SRV.{verb}", f"$SRV.{verb}.rollbus-engine"):
                await op.nc.publish(subject, b"", reply=f"rollbus.{I}.events.forged")
        await until(lambda: engine.dropped_requests >= 6, "forged discovery dropped")
        # discovery into an inbox still answers (after it, anything forged would be here)
        rep = await op.nc.request("$SRV.PING.rollbus-engine", b"", timeout=10)
        assert json.loads(rep.data)["name"] == "rollbus-engine"
        await op.nc.flush()
        assert forged == []
        assert op.errors == []
    finally:
        await engine.close()


STORED_S = 20.0  # how long the responder waits to see a request stored before it answers


async def test_a_jetstream_ack_in_a_request_inbox_is_dropped(nats_url: str) -> None:
    """Bypass 2's second half: a stream that captures a request's subject sends its
    publish ack to the request's reply inbox. The bus drops and counts it; the request
    gets its responder's real reply."""
    responder = await Bus.connect(nats_url, "responder")
    caller = await Bus.connect(nats_url, "caller")
    js = caller.nc.jetstream()
    await js.add_stream(name="JSACK_TEST", subjects=["jsack.test.*"])
    rjs = responder.nc.jetstream()

    async def after_the_ack(subject: str, rid: str) -> None:
        """Answer only once the stream has stored the request (its ack is then on its way
        to the caller, ahead of our reply): on a loaded machine a fixed sleep let the
        reply overtake the ack, and the test proved nothing."""
        # bounded in time, not in rounds: each look is a JetStream request, which a loaded
        # host (CI's two lanes) answers slowly; the caller waits longer than this
        deadline = asyncio.get_running_loop().time() + STORED_S
        while True:
            try:
                last = await rjs.get_last_msg("JSACK_TEST", subject)
                if (last.headers or {}).get("Rollbus-Request-Id") == rid:
                    break
            except nats.js.errors.NotFoundError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the request on {subject} was never stored")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)

    try:
        svc = await responder.add_service("jsack", "0.1.0")

        async def slow(data: bytes, headers: dict[str, str]) -> bytes:
            if data == b"probe":
                return b"routed"
            await after_the_ack("jsack.test.ctl", headers.get("Rollbus-Request-Id", ""))
            return b"real"

        await responder.serve(svc, "ctl", "jsack.test.ctl", slow, queue="q")

        async def chunks(msg: nats.aio.msg.Msg) -> None:
            rid = (msg.headers or {}).get("Rollbus-Request-Id", "")
            await after_the_ack("jsack.test.gen", rid)
            await responder.publish(msg.reply, b"chunk", headers={"Rollbus-Request-Id": rid})

        await responder.subscribe("jsack.test.gen", chunks)
        await responder.flush()
        # routed(): the stream captures the subject, so a request the responder's
        # subscription does not see yet gets the stream's ack (dropped), never
        # NoResponders: it timed out (a loaded full run). Probes are answered at once and
        # retried on a timeout too.
        deadline = asyncio.get_running_loop().time() + STORED_S
        while True:
            try:
                await caller.request("jsack.test.ctl", b"probe", timeout=1)
                break
            except (NoResponders, Timeout):
                assert asyncio.get_running_loop().time() < deadline, "never routed"
        before = caller.dropped_replies
        reply = await caller.request("jsack.test.ctl", b"{}", timeout=STORED_S + 10)
        assert reply.data == b"real"
        async for rep in caller.stream("jsack.test.gen", b"{}", idle_timeout=STORED_S + 10):
            assert rep.data == b"chunk"
            break
        assert caller.dropped_replies >= before + 2
    finally:
        await js.delete_stream("JSACK_TEST")
        await caller.close()
        await responder.close()


async def test_trainer_and_operator_read_the_served_weights(server: Server) -> None:
    """The read-only weights subjects: ranks (worker role) answer `weights.get` and
    `weights.<r>` with the real serving code; the trainer and the operator read every
    rank's shard through `rollout_state_dict` and get the full tensors back — neither may
    call `worker.ctl` (FORBIDDEN_PUBLISH) nor answer `weights.*` (FORBIDDEN_SUBSCRIBE)."""
    import numpy as np

    from services.trainer.rollout import arollout_state_dict
    from services.worker import readout
    from shared import readout as ro
    from shared import sharding
    from shared.model_config import ModelConfig
    from shared.subjects import Subjects

    hf = {"model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1}
    cfg = ModelConfig.from_hf(hf)
    full = sharding.init_weights(cfg, seed=3)
    subjects = Subjects(I)
    engine = await Bus.connect(server.url("engine"), "engine")
    workers = [await Bus.connect(server.url("worker"), f"worker-{r}") for r in range(2)]
    try:
        svc = await engine.add_service("rollbus-engine", "0.1.0")

        async def model_config(data: bytes, headers: dict[str, str]) -> bytes:
            body = {"request_id": "x", "result": {"model": "m", "tp": 2, "config": hf}}
            return json.dumps(body).encode()

        await engine.serve(svc, "model_config", subjects.ctl("model_config"), model_config,
                           queue="engine")
        for r, w in enumerate(workers):
            shard = {n: sharding.shard_tensor(cfg, n, a, r, 2) for n, a in full.items()}
            reads = readout.Reads(r, 2, w.nc.max_payload)

            async def open_read(args: ro.ReadArgs, reads=reads, shard=shard) -> dict:  # type: ignore[no-untyped-def]
                return reads.open_read("v7", shard, args)

            wsvc = await w.add_service("rollbus-worker", "0.1.0")
            await readout.serve(w, wsvc, subjects, reads, open_read, {"Rollbus-Rank": str(r)})
            await w.flush()
        await engine.flush()
        for role in ("trainer", "operator"):
            for attempt in range(3):  # fresh subscriptions: see routed()
                try:
                    # 4 KiB chunks: each rank's shard comes in many chunk requests
                    got = await arollout_state_dict(
                        server.url(role), I, timeout=5, chunk_bytes=4096
                    )
                    break
                except (NoResponders, Timeout):
                    if attempt == 2:
                        raise
                    await asyncio.sleep(0.2)
            assert got.version == "v7" and got.tp == 2
            assert sorted(got) == sorted(full)
            for n, a in full.items():
                assert got[n].dtype == a.dtype and np.array_equal(got[n], a), n
    finally:
        for b in (*workers, engine):
            await b.close()
