"""Asynchronous GRPO against a rollbus instance (``python -m examples.async_grpo``).

Rollout threads keep requests in flight on the OpenAI API (``/v1/completions``: token-id
prompts, ``n`` samples per prompt as the GRPO group, ``logprobs`` of the sampled tokens,
``return_token_ids``, the versions that generated them) and put finished groups on a
bounded queue; the trainer takes ``batch`` groups per step, updates the paddle policy
(:class:`examples.async_grpo.grpo.Learner`) and publishes a version every
``publish_every`` steps with ``CheckpointPublisher``. The instance follows the versions
itself (``ROLLBUS_AUTO_UPDATE=1``, pause mode ``keep``): the rollout threads never stop,
requests in flight across an update continue on the new weights.

``--mode sync`` is the synchronous baseline on the same task and budget: generate a
batch → train → publish → wait until the instance serves it → generate.

Without ``--api-url`` it starts ``rollbus serve`` itself (free ports, its own
``DATA_DIR`` under the output dir, TP ``--tp``), serving a model dir it writes from the
seeded policy (``config.json`` llama, ``tokenizer.json`` of the task, weights).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import queue
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from examples.async_grpo import grpo, task
from services import serveproc

FIELDS = ["t_s", "step", "mode", "version", "behaviour_version", "reward", "staleness_mean",
          "staleness_max", "rollout_tokens", "rows", "loss", "clipped"]


# --------------------------------------------------------------------------- the stack


@dataclass
class Served:
    api_url: str
    nats_url: str
    instance: str
    model: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def stop(self) -> None:
        if self.proc is not None:
            serveproc.stop(self.proc)


def policy_config() -> dict[str, Any]:
    from examples.async_grpo.policy import llama_config

    return llama_config(task.VOCAB_SIZE, hidden_size=64, layers=2, heads=4, kv_heads=2,
                        intermediate_size=128, max_positions=64, bos=task.BOS, eos=task.EOS)


def new_policy(seed: int) -> Any:
    import paddle

    from examples.async_grpo.policy import LlamaForCausalLM

    paddle.seed(seed)
    m = LlamaForCausalLM(policy_config())
    m.init_weights(seed)
    return m


def start_rollbus(out: Path, model: Any, tp: int, env: dict[str, str] | None = None) -> Served:
    """``rollbus serve`` on free ports with its own DATA_DIR, serving ``model``."""
    from examples.async_grpo.policy import write_model_dir

    model_dir = out / "models" / "grpo-policy"
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    write_model_dir(model_dir, model)
    task.write_tokenizer(model_dir)
    api_port, nats_port = serveproc.free_port(), serveproc.free_port()
    full = serveproc.serve_env(
        ROLLBUS_MODEL=str(model_dir),
        ROLLBUS_DATA_DIR=str(out / "data"),
        ROLLBUS_API_PORT=str(api_port),
        ROLLBUS_NATS_PORT=str(nats_port),
        ROLLBUS_TP=str(tp),
        ROLLBUS_AUTO_UPDATE="1",
        ROLLBUS_AUTO_UPDATE_PAUSE_MODE="keep",
        ROLLBUS_LOAD_STRATEGY="object_store",
        ROLLBUS_MAX_BATCH_SIZE="256",
        ROLLBUS_KV_CACHE_BLOCKS="512",
        ROLLBUS_LOG_LEVEL="warning",
        PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    )
    full.update(env or {})
    log = out / "rollbus.log"
    proc = serveproc.spawn(full, log)
    api = f"http://127.0.0.1:{api_port}"
    try:
        serveproc.wait_healthy(api, proc, log, timeout=180)
    except RuntimeError:
        proc.kill()
        raise
    from shared.creds import role_url

    nats = role_url(f"nats://127.0.0.1:{nats_port}", "trainer", out / "data" / "creds")
    return Served(api, nats, "default", model_dir.name, proc, log)


# --------------------------------------------------------------------------- rollouts


class Rollouts:
    """``/v1/completions`` through the ``openai`` client when installed, else httpx."""

    def __init__(self, api_url: str, model: str, group: int, api_key: str = "x") -> None:
        self.model, self.group = model, group
        self.tokens = 0  # completion tokens received
        self._lock = threading.Lock()
        try:
            import openai

            self._openai: Any = openai.OpenAI(base_url=api_url + "/v1", api_key=api_key,
                                              timeout=120, max_retries=0)
        except ImportError:
            self._openai = None
        self._http = httpx.Client(base_url=api_url, timeout=120,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def _complete(self, prompt: list[int], seed: int) -> dict[str, Any]:
        args: dict[str, Any] = dict(model=self.model, prompt=prompt, n=self.group,
                                    max_tokens=task.MAX_TOKENS, temperature=1.0, logprobs=0,
                                    seed=seed)
        if self._openai is not None:
            r = self._openai.completions.create(**args, extra_body={"return_token_ids": True})
            return dict(r.model_dump())
        resp = self._http.post("/v1/completions", json={**args, "return_token_ids": True})
        resp.raise_for_status()
        return dict(resp.json())

    def group_of(self, a: int, b: int, seed: int) -> grpo.Group:
        p = task.prompt_ids(a, b)
        body = self._complete(p, seed)
        samples = []
        n_tok = 0
        for c in sorted(body["choices"], key=lambda c: c["index"]):
            toks = list(c["token_ids"])
            lps = list(c["logprobs"]["token_logprobs"])
            spans = c.get("weight_versions") or []
            versions = [s["version"] for s in spans] or [body["weight_version"]]
            samples.append(grpo.Sample(p, toks, lps, task.reward(a, b, toks), versions))
            n_tok += len(toks)
        with self._lock:
            self.tokens += n_tok
        return grpo.Group(a, b, samples)

    def version(self) -> str:
        """The served version ("" while ``/v1/status`` cannot answer, e.g. mid-update)."""
        try:
            r = self._http.get("/v1/status")
        except httpx.HTTPError:
            return ""
        return str(r.json().get("weight_version", "")) if r.status_code == 200 else ""

    def close(self) -> None:
        self._http.close()
        if self._openai is not None:
            self._openai.close()


# --------------------------------------------------------------------------- versions


@dataclass
class Versions:
    """Published versions in order: ``<tag>-<step>``; the index of a version is its place
    in publish order (the served model dir's own version is 0)."""

    tag: str
    order: dict[str, int] = field(default_factory=dict)

    def name(self, step: int) -> str:
        return f"{self.tag}-{step}"

    def add(self, version: str) -> int:
        self.order[version] = len(self.order) + 1
        return self.order[version]

    def index(self, version: str) -> int:
        return self.order.get(version, 0)


class Publisher:
    """Publishes on one background thread, in order: the trainer goes on meanwhile."""

    def __init__(self, nats_url: str, model: str, tp: int, instance: str) -> None:
        from services.trainer import CheckpointPublisher

        self.pub = CheckpointPublisher(nats_url, instance=instance)
        self.model, self.tp = model, tp
        self.config: dict[str, Any] | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self.last: Any = None

    def submit(self, version: str, state: dict[str, np.ndarray]) -> Any:
        self.last = self.pool.submit(
            self.pub.publish, self.model, version, state, tp=self.tp, config=self.config
        )
        return self.last

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def snapshot(model: Any) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- loops


@dataclass
class Options:
    mode: str = "async"
    steps: int = 150
    batch: int = 8
    group: int = 16
    publish_every: int = 2
    lr: float = 1e-3
    entropy: float = 0.01
    clip: float = 0.2
    seed: int = 0
    queue_groups: int = 0  # 0 = batch: at most this many finished groups wait
    concurrency: int = 0  # requests in flight (async); 0 = batch
    # stop early once the mean reward of the last ``until_window`` steps reaches this (0 =
    # run every step): a step budget, not a wall-clock one, since async rollouts make each
    # run's curve depend on timing
    until: float = 0.0
    until_window: int = 20


@dataclass
class Result:
    rows: list[dict[str, Any]]
    seconds: float
    tokens: int
    steps: int

    @property
    def steps_per_min(self) -> float:
        return self.steps / self.seconds * 60

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def reward(self, first: bool, k: int = 10) -> float:
        xs = [r["reward"] for r in (self.rows[:k] if first else self.rows[-k:])]
        return float(np.mean(xs))


def _staleness(groups: list[grpo.Group], versions: Versions, current: int) -> tuple[float, int]:
    st = [current - min(versions.index(v) for v in s.versions)
          for g in groups for s in g.samples]
    return float(np.mean(st)), int(max(st))


def train(served: Served, model: Any, opts: Options, versions: Versions, tp: int,
          on_row: Any = None) -> Result:
    learner = grpo.Learner(model, lr=opts.lr, clip=opts.clip, entropy=opts.entropy)
    rollouts = Rollouts(served.api_url, served.model, opts.group)
    publisher = Publisher(served.nats_url, served.model, tp, served.instance)
    publisher.config = policy_config_of(model)
    rows: list[dict[str, Any]] = []
    stop = threading.Event()
    q: queue.Queue[grpo.Group | BaseException] = queue.Queue(opts.queue_groups or opts.batch)
    current = 0  # index of the newest published version
    t0 = time.perf_counter()

    def produce(wid: int) -> None:
        rng = np.random.default_rng(opts.seed * 1000 + wid + 1)
        while not stop.is_set():
            a, b = task.PROMPTS[int(rng.integers(len(task.PROMPTS)))]
            try:
                g: grpo.Group | BaseException = rollouts.group_of(a, b, int(rng.integers(2**31)))
            except BaseException as e:  # noqa: BLE001 - handed to the trainer
                g = e
            while not stop.is_set():
                try:
                    q.put(g, timeout=0.2)
                    break
                except queue.Full:
                    continue

    rng = np.random.default_rng(opts.seed)
    sync_pool = ThreadPoolExecutor(opts.batch, thread_name_prefix="rollout")
    threads: list[threading.Thread] = []
    if opts.mode == "async":
        threads = [threading.Thread(target=produce, args=(w,), daemon=True)
                   for w in range(opts.concurrency or opts.batch)]
        for t in threads:
            t.start()
    try:
        for step in range(1, opts.steps + 1):
            if opts.mode == "async":
                groups = []
                while len(groups) < opts.batch:
                    item = q.get(timeout=300)
                    if isinstance(item, BaseException):
                        raise item
                    groups.append(item)
            else:
                picks = [task.PROMPTS[int(i)] for i in rng.integers(len(task.PROMPTS),
                                                                     size=opts.batch)]
                seeds = [int(s) for s in rng.integers(2**31, size=opts.batch)]
                groups = list(sync_pool.map(lambda x: rollouts.group_of(*x[0], x[1]),
                                            zip(picks, seeds, strict=True)))
            stats = learner.step(groups)
            st_mean, st_max = _staleness(groups, versions, current)
            behaviour = float(np.mean([min(versions.index(v) for v in s.versions)
                                       for g in groups for s in g.samples]))
            if step % opts.publish_every == 0:
                name = versions.name(step)
                fut = publisher.submit(name, snapshot(model))
                current = versions.add(name)
                if opts.mode == "sync":  # generate → train → update → generate
                    fut.result()
                    wait_served(rollouts, name)
            row = {
                "t_s": round(time.perf_counter() - t0, 3), "step": step, "mode": opts.mode,
                "version": current, "behaviour_version": behaviour,
                "reward": float(np.mean([s.reward for g in groups for s in g.samples])),
                "staleness_mean": st_mean, "staleness_max": st_max,
                "rollout_tokens": rollouts.tokens, "rows": stats["rows"],
                "loss": stats["loss"], "clipped": stats["clipped"],
            }
            rows.append(row)
            if on_row:
                on_row(row)
            if opts.until and _reached(rows, opts.until, opts.until_window):
                break
        seconds = time.perf_counter() - t0
        tokens = rollouts.tokens
        if publisher.last is not None:
            publisher.last.result()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)
        sync_pool.shutdown(wait=True)
        publisher.close()
        rollouts.close()
    return Result(rows, seconds, tokens, len(rows))


