"""``rollbus fleet status [--json]`` and ``rollbus fleet update --version V [--model M |
--instances a,b]``.

Runs the coordinator of ``shared.fleet`` with the operator's credentials, found the way
``rollbus publish`` finds the trainer's (``--nats-url``, else ``ROLLBUS_NATS_URL``, else
the embedded server of the stack beside us; the password from ``NATS_CREDS_DIR``).
Exit codes: 0 all switched (``status``: every instance answered), 1 not all switched (or
an instance did not answer), 2 NATS unreachable or a bad argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import msgspec

from shared import creds
from shared import fleet as f
from shared.bus import Bus
from shared.errors import BusUnreachable, PublishDenied
from shared.settings import Settings, nats_url_arg


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fl = sub.add_parser("fleet", help="every instance sharing the NATS: status, update")
    fsub = fl.add_subparsers(dest="fleet_cmd", required=True)
    st = fsub.add_parser("status", help="one row per instance")
    st.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    st.add_argument("--nats-url", default=None, type=nats_url_arg)
    up = fsub.add_parser("update", help="update every instance's weights as one transaction")
    up.add_argument("--version", required=True)
    up.add_argument("--pause-mode", choices=["keep", "abort", "wait"], default="keep")
    up.add_argument(
        "--verify",
        action="store_true",
        default=None,
        help="verify SHA-256 (default: wherever the version has a manifest)",
    )
    up.add_argument(
        "--model",
        default=None,
        help="update the instances serving this model (default: the one model served)",
    )
    up.add_argument(
        "--instances",
        default=None,
        help="comma-separated instance names: exactly these (instead of --model)",
    )
    up.add_argument("--json", action="store_true", help="print the whole result as JSON")
    up.add_argument("--nats-url", default=None, type=nats_url_arg)


def nats_url_of(args: argparse.Namespace, settings: Settings) -> str:
    url = args.nats_url or settings.nats_url or creds.local_server_url(settings)
    return creds.role_url(url, "operator", settings.creds_dir)


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    if args.fleet_cmd == "update":
        try:  # before anything is written or paused
            f.check_update_args(args.version, args.pause_mode, args.verify)
        except f.BadUpdateArg as e:
            print(f"rollbus fleet update: {e.message}", file=sys.stderr)
            return 2
    bus = await Bus.connect(nats_url_of(args, settings), "rollbus-fleet")
    try:
        coord = f.Coordinator(
            bus,
            settings.control_timeout_s,
            name=f"cli:{bus.nc.client_id}",
            test_commit_delay_s=settings.test_fleet_commit_delay_s,
        )
        if args.fleet_cmd == "status":
            rows = await coord.status()
            if args.json:
                print(json.dumps(rows, indent=2))
            elif rows:
                print(f.format_table(rows))
            else:
                print("no rollbus instance answered", file=sys.stderr)
            return 0 if rows and not any(r["error"] for r in rows) else 1
        instances = model = None
        if args.instances is not None:
            instances = [n.strip() for n in args.instances.split(",") if n.strip()]
            if not instances or args.model is not None:
                print(
                    "rollbus fleet update: --instances takes a comma-separated list of "
                    "names and excludes --model",
                    file=sys.stderr,
                )
                return 2
        elif args.model is not None:
            model = args.model
        else:
            models = f.models_of(await coord.fleet())
            if len(models) > 1:
                print(
                    f"rollbus fleet update: several models are served ({', '.join(models)}):"
                    " choose one with --model",
                    file=sys.stderr,
                )
                return 2
            model = models[0] if models else None
        res = await coord.update(args.version, args.pause_mode, args.verify, instances, model)
        if args.json:
            print(json.dumps(msgspec.to_builtins(res), indent=2))
        else:
            for o in res.instances:
                err = f"  ({o.error_code} {o.error_message})" if o.error_code != 200 else ""
                print(f"{o.instance}: {o.outcome} {o.previous_version} -> {o.version}{err}")
            what = "switched" if res.error_code == 200 else f"NOT switched ({res.error_code})"
            print(f"fleet {res.txn}: {res.decision}, {args.version!r} {what} in {res.seconds:.2f}s")
            if res.error_code != 200:
                print(f"rollbus fleet update: {res.error_message}", file=sys.stderr)
        return 0 if res.error_code == 200 else 1
    finally:
        await bus.close()


def run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        return asyncio.run(_run(args, settings))
    except BusUnreachable as e:
        print(f"rollbus fleet: {e.message}", file=sys.stderr)
        return 2
    except PublishDenied as e:  # the discovery ping refused: these credentials, named
        print(f"rollbus fleet: {e.message}", file=sys.stderr)
        return 2
    except creds.CredsError as e:  # a bad TLS setting, named
        print(f"rollbus fleet: {e}", file=sys.stderr)
        return 2
