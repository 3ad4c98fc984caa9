"""HTTP hardening and checkpoint integrity through one real stack (issue 8 items 2, 3).

The stack runs with an admin token, the ``ipc`` strategy on a private ipc dir (object
store and snapshot versions load too: every strategy falls back to the others) and a
NATS URL that carries credentials, which no response may show.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import nats
import numpy as np
import pytest

from services.tiny_model import create_model_dir
from services.trainer import names
from services.trainer.publisher import CheckpointPublisher
from services.trainer.shards import write_sharded_dir
from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from shared.versions import ipc_version_dir
from tests.e2e.stack import Stack, model_config, start_stack

TOKEN = "t0k-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BUCKET = "rollbus_ckpt"
NOBODY = 65534


def with_creds(url: str) -> str:
    """The session URL with a user and password in it (kept if it has some already:
    the session server has no auth and accepts any)."""
    if "@" in url:
        return url
    return url.replace("://", "://alice:s3cret-pw@", 1)


@pytest.fixture(scope="module")
def sec(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("sec"))
    s = start_stack(
        tmp,
        with_creds(nats_url),
        tp=2,
        model_name=f"sec-{uuid.uuid4().hex[:6]}",
        env={
            "ROLLBUS_ADMIN_TOKEN": TOKEN,
            "ROLLBUS_LOAD_STRATEGY": "ipc",
            "ROLLBUS_IPC_DIR": str(tmp / "ipc"),
        },
    )
    s.env["IPC_DIR"] = str(tmp / "ipc")
    s.env["TMP"] = str(tmp)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _back_to_running(sec: Stack) -> Iterator[None]:
    yield
    with sec.client(headers=AUTH) as c:
        if c.get("/v1/status").json()["state"] == "sleeping":
            c.post("/v1/wakeup")
        c.post("/v1/resume")


ABS_PATH = re.compile(r"(?<![\w.:])/(tmp|dev|root|home|srv|var|data|proc|etc|usr)/")


def clean(stack: Stack, r: httpx.Response) -> httpx.Response:
    """Assert the response shows no absolute path and no credential."""
    text = r.text
    for secret in (stack.env["TMP"], stack.env["IPC_DIR"], str(stack.model_dir), TOKEN):
        assert secret not in text, (secret, text[:2000])
    userinfo = urlsplit(stack.nats_url).username or ""
    assert not userinfo or userinfo not in text, text[:2000]
    pw = urlsplit(stack.nats_url).password
    assert not pw or pw not in text, text[:2000]
    assert not ABS_PATH.search(text), text[:2000]
    return r


def call(stack: Stack, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    with stack.client(headers=headers) as c:
        return clean(stack, c.request(method, path, **kw))


def update(stack: Stack, version: str, verify: bool | None = None) -> httpx.Response:
    body: dict[str, Any] = {"version": version}
    if verify is not None:
        body["verify_checksum"] = verify
    assert call(stack, "POST", "/v1/pause").status_code == 200
    return call(stack, "POST", "/v1/update_weights", json=body)


def model_of(stack: Stack) -> str:
    return stack.model_dir.name


def state(stack: Stack, seed: int) -> dict[str, np.ndarray]:
    cfg = ModelConfig.from_hf(model_config(stack.model_dir))
    return names.to_training(sharding.init_weights(cfg, seed), cfg)


def publisher(stack: Stack) -> CheckpointPublisher:
    return CheckpointPublisher(stack.nats_url, ipc_dir=stack.env["IPC_DIR"])


def publish(stack: Stack, version: str, seed: int, ipc: bool) -> None:
    publisher(stack).publish(
        model_of(stack), version, state(stack, seed), tp=2, config=model_config(stack.model_dir),
        ipc=ipc,
    )


def ipc_dir_of(stack: Stack, version: str) -> Path:
    return ipc_version_dir(Path(stack.env["IPC_DIR"]), model_of(stack), version)


def flip_last_byte(blob: bytes) -> bytes:
    """Same size, valid header: one bit of the last tensor's data differs."""
    b = bytearray(blob)
    b[-3] ^= 0x01
    return bytes(b)


async def _raw(url: str, fn: Any) -> Any:
    nc = await nats.connect(url)
    try:
        return await fn(nc)
    finally:
        await nc.close()


def upload_raw(stack: Stack, version: str, blobs: list[bytes], man: mf.Manifest) -> None:
    """Objects straight into the bucket (no SDK checks): to plant bad versions."""

    async def go(nc: Any) -> None:
        await objstore.ensure_bucket(nc, BUCKET)
        for spec, blob in zip(man.shards, blobs, strict=True):
            name = ckpt_object_name(model_of(stack), version, spec.file.split("/")[-1])
            await objstore.put_object(nc, BUCKET, name, blob)
        name = ckpt_object_name(model_of(stack), version, "manifest.json")
        await objstore.put_object(nc, BUCKET, name, mf.encode(man))

    asyncio.run(_raw(stack.nats_url, go))


