"""All rollbus settings: one pydantic-settings class, environment prefix ``ROLLBUS_``.

Every process (launcher, engine, worker ranks, api) builds the same ``Settings`` from
its environment; the launcher passes its own (possibly CLI-overridden) values down to
its children as ``ROLLBUS_*`` variables, so every process sees one configuration.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.messages import MAX_STEP_ITERS
from shared.versions import check_model_name

LoadStrategy = Literal["object_store", "snapshot", "ipc"]


# FastDeploy's names for the same strategies.
LOAD_STRATEGY_ALIASES = {"rsync": "object_store", "ipc_snapshot": "snapshot"}


def check_nats_urls(v: str) -> str:
    """``v`` (a comma-separated list of NATS server URLs) if every URL parses, its port
    too; else ValueError. An unreadable one was a ValueError traceback deep in the
    credentials code. The message never quotes the URL: it may carry a password."""
    for i, part in enumerate((p.strip() for p in v.split(",") if p.strip()), 1):
        try:
            urlsplit(part if "://" in part else f"nats://{part}").port  # noqa: B018
        except ValueError as e:
            # urlsplit quotes what it read as the port: with an unencoded '/' or '#' in
            # the password, that is the password's start
            why = re.split("['\"]", str(e))[0].strip().removesuffix(" as")
            raise ValueError(f"server {i} of the list is not a URL ({why})") from None
    return v


def nats_url_arg(v: str) -> str:
    """``--nats-url``'s argparse ``type``: a bad URL is argparse's one-line usage error
    (exit 2) naming the option, never quoting the value (argparse quotes the value of a
    plain ValueError)."""
    try:
        return check_nats_urls(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Settings(BaseSettings):
    # allow_inf_nan=False: `inf` passes gt=0 and would reach int() / asyncio timeouts
    model_config = SettingsConfigDict(env_prefix="ROLLBUS_", extra="ignore", allow_inf_nan=False)

    # bus
    nats_url: str = Field("", description="NATS server URL(s); empty = start an embedded server")
    nats_port: int = Field(4222, ge=0, le=65535, description="port of the embedded nats-server")
    instance: str = Field("default", min_length=1, description="namespace of the subjects")
    data_dir: Path = Field(Path(".data"), description="embedded NATS store, default model")
    nats_creds_dir: str = Field(
        "", description="NATS credentials, one file per role; empty = DATA_DIR/creds"
    )
    nats_replicas: int = Field(
        0, ge=0, le=5, description="replicas of streams and buckets; 0 = 3 on a cluster of 3+"
    )
    nats_tls_cert: str = Field("", description="embedded nats-server's TLS certificate (PEM)")
    nats_tls_key: str = Field(
        "", validate_default=True, description="embedded nats-server's TLS private key (PEM)"
    )
    nats_tls_ca: str = Field("", description="CA that clients verify the NATS server with")
    nats_tls_client_cert: str = Field("", description="client certificate for NATS (mTLS)")
    nats_tls_client_key: str = Field("", description="client private key for NATS (mTLS)")

    # api
    api_host: str = "127.0.0.1"
    # 0 (a random port) is refused: the launcher probes this port for readiness
    api_port: int = Field(8000, ge=1, le=65535)
    admin_token: str = Field("", description="bearer token for control routes (empty = open)")
    api_key: str = Field("", description="bearer token for generation routes (empty = open)")
    allowed_origins: str = Field(
        "", description="browser origins allowed to change state (comma-separated)"
    )

    # model
    model: str = Field("", description="model dir; empty = tiny model under data_dir")
    model_name: str = Field("", description="served model id; empty = the model dir's name")
    tp: int = Field(2, ge=1, le=64, description="tensor-parallel worker ranks")
    # numpy's generator (the default model's weights) takes no negative seed
    seed: int = Field(0, ge=0, description="seed of the default model's weights")
    kv_cache_blocks: int = Field(256, ge=1, description="KV blocks per rank")
    kv_block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    max_model_len: int = Field(0, ge=0, description="context length; 0 = from the model config")
    max_batch_size: int = Field(64, ge=1, description="sequences per engine step")
    max_step_tokens: int = Field(2048, ge=1, description="tokens per engine step (prefill chunks)")
    admit_wait_ms: float = Field(
        100.0,
        ge=0,
        le=10_000,
        description="an idle engine waits up to this long for requests arriving together "
        "(README 'Admission'); 0 = start at once",
    )
    admit_quiet_ms: float = Field(
        3.0,
        ge=0,
        le=10_000,
        description="an idle engine starts its first step once no request has come for "
        "this long and no API holds more (README 'Admission'); 0 = as soon as none holds more",
    )
    step_pipeline: bool = Field(
        True,
        description="send the next decode step before the last one's reply (README "
        "'Pipelined steps'); false = one step at a time",
    )
    decode_steps: int = Field(
        4,
        ge=1,
        le=MAX_STEP_ITERS,
        description="decode iterations one step message may ask the ranks for (README "
        "'Multi-step decode'); 1 = one token per step message",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="auto: the model dir's generation_config.json sampling fields are the "
        "defaults of requests that do not set them (as vLLM); none: OpenAI's defaults",
    )
    device: Literal["cpu", "gpu"] = Field(
        "cpu", description="where ranks compute: cpu (gloo) or gpu (rank r on gpu:r, NCCL)"
    )
    dtype: Literal["float32", "auto"] = Field(
        "auto", description="compute dtype; auto = the checkpoint's on GPU, float32 on CPU"
    )
    tp_allreduce: Literal["shm", "gloo"] = Field(
        "shm",
        description="CPU TP all-reduce: shm (shared memory; ranks on this host) or gloo",
    )

    # limits and backpressure (README "Limits")
    max_n: int = Field(64, ge=1, le=4096, description="largest `n` (choices) of one request")
    max_waiting: int = Field(
        1024, ge=1, description="requests queued in the engine before new ones get 429"
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest HTTP request body (else 400)"
    )
    body_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="a request body that sends nothing this long: 400"
    )
    stream_buffer: int = Field(
        256, ge=16, description="unread chunks per choice the API keeps before dropping a stream"
    )

    # weights / control
    load_strategy: LoadStrategy = "snapshot"
    dynamic_load_weight: bool = True
    use_cudagraph: bool = False
    shutdown_comm_group_if_worker_idle: bool = False
    control_timeout_s: float = Field(60.0, gt=0, description="timeout of every control call")
    stall_s: float = Field(
        30.0, gt=0, description="no step progress (or a rank stuck in a step) this long: 503"
    )
    rank_refresh_s: float = Field(
        0.25, ge=0.05, le=60, description="the engine asks every rank's status this often"
    )
    auto_update: bool = False
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="versions behind the newest announced before new requests wait; "
        "empty = no bound, 0 = strictly on-policy",
    )
    auto_update_pause_mode: Literal["abort", "wait", "keep"] = "keep"
    auto_update_verify_checksum: bool = Field(
        True, description="auto-update verifies SHA-256 against the version's manifest"
    )
    # NATS's object-store bucket rule: the name is part of a stream name and of subjects
    ckpt_bucket: str = Field(
        "rollbus_ckpt",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="object-store bucket of checkpoints (letters, digits, _ and -)",
    )
    ipc_dir: Path = Field(
        Path("/dev/shm/rollbus"), description="shared-memory root of the ipc load strategy"
    )
    ipc_trainer_uid: int = Field(
        -1, ge=-1, description="uid (besides the service's) whose ipc files are trusted"
    )

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # launcher restart policy (after the stack was ready once)
    restart_limit: int = Field(
        5, ge=0, description="restarts of one process per window before the stack stops"
    )
    restart_window_s: float = Field(60.0, gt=0, description="window of restart_limit")

    # test-only (tests/faults): a rank waits this long before it runs a stage / commit it
    # received, so a fault test can signal it inside that window. Never set in production.
    test_stage_delay_s: float = Field(0.0, ge=0, le=600, description="test only")
    test_commit_delay_s: float = Field(0.0, ge=0, le=600, description="test only")
    # test-only (tests/fleet): a fleet coordinator waits this long between "all staged"
    # and writing the commit decision, so a test can kill it there.
    test_fleet_commit_delay_s: float = Field(0.0, ge=0, le=600, description="test only")

    @field_validator("load_strategy", mode="before")
    @classmethod
    def _alias_strategy(cls, v: object) -> object:
        if isinstance(v, str):
            return LOAD_STRATEGY_ALIASES.get(v.strip().lower(), v.strip().lower())
        return v

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _no_bound(cls, v: object) -> object:
        # unset, empty or "none": no staleness bound (what to_env writes for None)
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
            return None
        return v

    @field_validator("instance")
    @classmethod
    def _instance_token(cls, v: str) -> str:
        # rollbus.ckpt.* belongs to checkpoint events
        if v == "ckpt":
            raise ValueError("'ckpt' is reserved (rollbus.ckpt.* carries checkpoint events)")
        return v

    @field_validator("api_host")
    @classmethod
    def _api_host(cls, v: str) -> str:
        # an empty host binds every interface: secure by default means saying so explicitly
        if not v.strip():
            raise ValueError("empty: say 0.0.0.0 (or ::) to listen on every interface")
        return v.strip()

    @field_validator("model_name")
    @classmethod
    def _model_id(cls, v: str) -> str:
        # empty = the model dir's name; else the trainer's rule (shared/versions.py)
        return check_model_name(v) if v else v

    @field_validator("nats_url")
    @classmethod
    def _nats_urls(cls, v: str) -> str:
        return check_nats_urls(v)

    @field_validator("nats_tls_key")
    @classmethod
    def _tls_pair(cls, v: str, info: ValidationInfo) -> str:
        if bool(v.strip()) != bool(str(info.data.get("nats_tls_cert", "")).strip()):
            raise ValueError("ROLLBUS_NATS_TLS_CERT and ROLLBUS_NATS_TLS_KEY go together")
        return v

    @property
    def allowed_origin_list(self) -> list[str]:
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def embedded_nats(self) -> bool:
        return not self.nats_url.strip()

    @property
    def creds_dir(self) -> Path:
        return Path(self.nats_creds_dir) if self.nats_creds_dir.strip() else self.data_dir / "creds"

    @property
    def model_dir(self) -> Path:
        return Path(self.model) if self.model else self.data_dir / "models" / "tiny"

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_dir.resolve().name

    def to_env(self) -> dict[str, str]:
        """Settings as ``ROLLBUS_*`` variables, to hand to child processes."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif value is None:
                value = ""  # an optional setting left unset (read back as None)
            env[f"ROLLBUS_{name.upper()}"] = str(value)
        return env


# settings whose value may hold a secret (a URL's password, a token): never echoed
SECRET_SETTINGS = frozenset({"nats_url", "admin_token", "api_key"})


def describe_error(err: ValidationError) -> str:
    """One line naming each bad setting, for a clean exit instead of a traceback."""
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "settings"
        shown = "" if field in SECRET_SETTINGS else f"={e.get('input')!r}"
        parts.append(f"ROLLBUS_{field.upper()}{shown}: {e['msg']}")
    return "bad setting: " + "; ".join(parts)


def settings_or_exit(prog: str) -> Settings:
    """Settings for a process entry point: a bad value is one line on stderr, exit 2."""
    import sys

    try:
        return Settings()
    except ValidationError as e:
        print(f"{prog}: {describe_error(e)}", file=sys.stderr)
        raise SystemExit(2) from None