def _reached(rows: list[dict[str, Any]], target: float, window: int) -> bool:
    return len(rows) >= window and np.mean([r["reward"] for r in rows[-window:]]) >= target


def policy_config_of(model: Any) -> dict[str, Any]:
    return dict(model.config)


def wait_served(rollouts: Rollouts, version: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while rollouts.version() != version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the instance did not switch to {version} in {timeout:g}s")
        time.sleep(0.05)


# --------------------------------------------------------------------------- outputs


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    rew = np.array([r["reward"] for r in rows])
    k = min(10, len(rew))
    smooth = np.convolve(rew, np.ones(k) / k, mode="valid")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, rew, ".", alpha=0.4, label="batch mean")
    ax1.plot(t[k - 1 :], smooth, "-", label=f"mean of {k} steps")
    ax1.set_ylabel("reward")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="lower right")
    ax1.set_title(title)
    ax2.plot(t, [r["staleness_mean"] for r in rows], "-", label="mean")
    ax2.plot(t, [r["staleness_max"] for r in rows], ".", alpha=0.5, label="max")
    ax2.set_ylabel("staleness (versions)")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(opts: Options, out: Path, *, tp: int = 1, api_url: str = "", nats_url: str = "",
        instance: str = "default", model_name: str = "", quiet: bool = False,
        plot_png: bool = True) -> Result:
    """One run: start (or use) an instance, train, write ``metrics.csv`` / ``reward.png``."""
    out.mkdir(parents=True, exist_ok=True)
    import logging

    # paddle's import sets the root logger to INFO: one line per request otherwise (the
    # openai client may ship its own httpx, "httpx2")
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if api_url:
        served = Served(api_url, nats_url, instance, model_name)
        model = policy_from_instance(served)
    else:
        model = new_policy(opts.seed)
        served = start_rollbus(out, model, tp)
    versions = Versions(f"grpo-{uuid.uuid4().hex[:6]}")

    def show(r: dict[str, Any]) -> None:
        if not quiet and (r["step"] % 10 == 0 or r["step"] == 1):
            print(f"step {r['step']:4d}  t {r['t_s']:6.1f}s  reward {r['reward']:.3f}  "
                  f"staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})  "
                  f"version {r['version']}", flush=True)

    try:
        res = train(served, model, opts, versions, tp, show)
    finally:
        served.stop()
    write_csv(out / "metrics.csv", res.rows)
    if plot_png:
        plot(out / "reward.png", res.rows,
             f"GRPO ({opts.mode}) on rollbus: add two digits, {opts.batch}×{opts.group} / step")
    return res


