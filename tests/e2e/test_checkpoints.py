"""Checkpoint distribution through real stacks: SDK/CLI publish, object_store and ipc
load strategies, every failure of the contract, auto-update on trainer events."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from services.tiny_model import create_model_dir, write_version
from services.trainer import names
from services.trainer.publisher import CheckpointPublisher, VersionConflict
from services.worker.sources import parse_safetensors
from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from tests.e2e.stack import Stack, model_config, start_stack
from tests.e2e.test_control import digests

BUCKET = "rollbus_ckpt"


def post(stack: Stack, path: str, **kw: Any) -> httpx.Response:
    with stack.client() as c:
        return c.post(path, **kw)


def model_of(stack: Stack) -> str:
    return stack.model_dir.name


def training_state(stack: Stack, seed: int) -> dict[str, np.ndarray]:
    """What a paddle trainer would hand us: training names, [in, out] Linear weights."""
    cfg = ModelConfig.from_hf(model_config(stack.model_dir))
    return names.to_training(sharding.init_weights(cfg, seed), cfg)


def expected_digests(blobs: list[bytes]) -> dict[int, str]:
    """services.worker.weights.digest computed straight from the published shards."""
    out = {}
    for r, blob in enumerate(blobs):
        arrays = parse_safetensors(blob, f"rank {r}")
        h = hashlib.sha256()
        for name in sorted(arrays):
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).tobytes())
        out[r] = h.hexdigest()
    return out


def publish(stack: Stack, version: str, seed: int, **kw: Any) -> dict[int, str]:
    """Publish through the SDK; return the per-rank digests the ranks should then have."""
    pub = CheckpointPublisher(stack.nats_url, ipc_dir=kw.pop("ipc_dir", "/dev/shm/rollbus"))
    state = training_state(stack, seed)
    cfg = model_config(stack.model_dir)
    res = pub.publish(model_of(stack), version, state, tp=2, config=cfg, **kw)
    assert res.version == version and res.seq > 0
    blobs, _ = pub.prepare(model_of(stack), version, state, 2, cfg)
    return expected_digests(blobs)


def update(stack: Stack, version: str | None, verify: bool = True) -> httpx.Response:
    body: dict[str, Any] = {"verify_checksum": verify}
    if version:
        body["version"] = version
    return post(stack, "/v1/update_weights", json=body)


async def _raw(nats_url: str, fn: Any) -> Any:
    nc = await nats.connect(nats_url)
    try:
        return await fn(nc)
    finally:
        await nc.close()


def upload_raw(stack: Stack, version: str, blobs: list[bytes], man: mf.Manifest) -> None:
    """Objects straight into the bucket (no SDK checks, no event): to plant bad versions."""

    async def go(nc: Any) -> None:
        await objstore.ensure_bucket(nc, BUCKET)
        for spec, blob in zip(man.shards, blobs, strict=True):
            await objstore.put_object(
                nc, BUCKET, ckpt_object_name(model_of(stack), version, spec.file), blob
            )
        await objstore.put_object(
            nc,
            BUCKET,
            ckpt_object_name(model_of(stack), version, "manifest.json"),
            mf.encode(man),
        )

    asyncio.run(_raw(stack.nats_url, go))


# --------------------------------------------------------------------------- object_store


@pytest.fixture(scope="module")
def ostack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        Path(tmp_path_factory.mktemp("ckpt")),
        nats_url,
        tp=2,
        model_name=f"ck-{uuid.uuid4().hex[:6]}.v1",  # a '.' in the id: escaped subjects
        env={"ROLLBUS_LOAD_STRATEGY": "object_store", "ROLLBUS_CONTROL_TIMEOUT_S": "5"},
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _resume_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "ostack" in request.fixturenames:
        post(request.getfixturevalue("ostack"), "/v1/resume")


def test_publish_update_serves_exactly_the_published_shards(ostack: Stack) -> None:
    before = digests(ostack)
    want = publish(ostack, "s1", seed=11)
    assert want != before
    assert post(ostack, "/v1/pause").status_code == 200
    r = update(ostack, "s1", verify=True)
    assert r.status_code == 200, r.text
    res = r.json()["result"]
    assert res["version"] == "s1" and [x["rank"] for x in res["ranks"]] == [0, 1]
    assert all(x["verified"] and x["pull_mib_s"] > 0 for x in res["ranks"])
    assert digests(ostack) == want
    st = ostack.status()
    assert st["weight_version"] == "s1" and {x["version"] for x in st["ranks"]} == {"s1"}
    # the initial version still loads locally (version.txt), and back again
    assert update(ostack, "v0", verify=False).status_code == 200
    assert digests(ostack) == before
    assert update(ostack, "s1", verify=False).status_code == 200
    assert digests(ostack) == want


def test_republish_is_idempotent_and_versions_are_immutable(ostack: Stack) -> None:
    pub = CheckpointPublisher(ostack.nats_url)
    cfg = model_config(ostack.model_dir)
    state = training_state(ostack, 12)
    first = pub.publish(model_of(ostack), "s2", state, tp=2, config=cfg)
    again = pub.publish(model_of(ostack), "s2", state, tp=2, config=cfg)
    assert first.uploaded and not again.uploaded and again.seq == first.seq
    versions = [v.version for v in pub.versions(model_of(ostack))]
    assert versions.count("s2") == 1 and versions.index("s1") < versions.index("s2")
    with pytest.raises(VersionConflict, match="different content"):
        pub.publish(model_of(ostack), "s2", training_state(ostack, 13), tp=2, config=cfg)


def test_unknown_version_is_404(ostack: Stack) -> None:
    assert post(ostack, "/v1/pause").status_code == 200
    r = update(ostack, "never-published")
    assert r.status_code == 404 and "never-published" in r.json()["error_message"]


def test_manifest_digest_mismatch_is_422_naming_rank_and_file(ostack: Stack) -> None:
    before, version_before = digests(ostack), ostack.status()["weight_version"]
    pub = CheckpointPublisher(ostack.nats_url)
    blobs, man = pub.prepare(
        model_of(ostack),
        "bad-digest",
        training_state(ostack, 14),
        2,
        model_config(ostack.model_dir),
    )
    man.shards[1].sha256 = "0" * 64
    upload_raw(ostack, "bad-digest", blobs, man)
    assert post(ostack, "/v1/pause").status_code == 200
    r = update(ostack, "bad-digest", verify=True)
    assert r.status_code == 422, r.text
    msg = r.json()["error_message"]
    assert "rank 1" in msg and "rank1-of-2.safetensors" in msg and "SHA-256" in msg
    assert digests(ostack) == before and ostack.status()["weight_version"] == version_before


def test_manifest_with_huge_tensor_names_is_a_small_422(ostack: Stack) -> None:
    """Every rank's error quotes the unexpected tensor names of a hostile manifest (5 of
    300 KB each here): its reply passed the server's max_payload — the server closed
    both ranks' connections for good (before the bus refused such a message), then the
    engine saw silent ranks (503) instead of the 422."""
    before, version_before = digests(ostack), ostack.status()["weight_version"]
    pub = CheckpointPublisher(ostack.nats_url)
    state, cfg = training_state(ostack, 17), model_config(ostack.model_dir)
    blobs, man = pub.prepare(model_of(ostack), "huge-names", state, 2, cfg)
    for shard in man.shards:
        for c in "abcde":
            shard.tensors[c * 300_000] = mf.TensorSpec([1], "float32")
    upload_raw(ostack, "huge-names", blobs, man)
    assert post(ostack, "/v1/pause").status_code == 200
    r = update(ostack, "huge-names", verify=True)
    assert r.status_code == 422 and "unexpected tensors" in r.text, r.text[:500]
    assert len(r.content) < 16_384
    assert digests(ostack) == before and ostack.status()["weight_version"] == version_before


def test_failed_wakeup_leaves_every_rank_asleep(ostack: Stack) -> None:
    """Rank 1's shard of the current version is deleted while asleep: wakeup is 422 and
    the engine stays ``sleeping`` — and so does every rank. Rank 0, whose shard was
    there, used to stay awake (weights and KV cache back in memory) under a ``sleeping``
    engine: memory the operator freed was taken again, and status said otherwise."""
    publish(ostack, "gone1", seed=18)
    publish(ostack, "keep1", seed=19)
    assert post(ostack, "/v1/pause").status_code == 200
    assert update(ostack, "gone1").status_code == 200
    assert post(ostack, "/v1/sleep").status_code == 200
    name = ckpt_object_name(model_of(ostack), "gone1", "rank1-of-2.safetensors")

    async def delete(nc: Any) -> None:
        await (await nc.jetstream().object_store(BUCKET)).delete(name)

    asyncio.run(_raw(ostack.nats_url, delete))
    r = post(ostack, "/v1/wakeup")
    assert r.status_code == 422 and "rank 1" in r.text, r.text  # its object is missing
    with ostack.client() as c:
        st = c.get("/v1/status", params={"fresh": "true"}).json()
    assert st["state"] == "sleeping" and st["weight_version"] == "gone1", st
    held = [(x["rank"], x["weights_loaded"], x["kv_allocated"]) for x in st["ranks"]]
    assert held == [(0, False, False), (1, False, False)], held
    # the documented way out: another version while asleep, then wake up
    assert update(ostack, "keep1").status_code == 200
    assert post(ostack, "/v1/wakeup").status_code == 200
    assert ostack.status()["state"] == "running"


def test_wakeup_refuses_a_version_whose_bytes_changed_while_asleep(ostack: Stack) -> None:
    """Wakeup reloads the current version from its files. Files changed while asleep (an
    HF snapshot written in place; an object replaced under a version taken with
    ``verify_checksum: false``) used to be served under the same version name: other
    weights, no sign. Now 422 naming the file, every rank stays asleep, and updating to
    the version again takes its new bytes on purpose."""
    f = write_version(ostack.model_dir, "wk-hf", seed=22) / "model.safetensors"
    assert post(ostack, "/v1/pause").status_code == 200
    assert post(ostack, "/v1/update_weights", json={"version": "wk-hf"}).status_code == 200
    served = digests(ostack)
    assert post(ostack, "/v1/sleep").status_code == 200
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x40  # one bit of the last tensor's data: the header still parses
    f.write_bytes(bytes(data))
    r = post(ostack, "/v1/wakeup")
    assert r.status_code == 422, r.text
    msg = r.json()["error_message"]
    assert "versions/wk-hf/model.safetensors changed" in msg and str(f) not in msg, msg
    with ostack.client() as c:
        st = c.get("/v1/status", params={"fresh": "true"}).json()
    assert st["state"] == "sleeping" and st["weight_version"] == "wk-hf", st
    assert [x["weights_loaded"] for x in st["ranks"]] == [False, False], st
    r = post(ostack, "/v1/update_weights", json={"version": "wk-hf"})
    assert r.status_code == 200, r.text
    assert post(ostack, "/v1/wakeup").status_code == 200
    assert digests(ostack) != served  # the new bytes, taken by an update

    publish(ostack, "wk-obj", seed=23)
    assert post(ostack, "/v1/pause").status_code == 200
    assert update(ostack, "wk-obj", verify=False).status_code == 200
    assert post(ostack, "/v1/sleep").status_code == 200
    blobs, _ = CheckpointPublisher(ostack.nats_url).prepare(
        model_of(ostack), "wk-obj", training_state(ostack, 23), 2, model_config(ostack.model_dir)
    )
    name = ckpt_object_name(model_of(ostack), "wk-obj", "rank0-of-2.safetensors")

    async def replace(nc: Any) -> None:  # rank 1's shard: same shapes, parses, wrong rank
        await (await nc.jetstream().object_store(BUCKET)).put(name, bytes(blobs[1]))

    asyncio.run(_raw(ostack.nats_url, replace))
    r = post(ostack, "/v1/wakeup")
    assert r.status_code == 422 and f"rank 0: version 'wk-obj': {name} changed" in r.text, r.text
    # rank 1 woke (its object is unchanged), rank 0 refused: rank 1 is put back to sleep
    # and status says so; both the same version name and another one are ways out
    with ostack.client() as c:
        st = c.get("/v1/status", params={"fresh": "true"}).json()
    assert st["state"] == "sleeping" and st["weight_version"] == "wk-obj", st
    assert [x["weights_loaded"] for x in st["ranks"]] == [False, False], st
    assert update(ostack, "wk-obj", verify=False).status_code == 200
    assert post(ostack, "/v1/wakeup").status_code == 200
    assert post(ostack, "/v1/sleep").status_code == 200
    assert update(ostack, "wk-hf", verify=False).status_code == 200
    assert post(ostack, "/v1/wakeup").status_code == 200


def test_version_taken_unverified_wakes_up_unverified(ostack: Stack) -> None:
    """A version whose shard does not match its manifest's SHA-256 (one float of the
    data changed, header intact) is 422 by default and served with an explicit
    ``verify_checksum: false``. Wakeup reloads the current version the way it was taken:
    it used to verify it again, 422, and the engine could not wake on its own version."""
    pub = CheckpointPublisher(ostack.nats_url)
    state, cfg = training_state(ostack, 20), model_config(ostack.model_dir)
    blobs, man = pub.prepare(model_of(ostack), "unverified", state, 2, cfg)
    bad = bytearray(blobs[0])
    start = 8 + int.from_bytes(bad[:8], "little") + 64  # inside the data, not the header
    bad[start : start + 4] = np.float32(0.5).tobytes()
    blobs[0] = bytes(bad)
    upload_raw(ostack, "unverified", blobs, man)
    assert post(ostack, "/v1/pause").status_code == 200
    r = update(ostack, "unverified", verify=True)
    assert r.status_code == 422 and "SHA-256" in r.text, r.text
    assert update(ostack, "unverified", verify=False).status_code == 200
    served = digests(ostack)
    assert post(ostack, "/v1/sleep").status_code == 200
    r = post(ostack, "/v1/wakeup")
    assert r.status_code == 200, r.text
    st = ostack.status()
    assert st["state"] == "running" and st["weight_version"] == "unverified", st
    assert digests(ostack) == served  # the same bytes as before the sleep


def test_corrupted_object_is_422_with_and_without_verify(ostack: Stack) -> None:
    before = digests(ostack)
    publish(ostack, "s3", seed=15)
    name = ckpt_object_name(model_of(ostack), "s3", "rank0-of-2.safetensors")

    async def corrupt(nc: Any) -> None:
        # a corrupt replica: same size, garbage bytes, through the stock client
        size = (await objstore.get_meta(nc, BUCKET, name)).size
        store = await nc.jetstream().object_store(BUCKET)
        await store.put(name, os.urandom(size))

    asyncio.run(_raw(ostack.nats_url, corrupt))
    assert post(ostack, "/v1/pause").status_code == 200
    for verify, needle in ((True, "SHA-256"), (False, "safetensors")):
        r = update(ostack, "s3", verify=verify)
        assert r.status_code == 422, r.text
        msg = r.json()["error_message"]
        assert "rank 0" in msg and "rank0-of-2.safetensors" in msg and needle in msg, msg
        assert digests(ostack) == before


def test_stopped_rank_is_503_and_no_rank_switches(ostack: Stack) -> None:
    publish(ostack, "s4", seed=16)
    before, version_before = digests(ostack), ostack.status()["weight_version"]
    pid = next(r["pid"] for r in ostack.status()["ranks"] if r["rank"] == 1)
    assert post(ostack, "/v1/pause").status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        r = update(ostack, "s4")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert "[1]" in r.json()["error_message"]
    time.sleep(1.0)  # rank 1 finishes the stale stage, then the abort drops it
    assert digests(ostack) == before and ostack.status()["weight_version"] == version_before
    # and the version still applies cleanly afterwards
    assert update(ostack, "s4").status_code == 200


# --------------------------------------------------------------------------- CLI


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**e, **(env or {})},
    )


def test_cli_publish_versions_and_clear_errors(ostack: Stack, tmp_path: Path) -> None:
    d = create_model_dir(tmp_path / "hf", model_config(ostack.model_dir), seed=21)
    m = model_of(ostack)
    # errors: one line, exit 2. Run beside the publish below (each is a process start, and
    # none reaches this stack's server: a missing dir, a non-HF dir, an unreachable URL)
    errors = (
        ([str(tmp_path / "missing")], "no such directory"),
        ([str(tmp_path)], "not an HF model dir"),
        ([str(d), "--nats-url", "nats://127.0.0.1:1"], "nats://127.0.0.1:1"),
    )
    with ThreadPoolExecutor(len(errors)) as pool:
        failed = [
            pool.submit(cli, "publish", *argv, "--model", m, "--version", "x", *url)
            for argv, _ in errors
            for url in [[] if "--nats-url" in argv else ["--nats-url", ostack.nats_url]]
        ]
        r = cli(
            "publish",
            str(d),
            "--model",
            m,
            "--version",
            "cli1",
            "--tp",
            "2",
            "--nats-url",
            ostack.nats_url,
        )
        assert r.returncode == 0, r.stderr
        assert "published" in r.stdout and "MiB/s" in r.stderr
        r = cli("versions", "--model", m, "--nats-url", ostack.nats_url)
        assert r.returncode == 0 and "cli1" in r.stdout, r.stderr
        assert post(ostack, "/v1/pause").status_code == 200
        assert update(ostack, "cli1").status_code == 200
        for (argv, needle), f in zip(errors, failed, strict=True):
            r = f.result()
            assert r.returncode == 2 and needle in r.stderr, (argv, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def events(stack: Stack, kind: str) -> list[dict[str, Any]]:
    async def go(nc: Any) -> list[dict[str, Any]]:
        js = nc.jetstream()
        sub = await js.subscribe(f"rollbus.{stack.instance}.events.{kind}", ordered_consumer=True)
        out = []
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return out
            out.append(json.loads(msg.data))

    return list(asyncio.run(_raw(stack.nats_url, go)))


def wait_for(pred: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def test_published_version_changes_greedy_output_to_the_new_weights(ostack: Stack) -> None:
    """A trainer's publish, then pause → update → resume: greedy completions are what an
    in-process tp=1 model with the published weights says, and differ from before."""
    from tests.e2e.reference import greedy

    cfg = ModelConfig.from_hf(model_config(ostack.model_dir))
    body = {
        "model": model_of(ostack),
        "prompt": "rollout",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    prompt = [256, *b"rollout"]
    assert post(ostack, "/v1/pause").status_code == 200
    assert update(ostack, "v0", verify=False).status_code == 200
    assert post(ostack, "/v1/resume").status_code == 200
    before = post(ostack, "/v1/completions", json=body).json()
    assert before["choices"][0]["token_ids"] == greedy(ostack.model_dir, prompt, 12)
    publish(ostack, "g1", seed=31)
    assert post(ostack, "/v1/pause").status_code == 200
    assert update(ostack, "g1").status_code == 200
    assert post(ostack, "/v1/resume").status_code == 200
    after = post(ostack, "/v1/completions", json=body).json()
    assert after["weight_version"] == "g1"
    want = greedy(ostack.model_dir, prompt, 12, weights=sharding.init_weights(cfg, 31))
    assert after["choices"][0]["token_ids"] == want
    assert want != before["choices"][0]["token_ids"]
