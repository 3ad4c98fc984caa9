"""``POST /v1/fleet/update_weights``: this API runs the fleet coordinator (``shared.fleet``)
over every instance sharing its NATS. Admin token and body checks as every control route;
the reply is the control reply shape with the fleet result; HTTP status = ``error_code``
(200 only if every instance switched)."""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api import control
from services.api.deps import Deps
from shared import fleet as f
from shared import messages as m
from shared.errors import INTERNAL, ControlError, PublishDenied

log = logging.getLogger("rollbus.api.fleet")


async def update_weights(deps: Deps, request: Request) -> Response:
    rid = control.client_request_id(request)
    try:
        control.admin_check(deps, request)  # 401 before a bad parameter's 400
        # arguments come in the body only: a query one (`?pause_mode=keep`) is 400 naming
        # it, never dropped while the transaction runs with the defaults (abort)
        control._only_query(request)
        body = await control._body(deps, request)  # size / JSON
        args = m.decode_args(body, f.FleetUpdateArgs)  # unknown or wrong field: 400
        f.check_update_args(args.version, args.pause_mode, args.verify_checksum)  # 400
    except ControlError as e:
        deps.metrics.control("fleet_update_weights", e.code)
        return control._refused(request, e)
    assert deps.bus is not None
    coord = f.Coordinator(
        deps.bus,
        deps.settings.control_timeout_s,
        name=f"api:{deps.settings.instance}",
        test_commit_delay_s=deps.settings.test_fleet_commit_delay_s,
    )
    try:
        # the instances serving this API's model (README "Fleet")
        res = await coord.update(
            args.version,
            args.pause_mode,
            args.verify_checksum,
            model=deps.settings.served_model_name,
        )
        reply = m.ControlReply(rid, res.error_code, res.error_message, msgspec.to_builtins(res))
    except PublishDenied as e:  # a publish refused (the discovery ping: before any write)
        reply = m.ControlReply(rid, e.code, e.message)
    except Exception as e:  # a bug answers; the instances follow the record by themselves
        log.exception("fleet update failed")
        reply = m.ControlReply(rid, INTERNAL, f"fleet coordinator failed: {e!r}")
    deps.metrics.control("fleet_update_weights", reply.error_code)
    return control._echo(request, control.reply_response(reply))
