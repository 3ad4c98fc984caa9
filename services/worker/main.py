"""A worker rank process: ``python -m services.worker --rank R --endpoints h:p,h:p``.

Holds one tensor-parallel shard of the model and its KV cache, answers
``rollbus.<i>.worker.ctl.<method>`` (queue group ``rank<R>``, so a publish reaches every
rank once) and executes ``rollbus.<i>.worker.step``. All paddle work runs on one
thread, in arrival order, so control methods and model steps never interleave and the
event loop stays free to answer ``ping``/``status`` during a long load. Those two
report the compute thread's watermark (``busy``: the job it runs, ``busy_s``: for how
long), so a rank blocked in a collective shows; one blocked in a single step past
``max(4 × STALL_S, 4 × CONTROL_TIMEOUT_S)`` exits with code 4 and a line naming the step
(gloo's own collective timeout is 30 min and paddle offers no way to shorten it).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import paddle

from services.worker import control, readout
from services.worker import model as mdl
from services.worker.comm import CommGroup, configure_env, local_endpoints, place
from services.worker.sources import make_source, served_dtype
from services.worker.stepper import Stepper, Watermark
from services.worker.weights import WeightStore
from shared import messages as m
from shared import readout as ro
from shared.bus import RANK, Bus, past_deadline
from shared.device import DeviceError
from shared.errors import INTERNAL, UNAVAILABLE, ControlError
from shared.model_config import ModelConfig, load_config
from shared.settings import Settings, settings_or_exit
from shared.subjects import Subjects
from shared.tasks import Supervisor, run_loop
from shared.versions import model_dir_version

X86 = ("x86_64", "amd64", "i686", "i386")  # total store order: see shm_bytes
log = logging.getLogger("rollbus.worker")

# method -> (handler, argument type)
METHODS: dict[str, tuple[Callable[[control.Rank, Any], dict[str, Any]], type | None]] = {
    "ping": (control.ping, None),
    "status": (control.status, None),
    # status on the paddle thread: answered once every call that came before it has run
    # (the engine's reconcile waits for this before it looks at a rank's state)
    "drain": (control.status, None),
    "stage": (control.stage, m.StageArgs),
    "commit": (control.commit, m.CommitArgs),
    "abort": (control.abort, None),
    "finalize": (control.finalize, m.UpdateIdArgs),
    "rollback": (control.rollback, m.UpdateIdArgs),
    "sleep": (control.sleep, m.SleepWorkerArgs),
    "wakeup": (control.wakeup, m.WakeupWorkerArgs),
    "digest": (control.weights_digest, None),
    "comm_check": (control.comm_check, None),
    "selfbench": (control.selfbench, m.SelfBenchArgs),
}
INIT_FAILED = 3  # exit code: a start that failed for a reason a restart may clear
CONFIG_ERROR = 2  # exit code: the model dir / config cannot be served; never retried
STEP_HUNG = 4  # exit code: the compute thread was blocked in one step past the bound
INIT_TIMEOUT_S = 600.0  # rendezvous + loading one shard of a large model
# answered on the event loop, not queued behind paddle work; their handlers never await
# before replying, so each runs in its subscription's callback (no task per call: a
# loop turn and a task less on every ``status``; a late commit is refused by data,
# whatever order the handlers run in, see BARRIER)
INLINE = {"ping", "status"}
# recorded on the event loop the moment the message arrives, before its paddle work is
# queued: a rollback's update id is refused to every commit that runs after that
ON_RECEIPT: dict[str, Callable[[control.Rank, Any], None]] = {
    "rollback": lambda r, args: r.weights.revoke(args.update_id),
}
# a commit runs only after a bus barrier (see WorkerServer.barrier)
BARRIER = {"commit"}
# calls that take a rank away from the state the engine last confirmed: not run once
# their Rollbus-Deadline passed (the engine gave up on them, told its caller, undid them
# on the other ranks). Checked when their turn on the paddle thread comes (they may have
# queued behind other work), wakeup's after its collective part (control.wakeup). The
# others run late too: sleep, abort, rollback, finalize take a rank toward that state;
# comm_check and selfbench are collective (a peer that ran them in time waits for this
# rank); steps carry no deadline.
EXPIRES = {"stage", "commit", "wakeup"}


class TransientStartError(RuntimeError):
    """The rendezvous failed (a peer not there yet): a restart may clear it."""


def build_rank(settings: Settings, rank: int) -> control.Rank:
    place(settings.device, rank, settings.tp)  # DeviceError: a config error, exit 2
    # ranks share the host's cores; paddle's CPU kernels default to one thread
    paddle.base.core.set_num_threads(max(1, (os.cpu_count() or 1) // settings.tp))
    model_dir = settings.model_dir
    cfg = load_config(model_dir)
    cfg.validate_tp(settings.tp)
    # the shm wait's own bound lies past the step watchdog's (which exits with code 4)
    comm = CommGroup(rank, settings.tp, shm_bytes(settings, cfg), hang_bound(settings) + 5)
    # the start's phases at INFO: a start that hangs shows which rank stopped where
    log.info("rank %d start: joining the comm group of %d ranks", rank, settings.tp)
    try:
        comm.init()
    except Exception as e:  # e.g. gloo's full-mesh connect refused: worth a restart
        raise TransientStartError(str(e) or type(e).__name__) from e
    log.info("rank %d start: comm group joined; loading the weights", rank)
    source = make_source(settings, cfg, rank)
    weights = WeightStore(rank, source)
    weights.load_initial(model_dir_version(model_dir))
    log.info("rank %d start: weights loaded", rank)
    kv = mdl.KVCache(
        cfg,
        settings.kv_cache_blocks,
        settings.kv_block_size,
        settings.tp,
        served_dtype(settings),
    )
    model = mdl.TPModel(cfg, rank, settings.tp, comm.group, comm.shm)
    return control.Rank(rank, settings.tp, cfg, weights, kv, comm, settings.load_strategy, model)


class WorkerServer:
    def __init__(self, settings: Settings, rank: int, state: control.Rank, bus: Bus) -> None:
        self.settings, self.rank, self.state, self.bus = settings, rank, state, bus
        self.subjects = Subjects(settings.instance)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"paddle-rank{rank}")
        self.watermark = Watermark()
        self.supervisor = Supervisor(f"rank {rank}")
        # test-only windows (ROLLBUS_TEST_*_DELAY_S) for tests/faults
        self.test_delays = {
            "stage": settings.test_stage_delay_s,
            "commit": settings.test_commit_delay_s,
        }

    def reply(self, result: dict[str, Any] | None = None, err: ControlError | None = None) -> bytes:
        if err is not None:
            # clipped: a message may quote a hostile manifest (tensor names), and a reply
            # over max_payload cannot be sent (the engine would see a silent rank, 503)
            msg = m.clip(err.message)
            return m.json_encode(m.WorkerReply(self.rank, err.code, msg, err.result or {}))
        return m.json_encode(m.WorkerReply(self.rank, result=result or {}))

    def health(self) -> dict[str, Any]:
        """What ``ping``/``status`` add: the compute thread's watermark, failures."""
        return {
            **self.watermark.report(),
            "callback_errors": dict(self.bus.callback_errors),
            "task_failures": dict(self.supervisor.failures),
        }

    def _handler(self, method: str) -> Callable[[bytes, dict[str, str]], Any]:
        fn, argtype = METHODS[method]

        async def handle(data: bytes, headers: dict[str, str]) -> bytes:
            try:
                args = m.decode_args(data, argtype) if argtype else None
                if method in INLINE:
                    return self.reply({**fn(self.state, args), **self.health()})
                if hook := ON_RECEIPT.get(method):
                    hook(self.state, args)  # before any await: see ON_RECEIPT
                if delay := self.test_delays.get(method):
                    log.warning("rank %d: test delay before %s: %gs", self.rank, method, delay)
                    await asyncio.sleep(delay)
                if method in BARRIER:
                    await self.barrier()
                run = fn
                if method in EXPIRES:
                    run = functools.partial(fn, late=functools.partial(past_deadline, headers))
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(
                    self.pool, self.watermark.run, method, run, self.state, args
                )
                return self.reply(result)
            except ControlError as e:
                return self.reply(err=e)
            except Exception as e:  # a bug must reach the caller, not vanish
                log.exception("rank %d: %s failed", self.rank, method)
                return self.reply(err=ControlError(INTERNAL, f"rank {self.rank}: {method}: {e!r}"))

        return handle

    async def barrier(self) -> None:
        """Before a commit runs: the paddle thread is free, then a PING/PONG with the
        server. The server relays a connection's messages in order, so every message it
        sent this rank before the PONG has been read and dispatched — a rollback of this
        update the engine sent before the commit runs (it timed out while this rank was
        stopped or busy) has recorded its id (ON_RECEIPT), and the commit is refused by
        that record, not by which handler the rank happened to schedule first. Without a
        barrier the commit is refused too (503): a rank that cannot reach the server
        must not switch alone."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.pool, _noop)
        try:
            await self.bus.flush(self.settings.control_timeout_s)
        except Exception as e:  # noqa: BLE001 - no barrier, no commit
            raise ControlError(
                UNAVAILABLE, f"rank {self.rank}: commit refused: no bus barrier ({e!r})"
            ) from None
        await asyncio.sleep(0)  # the rollback handler woken by the same read runs first

    async def start(self) -> None:
        svc = await self.bus.add_service(
            "rollbus-worker", "0.1.0", f"rollbus worker rank {self.rank} ({self.settings.instance})"
        )
        hdr = {RANK: str(self.rank)}
        for method in METHODS:
            await self.bus.serve(
                svc,
                method,
                self.subjects.worker_ctl(method),
                self._handler(method),
                queue=f"rank{self.rank}",
                reply_headers=hdr,
            )
        await self._serve_weights(svc, hdr)
        self.stepper = Stepper(
            self.state,
            self.bus,
            self.pool,
            self.rank,
            self.watermark,
            peers=(self.subjects.worker_ctl("ping"), self.settings.tp),
        )
        await self.bus.subscribe(
            self.subjects.worker_step, self.stepper.on_step, queue=f"rank{self.rank}"
        )
        await self.bus.flush()

    async def _serve_weights(self, svc: Any, hdr: dict[str, str]) -> None:
        """The read-only weights subjects (``shared.readout``): trainers and operators may
        read the served weights, not call ``worker.ctl``. The snapshot is taken on the
        paddle thread (never beside a commit or a step); chunks are served from it."""
        reads = readout.Reads(self.rank, self.settings.tp, self.bus.nc.max_payload)

        def snap(state: control.Rank, args: ro.ReadArgs) -> dict[str, Any]:
            return reads.open_read(state.weights.version, state.weights.current, args)

        async def open_read(args: ro.ReadArgs) -> dict[str, Any]:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self.pool, self.watermark.run, "weights_get", snap, self.state, args
            )

        await readout.serve(self.bus, svc, self.subjects, reads, open_read, hdr)


async def amain(settings: Settings, rank: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # blocked while paddle was imported (services/worker/__main__.py): ours from here on
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    bus = await Bus.connect(settings.nats_url, f"rollbus-worker-{rank}")
    # paddle init (gloo rendezvous, weight load) blocks in C code: run it on a thread,
    # and if it hangs (a peer rank never came) or we are told to stop meanwhile, leave
    # the process outright; such a thread cannot be joined
    build = loop.run_in_executor(None, build_rank, settings, rank)
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait(
        {build, stopping}, timeout=INIT_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    if build not in done:
        if stopping not in done:
            print(
                f"rollbus-worker rank {rank}: not ready within {INIT_TIMEOUT_S:g}s "
                f"(paddle.distributed rendezvous of {settings.tp} ranks or the weight load "
                "hung)",
                file=sys.stderr,
                flush=True,
            )
        os._exit(0 if stopping in done else 1)
    stopping.cancel()
    try:
        state = build.result()
    except TransientStartError as e:
        print(f"rollbus-worker rank {rank}: start failed: {e}", file=sys.stderr, flush=True)
        await bus.close()
        return INIT_FAILED
    except Exception as e:  # noqa: BLE001 - bad model dir, config, shard: one line, exit 2
        msg = e.message if isinstance(e, ControlError) else f"{type(e).__name__}: {e}"
        print(f"rollbus-worker rank {rank}: cannot start: {msg}", file=sys.stderr, flush=True)
        await bus.close()
        return CONFIG_ERROR
    server = WorkerServer(settings, rank, state, bus)
    await server.start()
    log.info("rank %d ready: version %s", rank, state.weights.version)
    bound = hang_bound(settings)
    server.supervisor.start(
        "step_watchdog", lambda: step_watchdog(server.watermark, rank, bound, state)
    )
    await stop.wait()
    await server.supervisor.stop()
    await bus.close()
    # leave now: a compute call in progress (a long weight load) must not hold the stop
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _noop() -> None:
    pass


def shm_bytes(settings: Settings, cfg: ModelConfig) -> int:
    """Slot size of the shared-memory all-reduce (one step's [tokens, hidden] float32), or 0
    for gloo: ``TP_ALLREDUCE=gloo``, a GPU, a rank set not all on this host, or a CPU whose
    stores may be reordered (the segment publishes data then sequence number with plain
    stores, which only x86's total store order keeps in order)."""
    eps = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    if settings.tp == 1 or settings.device != "cpu" or settings.tp_allreduce != "shm":
        return 0
    if platform.machine().lower() not in X86:
        return 0
    return settings.max_step_tokens * cfg.hidden_size * 4 if local_endpoints(eps) else 0


def hang_bound(settings: Settings) -> float:
    return max(4 * settings.stall_s, 4 * settings.control_timeout_s)


async def step_watchdog(
    mark: Watermark, rank: int, bound: float, state: control.Rank | None = None
) -> None:
    """Leave the process when the compute thread is stuck in one step, or in the comm
    group's rebuild (a wakeup's barrier, ``state.collective_since``), past ``bound``: a
    peer never got the step or the wakeup (e.g. cut off by the server while stopped), or
    is stopped. Such a thread cannot be interrupted; the launcher restarts the ranks."""
    while True:
        await asyncio.sleep(min(1.0, bound / 4))
        where = ""
        if mark.job.startswith("step") and mark.busy_s() > bound:
            where = f"{mark.job} blocked for {mark.busy_s():.0f}s"
        since = state.collective_since if state is not None else None
        if since is not None and time.monotonic() - since > bound:
            blocked = time.monotonic() - since
            where = f"{mark.job or 'a call'} blocked in the comm group's rebuild for {blocked:.0f}s"
        if where:
            print(
                f"rollbus-worker rank {rank}: {where} "
                "(a peer rank never got it, or is stopped); exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(STEP_HUNG)


def check_device(settings: Settings) -> int:
    """The launcher's pre-flight of ``ROLLBUS_DEVICE``: one line and exit 2 when this
    paddle build cannot serve it, before any rank starts."""
    try:
        place(settings.device, 0, settings.tp)
    except DeviceError as e:
        print(str(e), file=sys.stderr, flush=True)
        return CONFIG_ERROR
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rollbus-worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--endpoints", default="", help="comma-separated host:port per rank")
    ap.add_argument(
        "--check-device", action="store_true", help="check ROLLBUS_DEVICE here, then exit (0/2)"
    )
    args = ap.parse_args(argv)
    settings = settings_or_exit(f"rollbus-worker rank {args.rank}")
    if args.check_device:
        return check_device(settings)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    if settings.tp > 1:
        eps = [e for e in args.endpoints.split(",") if e]
        if len(eps) != settings.tp:
            print(f"rollbus-worker: need {settings.tp} endpoints, got {eps}", file=sys.stderr)
            return 2
        configure_env(args.rank, settings.tp, eps, settings.device)
    try:
        return run_loop(amain(settings, args.rank))
    except ControlError as e:
        print(f"rollbus-worker rank {args.rank}: {e.message}", file=sys.stderr)
        return 1
