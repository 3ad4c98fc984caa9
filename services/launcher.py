"""``rollbus serve``: the embedded nats-server, the engine, the worker ranks and the API.

Children get the launcher's settings as ``ROLLBUS_*`` variables. Each child runs in its
own session, so a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the
launcher only; the launcher then stops API, engine, ranks and last nats-server, each with
SIGTERM (SIGKILL past its share of :data:`STOP_BUDGET_S`). Once the stack has been ready,
a child that dies is restarted (see :meth:`Launcher.monitor`); before that, a death is
reported by name and the rest are stopped the same way. Children also get
``PR_SET_PDEATHSIG``, so even a ``kill -9`` of the launcher leaves no orphans.

Several instances on one ``DATA_DIR``: the launcher that starts the embedded nats-server
records it in ``DATA_DIR/nats/owner.json``; another ``rollbus serve`` of that ``DATA_DIR``
(another ``ROLLBUS_INSTANCE`` and API port) joins that server with the generated
credentials instead of starting one, never stops it, and takes it over (same port, store
and credentials) once the owner's stack has stopped. An instance name an engine already
serves on the NATS is refused (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services import _signals, natsd
from services.tiny_model import ensure_tiny_model
from services.worker.ports import rendezvous_port
from services.worker.shmreduce import default_root, segment_dir
from shared import creds
from shared.bus import Bus
from shared.errors import BusUnreachable, NoResponders, Timeout
from shared.model_config import ConfigError, ModelConfig, generation_defaults, read_hf_config
from shared.redact import public_url
from shared.safetensors import INDEX_FILE, checkpoint_files
from shared.settings import Settings
from shared.subjects import Subjects

RANK = "worker rank"
ENGINE_FRESH_START = "ROLLBUS_ENGINE_FRESH_START"  # services.engine.main.FRESH_START_ENV
LAUNCHER_PID = "ROLLBUS_LAUNCHER_PID"  # services.api.app.LAUNCHER_PID_ENV
READY_SIGNAL = signal.SIGUSR1  # services.api.app.READY_SIGNAL: the API's first /health 200
RANK_RETRIES = 2
RANK_INIT_FAILED = 3  # services.worker.main.INIT_FAILED: transient (gloo connect refused)
RANK_CONFIG_ERROR = 2  # services.worker.main.CONFIG_ERROR: never retried
# the whole ordered stop; each stage gets a share and is SIGKILLed past it
STOP_BUDGET_S = 9.0
STOP_ORDER = (("api", 3.0), ("engine", 2.0), (RANK, 2.0))
NATS_RESTART_S = 90.0  # how long a dead embedded nats-server is tried again on its port
OWNER_FILE = "owner.json"  # DATA_DIR/nats/owner.json: which launcher runs the embedded server
INSTANCE_PROBE_S = 2.0  # how long a running engine of the same instance name may take to answer

# paddle's import-time chatter (glog INFO lines, the ccache warning) is not the user's
# business; an explicit setting in the environment still wins
QUIET_ENV = {"GLOG_minloglevel": "2", "PYTHONWARNINGS": "ignore:No ccache found"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    args: list[str] = field(default_factory=list)


class RestartBudget:
    """At most ``limit`` restarts per process within ``window`` seconds."""

    def __init__(self, limit: int = 5, window: float = 60.0) -> None:
        self.limit, self.window = limit, window
        self.times: dict[str, deque[float]] = {}

    def take(self, what: str, now: float | None = None) -> bool:
        """Record a restart of ``what``; False when it is over budget (do not restart)."""
        now = time.monotonic() if now is None else now
        q = self.times.setdefault(what, deque())
        while q and q[0] <= now - self.window:
            q.popleft()
        if len(q) >= self.limit:
            return False
        q.append(now)
        return True


class LaunchError(RuntimeError):
    pass


def _say(msg: str) -> None:
    print(f"rollbus: {msg}", file=sys.stderr, flush=True)


def check_nats(url: str, tls: ssl.SSLContext | None = None, instance: str = "") -> None:
    """Connect once (``url`` carries a role's credentials, so this also checks them); with
    ``instance``, refuse a name an engine already serves on this NATS: its
    ``rollbus.<instance>.ctl.health`` answers. ``url`` must be a role that may call
    ``ctl`` (api)."""

    async def probe() -> bool:
        bus = await Bus.connect(url, "rollbus-launcher", timeout=5.0, tls=tls)
        try:
            if not instance:
                return False
            try:
                await bus.request(Subjects(instance).ctl("health"), b"{}", timeout=INSTANCE_PROBE_S)
            except (NoResponders, Timeout):
                return False
            return True
        finally:
            await bus.close()

    try:
        taken = asyncio.run(probe())
    except BusUnreachable as e:
        raise LaunchError(e.message) from None
    if taken:
        raise LaunchError(
            f"instance {instance!r} is already running on NATS {public_url(url)}: "
            "set ROLLBUS_INSTANCE to another name"
        )


def _alive(pid: int) -> bool:
    """A live process (not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class EmbeddedOwner:
    """The embedded nats-server of a ``DATA_DIR`` and the launcher that runs it."""

    url: str
    port: int
    nats_pid: int
    launcher_pid: int
    instance: str

    @staticmethod
    def path(data_dir: Path) -> Path:
        return data_dir / "nats" / OWNER_FILE

    @classmethod
    def read(cls, data_dir: Path) -> EmbeddedOwner | None:
        try:
            d = json.loads(cls.path(data_dir).read_text())
            return cls(
                str(d["url"]),
                int(d["port"]),
                int(d["nats_pid"]),
                int(d["launcher_pid"]),
                str(d.get("instance", "")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, data_dir: Path) -> None:
        f = self.path(data_dir)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.__dict__))
        os.replace(tmp, f)  # readers never see half a file

    @property
    def serving(self) -> bool:
        """Its nats-server runs."""
        return _alive(self.nats_pid)

    @property
    def owned(self) -> bool:
        """Its launcher runs (and may be restarting the server)."""
        return _alive(self.launcher_pid)


def running_embedded(data_dir: Path) -> EmbeddedOwner | None:
    """The embedded nats-server another ``rollbus serve`` of this ``DATA_DIR`` runs."""
    owner = EmbeddedOwner.read(data_dir)
    if owner is None or owner.launcher_pid == os.getpid():
        return None
    # both alive: a server whose launcher is gone is on its way out (it dies with it)
    return owner if owner.serving and owner.owned else None


def start_embedded(s: Settings) -> tuple[natsd.NatsServer, dict[str, str]]:
    """The embedded server with authentication (credentials generated at first start under
    ``DATA_DIR/creds``) and each role's URL carrying its credentials."""
    try:
        users = creds.ensure(s.creds_dir)
        server = natsd.start(
            s.data_dir / "nats",
            port=s.nats_port,
            log_file=s.data_dir / "nats.log",
            users=users,
            bucket=s.ckpt_bucket,
            tls_cert=s.nats_tls_cert,
            tls_key=s.nats_tls_key,
            tls_ca=s.nats_tls_ca,
            # a rank's one reply to a control call may come as late as the call's timeout
            response_window=f"{max(600, int(2 * s.control_timeout_s))}s",
            own_session=True,
        )
    except (natsd.NatsServerError, creds.CredsError, OSError) as e:
        raise LaunchError(str(e)) from None
    return server, {r: creds.with_creds(server.url, *users[r]) for r in creds.ROLES}


class Launcher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.children: list[Child] = []
        self.nats: natsd.NatsServer | None = None
        # the embedded nats-server of our DATA_DIR run by another launcher, which we joined
        self.joined: EmbeddedOwner | None = None
        self.role_urls: dict[str, str] = {}
        self._stopping = False
        self._api_ready = False  # the API answered /health 200 (READY_SIGNAL)
        self.rank_retries = 0
        self.budget = RestartBudget(settings.restart_limit, settings.restart_window_s)
        self.restarts = 0
        self.rank_endpoints = ""  # the running rank set's (keys its shared-memory files)

    def prepare(self) -> Settings:
        s = self.settings
        if s.model:
            check_model(
                s.model_dir, s.tp, s.load_strategy == "snapshot", s.generation_config == "auto"
            )
        if s.device != "cpu":
            check_device(s)
        err = natsd.bind_error(s.api_host, s.api_port)
        if err is not None and err.errno != errno.EADDRINUSE:
            # not a busy port: an unresolvable or foreign host, a privileged port
            raise LaunchError(
                f"ROLLBUS_API_HOST={s.api_host}: cannot listen on port {s.api_port} there "
                f"({err.strerror or err})"
            )
        if err is not None:
            raise LaunchError(
                f"API port {s.api_host}:{s.api_port} is busy: set ROLLBUS_API_PORT to a free port"
            )
        try:
            tls = creds.client_tls(s.nats_tls_ca, s.nats_tls_client_cert, s.nats_tls_client_key)
        except creds.CredsError as e:
            raise LaunchError(str(e)) from None
        if s.embedded_nats and (owner := running_embedded(s.data_dir)) is not None:
            # another `rollbus serve` of this DATA_DIR runs the embedded server: join it
            # with the generated credentials, start only our engine, ranks and api
            try:
                users = {r: creds.load(s.creds_dir, r) for r in creds.ROLES}
            except creds.CredsError as e:
                raise LaunchError(
                    f"cannot join the embedded nats-server at {owner.url}: {e}"
                ) from None
            self.role_urls = {r: creds.with_creds(owner.url, *users[r]) for r in creds.ROLES}
            check_nats(self.role_urls["api"], tls, s.instance)
            self.joined = owner
            s = s.model_copy(update={"nats_url": owner.url})
            _say(
                f"joined the embedded nats-server at {owner.url} of {s.data_dir} (run by "
                f"instance {owner.instance!r}, launcher pid {owner.launcher_pid})"
            )
        elif s.embedded_nats:
            self.nats, self.role_urls = start_embedded(s)
            self._claim()
            s = s.model_copy(update={"nats_url": self.nats.url})
            _say(f"embedded nats-server at {self.nats.url} (store {s.data_dir / 'nats'})")
        else:
            self.role_urls = {r: creds.role_url(s.nats_url, r, s.creds_dir) for r in creds.ROLES}
            check_nats(self.role_urls["api"], tls, s.instance)
        if not s.model:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # paddle's import-time chatter
                ensure_tiny_model(s.model_dir, seed=s.seed)
        # children must resolve relative paths the same way whatever their cwd
        s = s.model_copy(
            update={"data_dir": s.data_dir.resolve(), "model": str(s.model_dir.resolve())}
        )
        self.settings = s
        return s

    def _claim(self) -> None:
        """Record that this launcher runs the embedded server of its DATA_DIR (another
        ``rollbus serve`` of the same DATA_DIR joins it instead of starting one)."""
        assert self.nats is not None
        EmbeddedOwner(
            self.nats.url, self.nats.port, self.nats.proc.pid, os.getpid(), self.settings.instance
        ).write(self.settings.data_dir)

    def _release(self) -> None:
        owner = EmbeddedOwner.read(self.settings.data_dir)
        if owner is not None and owner.launcher_pid == os.getpid():
            EmbeddedOwner.path(self.settings.data_dir).unlink(missing_ok=True)

    def _take_over(self) -> None:
        """A joined instance whose embedded server is gone with its launcher (that stack
        stopped) starts the server again itself, on the same port, store and credentials:
        our processes reconnect by themselves, as after a restart of the server. Several
        joined instances may race for the port: one wins, the others join it."""
        joined = self.joined
        assert joined is not None
        current = EmbeddedOwner.read(self.settings.data_dir)
        if current is not None and (current.serving or current.owned):
            if current.launcher_pid != joined.launcher_pid and current.serving:
                self.joined = current  # another joined instance took it over first
                _say(
                    f"the embedded nats-server at {current.url} is now run by instance "
                    f"{current.instance!r}"
                )
            return  # running, or its launcher is restarting it
        s = self.settings.model_copy(update={"nats_port": joined.port})
        try:
            self.nats, _ = start_embedded(s)
        except LaunchError:
            return  # e.g. another instance took the port first: looked at again next round
        self.joined = None
        self._claim()
        _say(
            f"the embedded nats-server of instance {joined.instance!r} stopped with it: "
            f"this instance runs it now at {self.nats.url}"
        )

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        env = {**QUIET_ENV, **os.environ, **self.settings.to_env(), **(extra_env or {})}
        # each child gets its own role's credentials, and only those
        role = "worker" if name.startswith(RANK) else name
        env["ROLLBUS_NATS_URL"] = self.role_urls.get(role, self.settings.nats_url)
        # own session: a terminal's Ctrl-C reaches the launcher only, which stops the
        # children in order (nats-server last)
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=env,
            start_new_session=True,
            preexec_fn=natsd.die_with_parent,
        )
        self.children.append(Child(name, proc, args))

    def start(self) -> None:
        self.prepare()
        if self._stopping:  # stopped while preparing: nothing more to start
            return
        # a new stack starts fresh; an engine restarted later restores its stored state
        self.spawn("engine", ["services.engine"], {ENGINE_FRESH_START: "1"})
        self._spawn_ranks()
        self.spawn("api", ["services.api"], {LAUNCHER_PID: str(os.getpid())})

    def _spawn_ranks(self) -> None:
        ports: list[int] = []
        while len(ports) < self.settings.tp:
            if (p := rendezvous_port()) not in ports:
                ports.append(p)
        endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
        self.rank_endpoints = endpoints
        for r in range(self.settings.tp):
            self.spawn(
                f"{RANK} {r}", ["services.worker", "--rank", str(r), "--endpoints", endpoints]
            )

    def _restart_ranks(self) -> None:
        """All ranks again, on new rendezvous ports (the engine waits for them)."""
        ranks = [c for c in self.children if c.name.startswith(RANK)]
        for c in ranks:
            if c.proc.poll() is None:
                c.proc.kill()
            c.proc.wait()
        self._remove_segments()
        self.children = [c for c in self.children if c not in ranks]
        self._spawn_ranks()

    def _remove_segments(self) -> None:
        """The shared-memory all-reduce files of the rank set that just exited. Ranks
        unlink them once every rank has mapped them; a rank killed before that (a start
        cut short) leaves its file, under a name no later rank set uses (new ports)."""
        if not self.rank_endpoints:
            return
        d = segment_dir(default_root(), self.rank_endpoints)
        try:
            st = os.lstat(d)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return  # not the private directory the ranks make: not ours to touch
        for f in d.glob("rank*"):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()

    def _health(self) -> bool:
        url = f"http://{self.settings.api_host}:{self.settings.api_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def _respawn(self, c: Child) -> None:
        """The same process again (same role credentials), in the same place of the
        children list."""
        i = self.children.index(c)
        self.children.remove(c)
        self.spawn(c.name, c.args, {LAUNCHER_PID: str(os.getpid())} if c.name == "api" else None)
        self.children.insert(i, self.children.pop())

    def _restart_nats(self) -> bool:
        """The embedded nats-server again, on its port and store, with the same
        configuration and credentials (clients reconnect)."""
        assert self.nats is not None
        s = self.settings.model_copy(update={"nats_port": self.nats.port})
        deadline = time.monotonic() + NATS_RESTART_S
        while not self._stopping:
            try:
                self.nats, _ = start_embedded(s)
                self._claim()
                return True
            except LaunchError as e:
                if time.monotonic() > deadline:
                    _say(f"embedded nats-server cannot start again: {e}")
                    return False
                time.sleep(1.0)  # e.g. its port is still held by closing connections
        return False

    def _child_died(self, c: Child, code: int, ready_once: bool) -> tuple[int, str]:
        """Handle one dead child: ``(0, "")`` when restarted, else the launcher's exit code
        and why the stack must stop."""
        is_rank = c.name.startswith(RANK)
        if is_rank and code == RANK_CONFIG_ERROR:
            return 2, f"{c.name} cannot start: configuration error (not retried, see above)"
        if not ready_once:
            if is_rank and code == RANK_INIT_FAILED and self.rank_retries < RANK_RETRIES:
                # seen here under load: paddle's gloo group setup now and then fails
                # with "Connection refused" at start; the ranks start again together
                self.rank_retries += 1
                _say(
                    f"{c.name} failed to start (exit code {code}); restarting the "
                    f"ranks ({self.rank_retries}/{RANK_RETRIES})"
                )
                self._restart_ranks()
                return 0, ""
            # never ready: a config error or a crash at start, which a restart repeats
            return 1, f"{c.name} exited with code {code}; stopping the others"
        what = "worker ranks" if is_rank else c.name
        if not self.budget.take(what):
            return 1, (
                f"{c.name} exited with code {code}; {what} restarted "
                f"{self.budget.limit} times within {self.budget.window:g}s already: "
                "stopping the others"
            )
        self.restarts += 1
        if is_rank:
            # the gloo group needs every rank: all of them start again, and the engine
            # brings them to its version and sleep state
            _say(f"{c.name} exited with code {code}; restarting all worker ranks")
            self._restart_ranks()
        else:
            _say(f"{c.name} exited with code {code}; restarting it")
            self._respawn(c)
        return 0, ""

    def monitor(self) -> int:
        """Wait until a signal (exit 0) or a death the policy does not restart (exit 1).

        Before the stack is first ready, only a transient rank start failure is retried
        (``RANK_RETRIES``). Once it has been ready: a dead engine is restarted (it restores
        its state from the KV bucket), a dead rank restarts all ranks, a dead API or
        embedded nats-server is restarted; more than ``ROLLBUS_RESTART_LIMIT`` restarts of one
        process within ``ROLLBUS_RESTART_WINDOW_S`` stop the stack, naming the process.
        """
        ready = ready_once = announced = False
        next_probe = next_owner_check = 0.0
        while not self._stopping:
            # a stack that answered /health 200 was ready even if our own probe (every
            # 0.5 s) had not seen it yet: a user may kill a process right after that 200
            # (the API signals its first 200 before the reply leaves)
            ready_once = ready_once or self._api_ready
            for c in list(self.children):
                code = c.proc.poll()
                if code is None or self._stopping:
                    continue
                ready_once = ready_once or self._api_ready or self._health()
                exit_code, why = self._child_died(c, code, ready_once)
                if why:
                    _say(why)
                    return exit_code
                ready = False
                break  # the children list changed
            if self.nats is not None and self.nats.proc.poll() is not None and not self._stopping:
                code = self.nats.proc.returncode
                if not ready_once or not self.budget.take("nats-server"):
                    _say(f"embedded nats-server exited with code {code}; stopping the others")
                    return 1
                _say(f"embedded nats-server exited with code {code}; restarting it")
                self.restarts += 1
                if not self._restart_nats():
                    return 1
                ready = False
            if self.joined is not None and time.monotonic() >= next_owner_check:
                next_owner_check = time.monotonic() + 0.5
                self._take_over()
            if not ready and time.monotonic() >= next_probe:
                ready = self._health()
                next_probe = time.monotonic() + 0.5
                if ready:
                    s = self.settings
                    _say(
                        f"{'recovered' if announced else 'ready'}: http://{s.api_host}:"
                        f"{s.api_port} (model {s.served_model_name}, tp={s.tp}, "
                        f"nats {creds.redact(s.nats_url)})"
                    )
                    ready_once = announced = True
            time.sleep(0.1)
        return 0

    def stop(self) -> None:
        """API, engine, ranks, then nats-server: each SIGTERM, SIGKILL past its share.

        The bus clients (api, engine, ranks) drain while the server is still up, so
        nothing fails on a vanished connection; the whole stop takes < 10 s.
        """
        t0 = time.monotonic()
        deadline = t0 + STOP_BUDGET_S
        stopped: list[str] = []
        for prefix, share in STOP_ORDER:
            group = [c for c in self.children if c.name.startswith(prefix)]
            for c in group:
                if c.proc.poll() is None:
                    c.proc.terminate()
            until = min(deadline - 1.0, time.monotonic() + share)
            for c in group:
                try:
                    c.proc.wait(max(0.05, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _say(f"{c.name} did not stop within {share:g}s: killed")
                    c.proc.kill()
                    c.proc.wait()
                stopped.append(c.name)
            if prefix == RANK:
                self._remove_segments()
        if self.nats is not None:
            self.nats.stop(max(0.5, deadline - time.monotonic()))
            stopped.append("nats-server")
            self.nats = None
            self._release()  # a joined instance may take the server over now
        if self._stopping and stopped:
            _say(f"stopped {', '.join(stopped)} in {time.monotonic() - t0:.1f}s")
        self.children = []

    def run(self) -> int:
        def on_signal(signum: int, _frame: object) -> None:
            self._stopping = True  # a second Ctrl-C changes nothing: the stop is bounded

        def on_ready(signum: int, _frame: object) -> None:
            self._api_ready = True

        def handle_signals() -> None:
            for sig in _signals.STOP_SIGNALS:
                signal.signal(sig, on_signal)
            signal.signal(READY_SIGNAL, on_ready)

        handle_signals()
        if _signals.received:  # Ctrl-C while still importing: stop before starting
            return 0
        try:
            self.start()
            # again after start: importing paddle (model check, default model) installs
            # its own SIGTERM handler
            handle_signals()
            return self.monitor()
        except LaunchError as e:
            _say(str(e))
            return 2
        finally:
            self.stop()


def check_model(
    model_dir: Path, tp: int, weights: bool = True, generation_config: bool = True
) -> None:
    """A model dir the ranks cannot serve is one line at once, before any rank starts.
    ``weights``: its ranks load it from the dir itself (``snapshot``), so it must hold
    safetensors files (else each rank would fail on its own, after the stack started).
    ``generation_config``: its ``generation_config.json`` gives the request defaults
    (``ROLLBUS_GENERATION_CONFIG=auto``), so a field out of range there is refused too
    (else every request taking that default would fail)."""
    try:
        cfg = read_hf_config(model_dir)
    except ConfigError as e:
        raise LaunchError(f"ROLLBUS_MODEL={model_dir}: {e}") from None
    try:
        ModelConfig.from_hf(cfg).validate_tp(tp)
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise LaunchError(f"ROLLBUS_MODEL={model_dir}: unsupported model config: {e!s}") from None
    if generation_config:
        try:
            generation_defaults(model_dir)
        except ConfigError as e:
            raise LaunchError(f"ROLLBUS_MODEL={model_dir}: {e}") from None
    if weights:
        try:
            files = checkpoint_files(Path(model_dir))
        except ValueError as e:
            raise LaunchError(f"ROLLBUS_MODEL={model_dir}: {e}") from None
        odd = [f.name for f in files if f.exists() and not f.is_file()]
        if odd:  # a FIFO, a directory: no rank can read it (never "missing")
            raise LaunchError(f"ROLLBUS_MODEL={model_dir}: {odd[0]} is not a regular file")
        missing = [f.name for f in files if not f.is_file()]
        if not files or missing:
            bins = sorted(f.name for f in Path(model_dir).glob("*.bin"))
            raise LaunchError(
                f"ROLLBUS_MODEL={model_dir}: "
                + (f"{INDEX_FILE} names missing {missing[0]}" if missing else "no *.safetensors")
                + (f" ({bins[0]} is not read: save with safetensors)" if bins else "")
            )


def check_device(settings: Settings) -> None:
    """``ROLLBUS_DEVICE`` this paddle build cannot serve is one line at once, before any
    rank starts (a rank checks too). Asked of a worker process: the launcher never
    imports paddle."""
    cmd = [sys.executable, "-m", "services.worker", "--rank", "0", "--check-device"]
    env = {**QUIET_ENV, **os.environ, **settings.to_env()}
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"ROLLBUS_DEVICE={settings.device}: device check hung") from None
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        raise LaunchError(lines[-1] if lines else f"device check exited {r.returncode}")


def serve(settings: Settings) -> int:
    # everything the stack creates is its owner's alone (DATA_DIR, the default model, the
    # server's ports and owner files, logs, every child's files): the children inherit it
    os.umask(0o077)
    try:
        Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a bad setting: one line, exit 2 (README "Settings")
        _say(f"ROLLBUS_DATA_DIR={settings.data_dir}: cannot create it ({e.strerror or e})")
        return 2
    return Launcher(settings).run()
