"""The auto-update loop (:func:`services.engine.autoupdate.follow`) whose pull the server
refuses for good (the engine's ``$JS.API.CONSUMER.MSG.NEXT`` grant missing: an
auth.conf edited by hand, or older than the code): it says so once and backs off, up
to ``RETRY_MAX_S`` between tries. It retried every ``RETRY_S`` (1 s) for ever: a
refused fetch and a consumer re-creation each second, and one permissions-violation
error line a second in nats-server's log. A reconnect (any other feed error) is still
retried every ``RETRY_S``. Real nats-server; the refusals counted as the server sends
them (a second watcher on the engine's connection)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.engine import autoupdate
from shared import objstore
from shared.bus import Bus
from shared.errors import PublishDenied
from shared.messages import VersionPublished
from shared.subjects import CKPT_STREAM
from tests import natsconf

PULL_API = f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.>"
RUN_S = 8.0


async def follow_refused(
    bus: Bus, subject: str, caplog: pytest.LogCaptureFixture
) -> list[PublishDenied]:
    """Run the loop for ``RUN_S`` on an engine (instance ``i0``, model ``m``, on ``v0``) of
    ``bus``, still running at the end: the refusals of ``subject`` the server sent it."""
    engine = SimpleNamespace(
        bus=bus,
        state=SimpleNamespace(weight_version="v0"),
        settings=SimpleNamespace(served_model_name="m", instance="i0"),
        auto_update_waiting=None,
        latest_published="",
    )
    refused: list[PublishDenied] = []
    bus.nc.watch_refusal(subject, "", refused.append)  # type: ignore[attr-defined]
    caplog.set_level(logging.DEBUG, logger="rollbus")
    task = asyncio.ensure_future(autoupdate.follow(engine))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(RUN_S)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return refused


async def test_a_refused_feed_backs_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    perms = {"engine": natsconf.without("engine", PULL_API)}
    async with natsconf.role_buses(tmp_path, ("engine",), perms) as (_, buses):
        bus = buses["engine"]
        durable = autoupdate.durable_name("i0", "m")
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.{durable}"
        refused = await follow_refused(bus, subject, caplog)
        # backing off 1, 2, 4 s: 4 tries in 8 s (it was 8, one a second)
        assert 2 <= len(refused) <= 5, len(refused)
        warned = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING and "version feed" in r.getMessage()
        ]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        assert "permission denied" in warned[0].getMessage()


async def test_a_refused_start_backs_off_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop's start lists the announced versions (direct gets of the version stream):
    refused, it now fails at once, so its retry every ``RETRY_S`` was a warning a second
    for ever (it was one per 6 s while the refused get waited out its 5 s). Now: one
    warning, tries backing off; an error that is no refusal (JetStream not up yet) is
    still retried every ``RETRY_S``."""
    perms = {"engine": natsconf.without("engine", f"$JS.API.DIRECT.GET.{CKPT_STREAM}")}
    async with natsconf.role_buses(tmp_path, ("engine", "trainer"), perms) as (_, buses):
        bus = buses["engine"]
        await objstore.ensure_ckpt_stream(bus.nc, "m")
        # a version to list (an empty stream is not read)
        await objstore.publish_version(buses["trainer"].nc, VersionPublished("m", "v1", 1))
        subject = f"$JS.API.DIRECT.GET.{CKPT_STREAM}"
        refused = await follow_refused(bus, subject, caplog)
        assert 2 <= len(refused) <= 5, len(refused)
        warned = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and "cannot start yet" in r.getMessage()
        ]
        assert len(warned) == 1, warned
        assert f"lack publish permission on {subject}" in warned[0]