def prepare(stack: Stack, version: str, seed: int) -> tuple[list[bytes], mf.Manifest]:
    return publisher(stack).prepare(
        model_of(stack), version, state(stack, seed), 2, model_config(stack.model_dir)
    )


def error(r: httpx.Response, code: int) -> str:
    assert r.status_code == code, r.text
    body = r.json()
    assert body["error_code"] == code
    return str(body["error_message"])


# --------------------------------------------------------------------------- HTTP


def test_legacy_gets_need_the_admin_token(sec: Stack) -> None:
    for path in ("/clear_load_weight", "/update_model_weight"):
        with sec.client() as c:
            assert c.get(path).status_code == 401
            r = c.get(path, headers={"Authorization": f"Bearer {TOKEN}x"})
            assert r.status_code == 401 and r.json()["error_code"] == 401
    assert call(sec, "GET", "/v1/status").json()["state"] == "running"  # nothing changed
    assert call(sec, "GET", "/clear_load_weight").status_code == 200
    assert call(sec, "GET", "/v1/status").json()["state"] == "sleeping"
    assert call(sec, "GET", "/update_model_weight").status_code == 200
    assert call(sec, "GET", "/v1/status").json()["asleep"] == []


CROSS = [
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
    {"Origin": "http://evil.example"},
    {"Origin": "null"},
    # DNS rebinding: evil.example resolves to 127.0.0.1, so the page looks same-origin
    {"Host": "evil.example", "Origin": "http://evil.example", "Sec-Fetch-Site": "same-origin"},
]


@pytest.mark.parametrize("headers", CROSS, ids=lambda h: "-".join(h.values()))
def test_cross_site_browser_requests_cannot_change_state(
    sec: Stack, headers: dict[str, str]
) -> None:
    """Refused even with a valid token (so the guard, not auth, refuses), state unchanged."""
    for method, path in (
        ("POST", "/v1/pause"),
        ("POST", "/v1/sleep"),
        ("POST", "/v1/update_weights"),
        ("GET", "/clear_load_weight"),
        ("GET", "/update_model_weight"),
    ):
        r = call(sec, method, path, headers=headers)
        msg = error(r, 403)
        assert "cross-site" in msg and path in msg, msg
    st = call(sec, "GET", "/v1/status").json()
    assert st["state"] == "running" and not st["is_paused"] and st["asleep"] == []
    r = call(sec, "POST", "/v1/completions", headers=headers,
             json={"model": model_of(sec), "prompt": "x", "max_tokens": 1})
    assert r.status_code == 403 and r.json()["error"]["code"] == 403, r.text
    # reads stay readable (a cross-site page cannot read the answer anyway)
    assert call(sec, "GET", "/v1/status", headers=headers).status_code == 200