def policy_from_instance(served: Served) -> Any:
    """A policy equal to what a running instance serves: its config, and its weights read
    back with ``rollout_state_dict`` (mapped to the training names)."""
    import asyncio

    import paddle

    from examples.async_grpo.policy import LlamaForCausalLM
    from services.trainer import CheckpointPublisher, names, rollout_state_dict
    from shared.model_config import ModelConfig

    pub = CheckpointPublisher(served.nats_url, instance=served.instance)
    hf = asyncio.run(pub.served_config())
    m = LlamaForCausalLM(hf)
    state = rollout_state_dict(served.nats_url, served.instance)
    m.set_state_dict({k: paddle.to_tensor(v) for k, v in
                      names.to_training(state, ModelConfig.from_hf(hf)).items()})
    if not served.model:
        served.model = str(httpx.get(served.api_url + "/v1/models").json()["data"][0]["id"])
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.async_grpo",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["async", "sync"], default="async")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8, help="prompts (groups) per step")
    ap.add_argument("--group", type=int, default=16, help="samples per prompt (n)")
    ap.add_argument("--publish-every", type=int, default=2, help="publish a version every K steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--until", type=float, default=0.0,
                    help="stop once the mean reward of the last 20 steps reaches this")
    ap.add_argument("--tp", type=int, default=1, help="ranks of the instance it starts")
    ap.add_argument("--out", type=Path, default=Path(".data/examples/async_grpo"))
    ap.add_argument("--api-url", default="", help="use this running instance (AUTO_UPDATE on)")
    ap.add_argument("--nats-url", default="", help="its NATS, with the trainer's credentials")
    ap.add_argument("--instance", default="default")
    ap.add_argument("--model", default="", help="served model id (default: the first listed)")
    a = ap.parse_args(argv)
    if a.api_url and not a.nats_url:
        ap.error("--api-url needs --nats-url (e.g. \"$(rollbus creds trainer)\")")
    opts = Options(mode=a.mode, steps=a.steps, batch=a.batch, group=a.group,
                   publish_every=a.publish_every, lr=a.lr, seed=a.seed, until=a.until)
    res = run(opts, a.out, tp=a.tp, api_url=a.api_url, nats_url=a.nats_url,
              instance=a.instance, model_name=a.model)
    print(json.dumps({
        "mode": opts.mode, "steps": res.steps, "seconds": round(res.seconds, 1),
        "reward_first10": round(res.reward(True), 3), "reward_last10": round(res.reward(False), 3),
        "trainer_steps_per_min": round(res.steps_per_min, 1),
        "rollout_tokens_per_s": round(res.tokens_per_s, 1),
        "csv": str(a.out / "metrics.csv"), "png": str(a.out / "reward.png"),
    }, indent=1))
    return 0
