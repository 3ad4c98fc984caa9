"""The auto-update loop (:func:`services.engine.autoupdate.follow`) whose pull the server
refuses for good (the engine's ``$JS.API.CONSUMER.MSG.NEXT`` grant missing: an
auth.conf edited by hand, or older than the code): it says so once and backs off, up
to ``RETRY_MAX_S`` between tries. It retried every ``RETRY_S`` (1 s) for ever: a
refused fetch and a consumer re-creation each second, and one permissions-violation
error line a second in nats-server's log. A reconnect (any other feed error) is still
retried every ``RETRY_S``. And status (``auto_update_error``) says why meanwhile: it
said nothing. Real nats-server; the refusals counted as the server sends them (a second
watcher on the engine's connection)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.engine import autoupdate, control
from services.engine.main import Engine
from services.tiny_model import TINY_CONFIG
from shared import objstore
from shared.bus import Bus
from shared.errors import PublishDenied
from shared.messages import VersionPublished
from shared.settings import Settings
from shared.subjects import CKPT_STREAM
from tests import natsconf

PULL_API = f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.>"
RUN_S = 8.0


async def follow_refused(
    bus: Bus, subject: str, caplog: pytest.LogCaptureFixture
) -> tuple[list[PublishDenied], Any]:
    """Run the loop for ``RUN_S`` on an engine (instance ``i0``, model ``m``, on ``v0``) of
    ``bus``, still running at the end: the refusals of ``subject`` the server sent it, and
    the engine's ``auto_update_error`` (status's) at the end."""
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
        error = engine.auto_update_error
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return refused, error


async def test_a_refused_feed_backs_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    perms = {"engine": natsconf.without("engine", PULL_API)}
    async with natsconf.role_buses(tmp_path, ("engine",), perms) as (_, buses):
        bus = buses["engine"]
        durable = autoupdate.durable_name("i0", "m")
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.{durable}"
        refused, error = await follow_refused(bus, subject, caplog)
        assert error is not None and error["reason"].endswith(subject), error
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
        refused, error = await follow_refused(bus, subject, caplog)
        # status says why the loop has not started (the listing refused)
        assert error is not None and error["reason"].startswith("403: "), error
        assert error["reason"].endswith(f"lack publish permission on {subject}"), error
        assert 2 <= len(refused) <= 5, len(refused)
        warned = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and "cannot start yet" in r.getMessage()
        ]
        assert len(warned) == 1, warned
        assert f"lack publish permission on {subject}" in warned[0]


async def test_status_says_the_feed_is_refused_until_it_is_not(tmp_path: Path) -> None:
    """The loop backs off quietly (one warning) and the engine stays on its version: its
    status (`/v1/status`, the NATS `status` reply: :func:`control.status` of a real
    engine) says why in ``auto_update_error`` — the refusal, since when, no credentials
    —, and says nothing once the grant is back (auth.conf reloaded) and a fetch
    succeeds. It said nothing at all: status showed a healthy engine that never
    updated."""
    perms = {"engine": natsconf.without("engine", PULL_API)}
    async with natsconf.role_buses(tmp_path, ("engine",), perms) as (node, buses):
        bus = buses["engine"]
        model = tmp_path / "model"  # what an engine reads of its model: its config.json
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        settings = Settings(model=str(model), model_name="m", instance="i0", nats_url=node.url)
        engine = Engine(settings, bus)
        t0 = time.time()
        task = asyncio.ensure_future(autoupdate.follow(engine))
        try:
            error = None
            for _ in range(100):  # the first fetch is refused at once
                await asyncio.sleep(0.05)
                if (error := (await control.status(engine))["auto_update_error"]) is not None:
                    break
            assert error is not None, "status says nothing of the refused feed"
            durable = autoupdate.durable_name("i0", "m")
            assert error["reason"] == (
                "403: permission denied: these NATS credentials lack publish permission on "
                f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.{durable}"
            ), error
            assert t0 <= error["since"] <= time.time()
            await asyncio.sleep(1.5)  # refused again (backing off): the same outage
            again = (await control.status(engine))["auto_update_error"]
            assert again is not None and again["since"] == error["since"], again
            # the grant back (auth.conf as generated, reloaded): the next fetch clears it
            shutil.copy(natsconf.INFRA / "auth.conf", tmp_path / "auth.conf")
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGHUP)
            for _ in range(160):
                await asyncio.sleep(0.05)
                if (await control.status(engine))["auto_update_error"] is None:
                    break
            assert (await control.status(engine))["auto_update_error"] is None
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
