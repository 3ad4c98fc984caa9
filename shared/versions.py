"""Version names and where a model dir keeps its versions. Pure (files only, no bus).

A version is an opaque label (its order is publish order, see DESIGN.md). It becomes a
path component (``<model>/versions/<V>/``, ``<ipc_dir>/<model>/<V>/``) and an object-name
component, so it must be non-empty, at most :data:`MAX_VERSION_LEN` characters, contain
no ``/`` and no control character (NUL, newline, ...) and not be ``.`` or ``..``. The
model dir itself holds the version named in its ``version.txt`` (``v0`` without one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import quote

from shared.errors import BAD_REQUEST, NOT_FOUND, ControlError
from shared.messages import MAX_VERSION_LEN

VERSION_FILE = "version.txt"
DEFAULT_VERSION = "v0"  # of a model dir without version.txt


class BadVersionName(ControlError, ValueError):
    """A version name that cannot be a path component (400)."""

    def __init__(self, version: str) -> None:
        super().__init__(
            BAD_REQUEST,
            f"bad version name {version!r} (non-empty, no '/' or control character, "
            "not '.' or '..', "
            f"at most {MAX_VERSION_LEN} characters)",
        )


def check_version_name(version: str) -> str:
    """``version`` when it is a valid name, else :class:`BadVersionName`."""
    if (
        not isinstance(version, str)
        or not version
        or len(version) > MAX_VERSION_LEN
        or "/" in version
        or version in (".", "..")
        or any(ord(c) < 32 or ord(c) == 127 for c in version)
    ):
        raise BadVersionName(str(version))
    return version


class BadModelName(ValueError):
    """A model id that cannot be a subject token and a path component."""


def check_model_name(model: str) -> str:
    """``model`` when it can be a subject token and the ``<model>`` path component of
    :func:`ipc_version_dir` (percent-quoting leaves ``.`` and ``..`` as they are), else
    :class:`BadModelName`."""
    if (
        not isinstance(model, str)
        or not model
        or model in (".", "..")
        or any(ord(c) < 32 or ord(c) == 127 for c in model)
    ):
        raise BadModelName(
            f"bad model name {model!r} (non-empty, no control character, not '.' or '..')"
        )
    return model


def check_version_arg(version: str) -> str:
    """:func:`check_version_name` for a control argument: the 400 names ``version``."""
    try:
        return check_version_name(version)
    except BadVersionName as e:
        raise ControlError(e.code, e.message, {"param": "version"}) from None


def read_version_txt(model_dir: Path) -> str | None:
    """The version named in ``<model_dir>/version.txt``, or None (no file, or empty)."""
    p = Path(model_dir) / VERSION_FILE
    if p.is_file():
        return p.read_text().strip() or None
    return None


def model_dir_version(model_dir: Path) -> str:
    """The version the model dir itself holds: its ``version.txt``, else ``v0``."""
    return read_version_txt(model_dir) or DEFAULT_VERSION


def snapshot_dir(model_dir: Path, version: str) -> Path:
    """Where version ``version`` of the ``snapshot`` strategy lives, or a 404 naming what
    was looked for: the model dir itself, else ``<model_dir>/versions/<version>/``."""
    model_dir = Path(model_dir)
    if version == model_dir_version(model_dir):
        return model_dir
    check_version_name(version)
    d = model_dir / "versions" / version
    if not d.is_dir():
        raise ControlError(
            NOT_FOUND, f"unknown version {version!r}: no directory versions/{version}"
        )
    return d


# a path component's budget: NAME_MAX is 255 bytes, and the SDK writes a version under
# a temporary name of its own first (``.<component>.<random>.tmp``)
IPC_NAME_MAX = 200
_IPC_KEEP = 160  # of a longer component, before ``~`` and its hash


def ipc_component(name: str) -> str:
    """``name`` as one path component: percent-quoted (ids may hold ``/``), and, when
    that is longer than :data:`IPC_NAME_MAX` (a valid 256-character version, or 60
    non-ASCII characters, quoted three bytes to one), its first characters plus
    ``~`` and a SHA-256 of the whole name — else the OS refuses it (``File name too
    long``) and a version valid everywhere else cannot go through ``ipc``."""
    # ``~`` quoted too (quote() keeps it): only a cut name holds one, so no short name
    # can spell a long one's cut form and share its directory
    q = quote(name, safe="").replace("~", "%7E")
    if len(q) <= IPC_NAME_MAX:
        return q
    return f"{q[:_IPC_KEEP]}~{hashlib.sha256(name.encode()).hexdigest()[:32]}"


def ipc_version_dir(ipc_dir: Path, model: str, version: str) -> Path:
    """``<ipc_dir>/<model>/<version>/``, each part as :func:`ipc_component` names it."""
    return Path(ipc_dir) / ipc_component(model) / ipc_component(version)
