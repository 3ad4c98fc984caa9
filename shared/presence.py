"""Whether a version's files are all there yet: the "not yet present" rule. Pure (files).

A version's files can be announced before they are complete: a snapshot dir copied
after the event (``cp -r``, ``rsync``), an event published by hand. Such a version is
*not present yet* (404, retried by auto-update, which does not even pause for it) —
never *broken* (422, refused for good). The rule that separates them, for a snapshot
dir ``<model>/versions/V/``:

* not present yet: the dir holds no weight file at all; or its ``manifest.json`` or
  ``model.safetensors.index.json`` is a JSON document cut short (empty — ``cp`` creates
  it, then writes it —, or its parse fails at its very end); or a file its
  ``manifest.json`` or ``model.safetensors.index.json`` names, or an HF shard's
  ``-0000k-of-0000n`` siblings need, does not exist; or a
  weight file is **shorter** than what describes it — the manifest's ``size``, or its
  own safetensors header (fewer than 8 bytes, a header length past the end of the file,
  a tensor's byte range past the end of the file). A copy only ever appends, so each of
  these is what a copy in progress looks like.
* broken (the load decides, 422): everything else — a manifest or index that does not
  parse before its end (garbage, trailing bytes) or does not validate, a file
  **longer** than stated, a header that is not valid JSON, a SHA-256, shape or name
  mismatch. A file truncated for good therefore waits
  (404 naming the file and its size) instead of being refused: it cannot be told from
  one still being written.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import msgspec

from shared import manifest as mf
from shared import safetensors as st
from shared.errors import ControlError
from shared.subjects import rank_shard_file

MANIFEST = "manifest.json"


def short_file(path: Path, name: str, want: int | None = None) -> str | None:
    """Why the weight file ``path`` is not fully written yet, or None: missing, shorter
    than ``want`` (a manifest's size) or than its own safetensors header says. A file
    that is long enough but malformed is None here: its load says what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return f"{name} is not there yet"
    except OSError:
        return None  # unreadable for another reason: the load names it (422)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            return None  # a FIFO, a directory, a device: never filled by a copy; broken
        size = fst.st_size
        if want is not None:
            return f"{name} has {size} of {want} bytes" if size < want else None
        need = st.min_size(fd, size)
        if need is None or size >= need[0]:
            return None  # all there (or never a safetensors file: broken)
        n, whole = need
        if n == 8:
            return f"{name} has {size} bytes"
        if whole:
            return f"{name} has {size} of {n} bytes"
        return f"{name} has {size} bytes, its header alone {n}"
    except OSError:
        return None
    finally:
        os.close(fd)


def cut_json(data: bytes) -> bool:
    """Whether ``data`` is a JSON document cut short: empty, or its parse runs out of
    input (``{``, ``{"a": 1``, ``{"na``) — a prefix of a document, what a JSON file
    still being copied looks like (``cp`` creates it empty, then writes it). Garbage
    (an invalid byte before the end), trailing bytes, a document that parses: not cut."""
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        return str(e).startswith("Input data was truncated")
    return False


def _read_json(path: Path, limit: int) -> bytes | None:
    """The bytes of a small JSON file, or None (unreadable, larger than ``limit``)."""
    try:  # never waited on: a FIFO of that name is not read (st.open_regular)
        fd = st.open_regular(path, path.name)
    except (OSError, ValueError):
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if os.fstat(fd).st_size > limit:
                return None
            return f.read(limit)
        except OSError:
            return None


def _manifest(data: bytes | None) -> mf.Manifest | None:
    if data is None:
        return None
    try:
        return mf.decode(data, MANIFEST)
    except ControlError:
        return None  # broken: the load decides


# an HF sharded checkpoint's file names: model-00001-of-00003.safetensors
NUMBERED = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.safetensors")


def numbered_missing(files: list[Path]) -> str | None:
    """A file of an HF sharded checkpoint (``<p>-0000k-of-0000n.safetensors``) that
    its siblings' names say must exist and does not: a dir without its index yet
    (``cp`` copies in directory order) is then a copy in progress, not a checkpoint
    that lacks tensors."""
    seen = set()
    for f in files:
        if (m := NUMBERED.fullmatch(f.name)) is None or (m.group(1), m.group(3)) in seen:
            continue
        seen.add((m.group(1), m.group(3)))
        prefix, total = m.group(1), int(m.group(3))
        for k in range(1, total + 1):
            name = f"{prefix}-{k:05d}-of-{total:05d}.safetensors"
            if not (f.parent / name).exists():
                return f"{name} is not there yet"
    return None


def sharded(d: Path, tp: int) -> bool:
    """A pre-sharded dir (``manifest.json`` or any ``rank<r>-of-<tp>.safetensors``), as
    opposed to an HF checkpoint dir."""
    return (d / MANIFEST).is_file() or any((d / rank_shard_file(r, tp)).exists() for r in range(tp))


def snapshot_pending(d: Path, tp: int, ranks: Iterable[int]) -> str | None:
    """Why the snapshot version dir ``d`` is not complete yet for ``ranks`` (a rank:
    its own shard; the engine: every rank), or None (complete — or broken, which the
    load reports). See the module doc for the rule."""
    ranks = list(ranks)
    if (d / MANIFEST).is_file():
        data = _read_json(d / MANIFEST, mf.MAX_MANIFEST_BYTES)
        if data is not None and cut_json(data):
            return f"{MANIFEST} has {len(data)} bytes, not a whole JSON document yet"
        man = _manifest(data)
        if man is None:
            return None
        for r in ranks:
            try:
                spec = mf.validate(man, r, tp, None, d.name)
            except ControlError:
                return None  # a manifest that cannot be right: broken
            if why := short_file(d / spec.file, spec.file, spec.size):
                return why
        return None
    if sharded(d, tp):
        for r in ranks:
            name = rank_shard_file(r, tp)
            if why := short_file(d / name, name):
                return why
        return None
    index = _read_json(d / st.INDEX_FILE, st.MAX_INDEX_BYTES)
    if index is not None and cut_json(index):
        return f"{st.INDEX_FILE} has {len(index)} bytes, not a whole JSON document yet"
    try:
        files = st.checkpoint_files(d)
    except (OSError, ValueError):
        return None  # a bad index: broken
    if not files:
        return "no weight file (manifest.json, *.safetensors) yet"
    if why := numbered_missing(files):
        return why
    for f in files:
        if why := short_file(f, f.name):
            return why
    return None
