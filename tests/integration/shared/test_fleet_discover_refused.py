"""Fleet discovery waits on an inbox of its own for the ``$SRV.PING`` replies: when the
server refuses the ping (credentials without ``$SRV.>``: an auth.conf edited by hand, or
older than the code) it fails at once with the 403 naming the subject. It waited out
its window and said "no instances" (``rollbus fleet status``: "no rollbus instance
answered"; a fleet update: nothing to update), as if the fleet were empty. Real
nats-server with the generated auth.conf, the operator's ``$SRV.>`` grant taken away."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared import fleet
from shared.bus import Bus
from shared.errors import FORBIDDEN, PublishDenied
from tests import clirun, natsconf

WINDOW_S = 10.0  # the discovery window: what a refused ping waited out


@pytest.fixture
async def operators(tmp_path: Path) -> AsyncIterator[tuple[Bus, Bus]]:
    """(the operator without ``$SRV.>``, the api with it)"""
    perms = {"operator": natsconf.without("operator", "$SRV.>")}
    async with natsconf.role_buses(tmp_path, ("operator", "api"), perms) as (_, buses):
        yield buses["operator"], buses["api"]


async def test_a_refused_discovery_ping_fails_at_once(operators: tuple[Bus, Bus]) -> None:
    op, api = operators
    t0 = time.monotonic()
    with pytest.raises(PublishDenied) as denied:
        await fleet.discover(op.nc, WINDOW_S)
    assert time.monotonic() - t0 < WINDOW_S / 2
    assert denied.value.code == FORBIDDEN
    assert denied.value.subject == f"$SRV.PING.{fleet.SERVICE}"
    assert not op.nc._asked  # type: ignore[attr-defined]
    with pytest.raises(PublishDenied):  # the coordinator's fleet (status, update) alike
        await fleet.Coordinator(op, 5.0, discovery_s=WINDOW_S).fleet()
    assert not op.nc._asked  # type: ignore[attr-defined]
    # allowed: still the window's answer (nobody here), and nothing left registered
    assert await fleet.discover(api.nc, 0.2) == []
    assert not api.nc._asked  # type: ignore[attr-defined]


def test_rollbus_fleet_status_names_the_refusal(tmp_path: Path) -> None:
    """``rollbus fleet status`` as a user runs it: one line naming the refused subject,
    exit code 2 (a configuration error), no traceback, no password."""
    passwords = natsconf.role_passwords()
    perms = {"operator": natsconf.without("operator", "$SRV.>")}
    node = natsconf.single_with_perms(tmp_path, passwords, perms)
    node.start()
    try:
        url = f"nats://operator:{passwords['operator']}@127.0.0.1:{node.port}"
        env = clirun.clean_env(tmp_path / "data", ROLLBUS_NATS_URL=url)
        t0 = time.monotonic()
        r = clirun.rollbus("fleet", "status", env=env)
        assert time.monotonic() - t0 < 30.0
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert f"publish permission on $SRV.PING.{fleet.SERVICE}" in r.stderr, r.stderr
        assert passwords["operator"] not in r.stderr + r.stdout
    finally:
        node.stop()


async def test_the_api_fleet_update_is_403_naming_the_refusal(
    operators: tuple[Bus, Bus], tmp_path: Path
) -> None:
    """``POST /v1/fleet/update_weights`` over a bus whose ping is refused: the 403 naming
    the subject, not a 500 "fleet coordinator failed" (the refusal raised out of the
    coordinator into the route's catch-all). The route's handler, with the refused
    credentials' bus; no instance is needed (nothing is written before discovery)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from services.api import fleet as api_fleet
    from services.api.deps import Deps
    from shared.settings import Settings

    op, _ = operators
    deps = Deps(Settings(model=str(tmp_path / "m"), model_name="m"), op)

    async def route(request: Request) -> Response:
        return await api_fleet.update_weights(deps, request)

    app = Starlette(routes=[Route("/v1/fleet/update_weights", route, methods=["POST"])])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as cl:
        r = await cl.post("/v1/fleet/update_weights", json={"version": "v1"})
    assert r.status_code == FORBIDDEN, r.text
    assert f"publish permission on $SRV.PING.{fleet.SERVICE}" in r.json()["error_message"]