def test_same_origin_and_plain_clients_still_work(sec: Stack) -> None:
    origin = sec.base_url  # http://127.0.0.1:<port>: the server's own origin
    same = {"Origin": origin, "Sec-Fetch-Site": "same-origin"}
    assert call(sec, "POST", "/v1/pause", headers=same).status_code == 200
    assert call(sec, "POST", "/v1/resume").status_code == 200  # curl-like: no headers
    r = call(sec, "POST", "/v1/completions", json={"model": model_of(sec), "prompt": "x",
                                                    "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_models_and_status_show_no_path_and_no_credentials(sec: Stack) -> None:
    models = call(sec, "GET", "/v1/models").json()["data"][0]
    assert models["id"] == models["root"] == model_of(sec)
    st = call(sec, "GET", "/v1/status").json()
    u = urlsplit(sec.nats_url)
    assert u.username and u.password  # the stack really runs with credentials in its URL
    assert st["nats_url"] == f"nats://{u.hostname}:{u.port}"
    for path in ("/health", "/v1/is_paused", "/metrics"):
        call(sec, "GET", path)  # clean() checks every body


# --------------------------------------------------------------------------- integrity


def test_corrupt_bytes_in_a_valid_header_are_refused_by_default(sec: Stack) -> None:
    """ipc, object store and pre-sharded snapshot: 422 unless verify_checksum is false."""
    # ipc
    publish(sec, "cb-ipc", 51, ipc=True)
    f = ipc_dir_of(sec, "cb-ipc") / "rank0-of-2.safetensors"
    f.write_bytes(flip_last_byte(f.read_bytes()))
    # object store
    blobs, man = prepare(sec, "cb-obj", 52)
    upload_raw(sec, "cb-obj", [blobs[0], flip_last_byte(blobs[1])], man)
    # pre-sharded snapshot dir
    cfg = ModelConfig.from_hf(model_config(sec.model_dir))
    d = sec.model_dir / "versions" / "cb-snap"
    write_sharded_dir(d, cfg, sharding.init_weights(cfg, 53), 2, model_of(sec), "cb-snap")
    g = d / "rank1-of-2.safetensors"
    g.write_bytes(flip_last_byte(g.read_bytes()))

    for version, rank, file in (
        ("cb-ipc", 0, f"{model_of(sec)}/cb-ipc/rank0-of-2.safetensors"),
        ("cb-obj", 1, f"{model_of(sec)}/cb-obj/rank1-of-2.safetensors"),
        ("cb-snap", 1, "versions/cb-snap/rank1-of-2.safetensors"),
    ):
        msg = error(update(sec, version), 422)
        assert f"rank {rank}" in msg and file in msg and "SHA-256" in msg, msg
        assert call(sec, "GET", "/v1/status").json()["weight_version"] != version
        r = update(sec, version, verify=False)
        assert r.status_code == 200, r.text
        ranks = r.json()["result"]["ranks"]
        assert not any(x["verified"] for x in ranks), ranks
        assert call(sec, "GET", "/v1/status").json()["weight_version"] == version


def test_hf_snapshot_without_manifest_loads_unverified_unless_asked(sec: Stack) -> None:
    create_model_dir(sec.model_dir / "versions" / "hf1", model_config(sec.model_dir), seed=54)
    msg = error(update(sec, "hf1", verify=True), 400)
    assert "manifest" in msg
    r = update(sec, "hf1")
    assert r.status_code == 200, r.text
    assert r.json()["result"]["ranks"][0]["files"] == ["versions/hf1/model.safetensors"]


def test_forged_manifest_size_is_422_naming_rank_and_file(sec: Stack) -> None:
    giant = 50_000_000_000
    blobs, man = prepare(sec, "fs-obj", 55)
    man.shards[1].size = giant
    upload_raw(sec, "fs-obj", blobs, man)
    publish(sec, "fs-ipc", 56, ipc=True)
    m = ipc_dir_of(sec, "fs-ipc") / "manifest.json"
    bad = mf.decode(m.read_bytes())
    bad.shards[0].size = giant
    m.write_bytes(mf.encode(bad))
    for version, rank in (("fs-obj", 1), ("fs-ipc", 0)):
        for verify in (None, False):  # refused before reading, verification or not
            msg = error(update(sec, version, verify), 422)
            assert f"rank {rank}" in msg and f"{version}/rank{rank}-of-2.safetensors" in msg
            assert str(giant) in msg and "does not fit" in msg, msg
    rss = [r["rss_bytes"] for r in call(sec, "GET", "/v1/status").json()["ranks"]]
    assert max(rss) < 8 << 30, rss  # nothing near the claimed size was touched


def test_forged_safetensors_header_is_422(sec: Stack) -> None:
    """A header claiming a tensor far larger than the file: refused, not allocated."""
    publish(sec, "fh-ipc", 57, ipc=True)
    f = ipc_dir_of(sec, "fh-ipc") / "rank1-of-2.safetensors"
    blob = f.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + n].decode()
    # the first tensor's end offset becomes 99…9 (as many digits: the header keeps its size)
    forged = re.sub(
        r'"data_offsets":\[(\d+),(\d+)\]',
        lambda m: f'"data_offsets":[{m[1]},{"9" * len(m[2])}]',
        header,
        count=1,
    )
    assert forged != header and len(forged) == n
    f.write_bytes(blob[:8] + forged.encode() + blob[8 + n :])
    msg = error(update(sec, "fh-ipc", verify=False), 422)
    assert "rank 1" in msg and "rank1-of-2.safetensors" in msg and "safetensors" in msg, msg


def test_ipc_symlink_foreign_owner_and_escaping_path_are_refused(
    sec: Stack, tmp_path: Path
) -> None:
    publish(sec, "ln", 58, ipc=True)
    f = ipc_dir_of(sec, "ln") / "rank1-of-2.safetensors"
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(f.read_bytes())  # the same bytes: only the symlink is wrong
    f.unlink()
    f.symlink_to(copy)
    msg = error(update(sec, "ln"), 422)
    assert "rank 1" in msg and "ln/rank1-of-2.safetensors" in msg and "symlink" in msg, msg

    publish(sec, "dotdot", 59, ipc=True)
    d = ipc_dir_of(sec, "dotdot")
    bad = mf.decode((d / "manifest.json").read_bytes())
    bad.shards[0].file = "../ln/rank0-of-2.safetensors"
    (d / "manifest.json").write_bytes(mf.encode(bad))
    msg = error(update(sec, "dotdot"), 422)
    assert "../ln/rank0-of-2.safetensors" in msg and "plain file name" in msg, msg

    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    publish(sec, "owner", 60, ipc=True)
    os.chown(ipc_dir_of(sec, "owner") / "rank0-of-2.safetensors", NOBODY, NOBODY)
    msg = error(update(sec, "owner"), 422)
    assert "rank 0" in msg and "owner/rank0-of-2.safetensors" in msg, msg
    assert f"uid {NOBODY}" in msg, msg


def test_object_store_manifest_names_cannot_escape_the_version(sec: Stack) -> None:
    publish(sec, "os-ok", 61, ipc=False)  # a real version the forged one points into
    blobs, man = prepare(sec, "os-esc", 62)
    man.shards[0].file = "../os-ok/rank0-of-2.safetensors"
    upload_raw(sec, "os-esc", blobs, man)
    msg = error(update(sec, "os-esc"), 422)
    assert "plain file name" in msg and "rank 0" in msg, msg
