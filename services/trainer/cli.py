"""``rollbus publish DIR --model M --version V`` and ``rollbus versions --model M``.

Errors are one line on stderr and exit code 2: a missing dir, a dir that is not an HF
model, an unreachable NATS server (naming the URL), a version that exists with other
content. Progress (bytes, MiB/s) is one ``\\r``-rewritten line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared import creds
from shared.errors import BusUnreachable, ControlError
from shared.objstore import ObjectReadError
from shared.settings import Settings


def nats_url_of(args: argparse.Namespace, settings: Settings) -> str:
    """``--nats-url``, else ``ROLLBUS_NATS_URL``, else the embedded server of the stack
    beside us; with the trainer's credentials from ``DATA_DIR/creds`` unless it has some."""
    url = args.nats_url or settings.nats_url or creds.local_server_url(settings)
    return creds.role_url(url, "trainer", settings.creds_dir)


class ProgressLine:
    """``model/v [######----]  12.0/512.0 MiB  345.6 MiB/s`` on stderr: rewritten in place
    at most every 0.1 s when stderr is a terminal; otherwise (a log, a pipe) only the
    final line."""

    def __init__(self, label: str, stream: object = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and (not self.live or now - self.last < 0.1):
            return
        self.last = now
        mib = done / (1 << 20)
        rate = mib / max(now - self.t0, 1e-9)
        width = 24
        fill = round(width * done / total) if total else width
        bar = "#" * fill + "-" * (width - fill)
        print(
            f"\r{self.label} [{bar}] {mib:8.1f}/{total / (1 << 20):.1f} MiB {rate:8.1f} MiB/s",
            end="",
            file=self.stream,  # type: ignore[arg-type]
            flush=True,
        )
        self.shown = True

    def close(self) -> None:
        if self.shown:
            print(file=self.stream)  # type: ignore[arg-type]


def _fail(cmd: str, msg: str) -> int:
    print(f"rollbus {cmd}: {msg}", file=sys.stderr)
    return 2


def publish(args: argparse.Namespace, settings: Settings) -> int:
    d = Path(args.dir)
    # checked before importing the SDK: errors come back at once
    if not d.is_dir():  # a file given where the model dir goes is named as such
        return _fail(
            "publish", f"not a directory: {d}" if d.exists() else f"no such directory: {d}"
        )
    if not (d / "config.json").is_file() or not any(d.glob("*.safetensors")):
        return _fail("publish", f"{d} is not an HF model dir (needs config.json and *.safetensors)")
    from services.trainer.publisher import (
        CheckpointPublisher,
        NotAModelDir,
        UnsafeIpcDir,
        VersionConflict,
    )

    # `--tp 0` is an error (below), not "unset": only an absent --tp means ROLLBUS_TP
    tp = settings.tp if args.tp is None else args.tp
    url = nats_url_of(args, settings)
    pub = CheckpointPublisher(url, bucket=settings.ckpt_bucket, ipc_dir=settings.ipc_dir)
    bar = ProgressLine(f"{args.model}/{args.version}")

    async def run() -> Any:
        # SIGTERM (a scheduler, `timeout`, `kill`) cancels the publish like Ctrl-C: its
        # chunks are purged and its claim released, so nothing is left behind and a
        # retry need not wait for the claim to go stale (the default action would kill
        # the process on the spot, chunks and claim left in the bucket)
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await pub.apublish(
            args.model,
            args.version,
            d,
            tp=tp,
            ipc=args.ipc,
            progress=bar,
            allow_nonfinite=args.allow_nonfinite,
        )

    try:
        res = asyncio.run(run())
    except asyncio.CancelledError:
        bar.close()
        print(
            f"rollbus publish: stopped (SIGTERM): {args.model}/{args.version} not published",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    except BusUnreachable as e:
        bar.close()
        return _fail("publish", e.message)
    except creds.CredsError as e:  # a bad TLS setting, named
        bar.close()
        return _fail("publish", str(e))
    except (NotAModelDir, VersionConflict, ValueError) as e:
        bar.close()
        return _fail("publish", str(e))
    except ObjectReadError as e:  # e.g. the role may not create the stream: it names why
        bar.close()
        return _fail("publish", str(e))
    except ControlError as e:  # e.g. a subject these credentials may not publish to
        bar.close()
        return _fail("publish", e.message)
    except OSError as e:  # the ipc dir refused or not creatable is a bad setting: name it
        bar.close()
        ipc_dir = isinstance(e, UnsafeIpcDir) or str(e.filename or "").startswith(
            str(settings.ipc_dir)
        )
        return _fail("publish", f"ROLLBUS_IPC_DIR={settings.ipc_dir}: {e}" if ipc_dir else str(e))
    bar.close()
    what = "published" if res.uploaded else "already published"
    where = f"shared memory {settings.ipc_dir}" if res.ipc else f"bucket {settings.ckpt_bucket}"
    print(
        f"{what} {res.model}/{res.version}: tp={res.tp}, {res.bytes / (1 << 20):.1f} MiB to "
        f"{where}, event seq {res.seq} ({res.seconds:.2f} s, {res.mib_s:.0f} MiB/s)"
    )
    return 0


def _printable(text: str, limit: int = 64) -> str:
    """An event's free-text field as one short, inert line: anyone who may publish an
    event chooses it (escape sequences would drive the terminal; 1 MB would be the
    line)."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def versions(args: argparse.Namespace, settings: Settings) -> int:
    from services.trainer.publisher import CheckpointPublisher

    pub = CheckpointPublisher(nats_url_of(args, settings), bucket=settings.ckpt_bucket)
    try:
        vs = pub.versions(args.model)
    except BusUnreachable as e:
        return _fail("versions", e.message)
    except creds.CredsError as e:  # a bad TLS setting, named
        return _fail("versions", str(e))
    except (ValueError, ObjectReadError) as e:  # a bad model id; a stream it cannot read
        return _fail("versions", str(e))
    except ControlError as e:  # e.g. a subject these credentials may not publish to
        return _fail("versions", e.message)
    if not vs:
        print(f"no published versions of {args.model}", file=sys.stderr)
        return 0
    print(f"{'seq':>6}  {'version':<24} {'tp':>3} {'MiB':>10}  {'published (UTC)':<20} publisher")
    for v in vs:
        when = datetime.fromtimestamp(v.time, UTC).strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{v.seq:>6}  {v.version:<24} {v.tp:>3} {v.total_bytes / (1 << 20):>10.1f}  "
            f"{when:<20} {_printable(v.publisher)}"
        )
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.cmd == "publish":
        return publish(args, settings)
    return versions(args, settings)
