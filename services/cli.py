"""The ``rollbus`` command: ``serve``, ``publish``, ``versions``, ``creds``, ``fleet``.

Every setting is also a flag of ``serve`` (``--tp 4`` = ``ROLLBUS_TP=4``); flags win over
the environment. A bad setting is one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["serve"]:  # a Ctrl-C from here on is a clean stop (see the launcher)
    from services import _signals

    _signals.install()

import argparse  # noqa: E402

from pydantic import ValidationError  # noqa: E402

from shared.settings import Settings, describe_error, nats_url_arg  # noqa: E402


def _settings_flags(p: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        is_bool = field.annotation is bool
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar="VALUE",
            # a bare boolean flag means true (`--auto-update`); `--auto-update false` works too
            nargs="?" if is_bool else None,
            const="true" if is_bool else None,
            help=f"{field.description or ''} (env ROLLBUS_{name.upper()})".strip(),
        )


def settings_from(ns: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(ns).items() if k in Settings.model_fields and v is not None}
    return Settings(**overrides)


def _first_reachable(urls: list[str]) -> str:
    """The first of ``urls`` whose server accepts a TCP connection (else the first): one
    cluster node is enough for a client, it learns the others from the server."""
    import socket
    from urllib.parse import urlsplit

    for u in urls:
        parts = urlsplit(u if "://" in u else f"nats://{u}")
        try:
            with socket.create_connection((parts.hostname or "", parts.port or 4222), 1.0):
                return u
        except (OSError, ValueError):
            continue
    return urls[0]


def creds_cmd(role: str, s: Settings, all_servers: bool = False) -> int:
    """``rollbus creds ROLE``: the URL for ``nats.connect(url)`` / ``nats --server URL``.

    With several servers (``NATS_URL`` a comma-separated list) it prints one, the first
    that accepts a connection (nats-py does not take a comma-separated string); ``--all``
    prints the whole list (what the nats CLI takes)."""
    from shared import creds

    base = s.nats_url or creds.local_server_url(s)
    try:
        user, password = creds.load(s.creds_dir, role)
    except creds.CredsError as e:
        print(f"rollbus creds: {e}", file=sys.stderr)
        return 2
    urls = [u.strip() for u in base.split(",") if u.strip()]
    if not all_servers and len(urls) > 1:
        base = _first_reachable(urls)
    print(creds.with_creds(base, user, password))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rollbus", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve_p = sub.add_parser("serve", help="start nats-server (embedded), engine, ranks and API")
    _settings_flags(serve_p)

    pub = sub.add_parser("publish", help="publish a checkpoint version to the object store")
    pub.add_argument("dir", help="HF-format model dir (config.json + *.safetensors)")
    pub.add_argument("--model", required=True, help="served model id")
    pub.add_argument("--version", required=True)
    pub.add_argument("--tp", type=int, default=None, help="ranks to shard for (default ROLLBUS_TP)")
    pub.add_argument("--nats-url", default=None, type=nats_url_arg)
    pub.add_argument(
        "--ipc", action="store_true", help="write to shared memory (same-host ranks, ipc strategy)"
    )
    pub.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="publish even if a weight holds NaN/Inf (refused by default)",
    )

    ver = sub.add_parser("versions", help="list published versions of a model")
    ver.add_argument("--model", required=True)
    ver.add_argument("--nats-url", default=None, type=nats_url_arg)

    cr = sub.add_parser("creds", help="print a NATS URL carrying a role's credentials")
    cr.add_argument("role", help="api, engine, worker, trainer or operator")
    cr.add_argument(
        "--all",
        action="store_true",
        dest="all_servers",
        help="every server of a comma-separated NATS_URL (the nats CLI's form)",
    )
    _settings_flags(cr)

    from services import fleetcli

    fleetcli.add_parser(sub)

    args = ap.parse_args(argv)
    try:
        if args.cmd == "fleet":
            return fleetcli.run(args, Settings())
        if args.cmd == "creds":
            return creds_cmd(args.role, settings_from(args), args.all_servers)
        if args.cmd == "serve":
            from services.launcher import serve

            return serve(settings_from(args))
        from services.trainer import cli as trainer_cli

        return trainer_cli.run(args, Settings())
    except ValidationError as e:
        print(f"rollbus: {describe_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
