"""The served model's architecture, parsed from a HF ``config.json`` (no paddle, no numpy):
the one reader of ``config.json`` (:func:`read_hf_config`, :func:`load_config`) and of the
context length (:func:`max_model_len`).

Families: ``llama`` (GQA, untied), ``qwen2`` (q/k/v bias), ``qwen3`` (per-head q/k
RMSNorm, explicit ``head_dim``) and ``ernie4_5`` (dense, interleaved RoPE), with the
defaults transformers uses for a field the file leaves out. RoPE: both config layouts
are read — transformers < 5 writes a top-level ``rope_theta`` and an optional
``rope_scaling`` dict, transformers 5 writes one ``rope_parameters`` dict holding
``rope_theta`` too — with rope types ``default``, ``linear``, ``dynamic`` and ``llama3``.

Anything the model code cannot honour raises :class:`ConfigError` naming the field, so
a start stops with one line instead of serving wrong tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "ernie4_5")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "partial_rotary_factor",
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# transformers' per-family defaults for fields a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "head_dim": None, "num_key_value_heads": None},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "head_dim": None, "num_key_value_heads": 32},
    "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "head_dim": 128, "num_key_value_heads": 32},
    "ernie4_5": {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                 "tie_word_embeddings": True, "head_dim": 128, "num_key_value_heads": 2},
}  # fmt: skip


class ConfigError(ValueError):
    """The model config asks for something rollbus cannot serve exactly."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # q/k/v biases (qwen2; llama / qwen3 attention_bias; ernie)
    o_proj_bias: bool = False  # llama / qwen3 attention_bias: o_proj's bias too
    mlp_bias: bool = False  # gate/up/down biases (llama mlp_bias, ernie4_5 use_bias)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k, before RoPE
    rope_interleaved: bool = False  # ernie4_5: rotate pairs (2i, 2i+1), not halves
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position_embeddings: int = 0  # llama3; 0 = max_position_embeddings
    eos_token_ids: tuple[int, ...] = ()  # every eos id of config.json

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("hidden_size must be divisible by num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be divisible by num_key_value_heads")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type {self.rope_type!r} is not supported ({ROPE_TYPES})")
        if self.rope_type == "dynamic" and self.head_dim <= 2:
            raise ConfigError(f"dynamic RoPE needs head_dim > 2, got {self.head_dim}")
        if self.rope_type != "default" and self.rope_factor <= 0:
            raise ConfigError(f"rope factor must be > 0, got {self.rope_factor}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.eos_token_id is not None and self.eos_token_id not in self.eos_token_ids:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id, *self.eos_token_ids))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Parse a HF config dict; :class:`ConfigError` names the first field we can't honour."""
        model_type = config.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ConfigError(f"model_type={model_type!r} is not supported ({', '.join(FAMILIES)})")
        d = _DEFAULTS[model_type]
        # "swish" is transformers' other name of SiLU (ACT2FN["swish"] is nn.SiLU)
        _refuse(config, "hidden_act", lambda v: v not in (None, "silu", "swish"), "only silu")
        _refuse(config, "quantization_config", bool, "quantized checkpoints")
        _refuse(config, "partial_rotary_factor", lambda v: v not in (None, 1, 1.0), "partial RoPE")
        _refuse_sliding(config, model_type)
        # Linear biases as transformers builds them: llama / qwen3 attention_bias on q/k/v
        # and o_proj, llama mlp_bias on gate/up/down, ernie4_5 use_bias on all seven;
        # qwen2's q/k/v bias is always there. A field a family does not read is ignored,
        # as transformers does.
        ernie_bias = model_type == "ernie4_5" and bool(config.get("use_bias"))
        biased = ernie_bias or (
            model_type in ("llama", "qwen3") and bool(config.get("attention_bias"))
        )
        mlp_bias = ernie_bias or (model_type == "llama" and bool(config.get("mlp_bias")))
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ConfigError(f"config lacks {', '.join(missing)}")
        sizes: dict[str, Any] = {k: int(config[k]) for k in _REQUIRED}
        heads = sizes["num_attention_heads"]
        # absent: the family's default; null: hidden / heads (as transformers' configs)
        head_dim = (config["head_dim"] if "head_dim" in config else d["head_dim"]) or 0
        # kv heads likewise: absent = the family's default (Qwen2Config's / Qwen3Config's
        # 32, Ernie4_5Config's 2, llama's = heads), null = heads
        kv_key = "num_key_value_heads"
        kv = config[kv_key] if kv_key in config else d[kv_key]
        eos = _ids(config.get("eos_token_id"), "eos_token_id")
        bos = _ids(config.get("bos_token_id"), "bos_token_id")
        max_pos = int(config.get("max_position_embeddings") or d["max_position_embeddings"])
        rope = _rope(config, d["rope_theta"])
        tie = config.get("tie_word_embeddings")
        try:
            return cls(
                **sizes,
                num_key_value_heads=int(kv or heads),
                rms_norm_eps=float(_given(config, "rms_norm_eps", d["rms_norm_eps"])),
                max_position_embeddings=max_pos,
                attention_bias=model_type == "qwen2" or biased,
                o_proj_bias=biased,
                mlp_bias=mlp_bias,
                tie_word_embeddings=bool(d["tie_word_embeddings"] if tie is None else tie),
                bos_token_id=bos[0] if bos else None,
                eos_token_id=eos[0] if eos else None,
                eos_token_ids=tuple(eos),
                model_type=model_type,
                head_dim=int(head_dim),
                qk_norm=model_type == "qwen3",
                rope_interleaved=model_type == "ernie4_5",
                **rope,
            )
        except ConfigError as e:
            raise ConfigError(f"config.json: {e}") from None

    def validate_tp(self, tp: int) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if self.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by tp={tp}"
            )
        if self.intermediate_size < tp:  # split unevenly, but every rank holds a column
            raise ValueError(f"intermediate_size={self.intermediate_size} is less than tp={tp}")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:  # fewer kv heads than ranks: replicated, tp a multiple
            raise ValueError(
                f"num_key_value_heads={kv} is neither divisible by tp={tp} nor divides it"
            )

    @property
    def max_model_len(self) -> int:
        """Default context length: ``max_position_embeddings``, times the factor for
        ``linear`` / ``dynamic`` RoPE scaling (as vLLM derives it)."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.rope_factor)
        return self.max_position_embeddings


def _given(config: dict[str, Any], field: str, default: Any) -> Any:
    """The field's value, ``default`` only when absent or null (a 0 is a value)."""
    value = config.get(field)
    return default if value is None else value


def _refuse(config: dict[str, Any], field: str, bad: Any, what: str) -> None:
    value = config.get(field)
    if bad(value):
        raise ConfigError(f"config field {field}={value!r} is not supported ({what})")


def _refuse_sliding(config: dict[str, Any], model_type: str) -> None:
    """Sliding-window attention on any layer. As transformers decides it: ``layer_types``
    when the file has it (transformers 5 writes it), else — qwen2 / qwen3 configs of
    transformers 4 — layers from ``max_window_layers`` on slide when ``use_sliding_window``
    and ``sliding_window`` are set: ``use_sliding_window`` with no layer that far is
    full attention everywhere, served."""
    layers = config.get("layer_types")
    if layers is None and config.get("use_sliding_window"):
        what = "sliding-window attention"
        if model_type in ("qwen2", "qwen3"):
            first = config.get("max_window_layers", 28)  # Qwen2Config's / Qwen3Config's default
            n = config.get("num_hidden_layers")
            # an absent sliding_window is Qwen2Config's default 4096, an explicit null none
            if ("sliding_window" in config and config["sliding_window"] is None) or (
                isinstance(first, int) and isinstance(n, int) and first >= n
            ):
                return  # no layer slides: transformers attends fully
            what += f" on layers max_window_layers={first!r} .. num_hidden_layers={n!r}"
        raise ConfigError(f"config field use_sliding_window=True is not supported ({what})")
    for i, kind in enumerate(layers or []):
        if kind != "full_attention":
            raise ConfigError(
                f"config field layer_types[{i}]={kind!r} is not supported (full_attention)"
            )


def _ids(value: Any, field: str) -> list[int]:
    """A token id field: null, an int or a list of ints (several eos ids)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"config field {field}={value!r} must be an int or a list of ints")
    return list(dict.fromkeys(values))


def _rope(config: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """RoPE fields from either layout: ``rope_parameters`` (transformers 5) or a top-level
    ``rope_theta`` plus ``rope_scaling`` (earlier). A value in ``rope_parameters`` wins."""
    out: dict[str, Any] = {}
    theta = config.get("rope_theta")
    field, params = "rope_scaling", config.get("rope_scaling")
    if config.get("rope_parameters") is not None:
        field, params = "rope_parameters", config["rope_parameters"]
        if params and config.get("rope_scaling"):
            # both present: transformers 5 reads rope_parameters only; a differing
            # rope_scaling would be a second, contradicting answer
            given, scaling = _type_key(params), _type_key(config["rope_scaling"])
            extra = {k: v for k, v in scaling.items() if given.get(k) != v}
            if extra:
                raise ConfigError(f"config fields rope_scaling {extra} contradict rope_parameters")
    params = params or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config field {field}={params!r} must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"config field {field} per layer type is not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:  # named before its keys: longrope's are all unknown here
        key = "rope_type" if "rope_type" in params else "type"
        raise ConfigError(
            f"config field {field}.{key}={kind!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"config field {field}.{unknown[0]} is not supported")
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ConfigError(
            f"config field {field}.partial_rotary_factor="
            f"{params['partial_rotary_factor']!r} is not supported (partial RoPE)"
        )
    if params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    out["rope_theta"] = float(theta if theta is not None else default_theta)
    out["rope_type"] = kind
    if kind == "default":
        return out
    needed = ["factor"]
    if kind == "llama3":
        needed += ["low_freq_factor", "high_freq_factor"]
    for key in needed:
        if not isinstance(params.get(key), int | float) or isinstance(params.get(key), bool):
            raise ConfigError(f"config field {field}.{key} is missing or not a number")
    out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        if out["rope_high_freq_factor"] == out["rope_low_freq_factor"]:
            raise ConfigError(f"config field {field}: high_freq_factor == low_freq_factor")
        # a top-level original_max_position_embeddings wins over rope_parameters' own, as
        # transformers 5's standardize_rope_params has it (Phi-3's layout)
        out["rope_original_max_position_embeddings"] = int(
            config.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or config.get("max_position_embeddings")
            or 0
        )
    return out


def _type_key(params: dict[str, Any]) -> dict[str, Any]:
    return {("rope_type" if k == "type" else k): v for k, v in params.items()}


CONFIG_FILE = "config.json"


def read_hf_config(path: Path) -> dict[str, Any]:
    """The raw ``config.json`` of a model dir (or the file itself when ``path`` is one);
    :class:`ConfigError` when it is missing or not a JSON object (naming the file)."""
    p = Path(path)
    if p.is_dir() or not p.exists():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise ConfigError(f"no {CONFIG_FILE} in model dir {path}")
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"bad {p}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"bad {p}: not a JSON object")
    return raw


def load_config(model_dir: Path) -> ModelConfig:
    """The parsed ``config.json`` of a model dir (:class:`ConfigError` names what is wrong)."""
    return ModelConfig.from_hf(read_hf_config(model_dir))


def context_length(config: dict[str, Any], setting: int = 0) -> int:
    """The context length to serve: the setting when non-zero, else from the config."""
    if setting:
        return setting
    try:
        return ModelConfig.from_hf(config).max_model_len
    except (ConfigError, TypeError, ValueError):
        return int(config.get("max_position_embeddings", 2048))


def max_model_len(model_dir: Path, setting: int = 0) -> int:
    """``ROLLBUS_MAX_MODEL_LEN`` when set, else the model dir's context length: the one
    answer the engine's scheduler and the API's length checks share."""
    if setting:
        return setting
    return context_length(read_hf_config(model_dir))


def vocab_size(model_dir: Path) -> int:
    return int(read_hf_config(model_dir)["vocab_size"])


GENERATION_CONFIG_FILE = "generation_config.json"
# the sampling fields vLLM takes from generation_config.json as request defaults
# (``ModelConfig.get_diff_sampling_param``), with the neutral value a request gets when
# neither it nor the file sets one (OpenAI's / vLLM's)
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults of a model dir's ``generation_config.json``, as vLLM applies
    them (``--generation-config auto``): each field the file sets (not null) is the value
    of a request that does not set it; ``max_tokens`` is the file's ``max_new_tokens``.
    ``do_sample`` is not read (vLLM does not: ``do_sample: false`` with a temperature
    still samples at that temperature). None = the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def merge(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every sampling field of :data:`NEUTRAL_SAMPLING`: the request's value where
        ``given`` has one (not None; 0 is a value), else the file's, else the neutral one."""
        out: dict[str, Any] = {}
        for name, neutral in NEUTRAL_SAMPLING.items():
            value = given.get(name)
            if value is None:
                value = getattr(self, name)
            out[name] = neutral if value is None else value
        return out

    def items(self) -> dict[str, Any]:
        """The fields the file sets (for the log line at start)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# field -> (what a value must be, the check): a value out of range would make every
# request that takes the default fail, so the start refuses it instead (naming it)
_GEN_FIELDS: dict[str, tuple[str, Any]] = {
    "temperature": (">= 0", lambda v: _number(v) and v >= 0),
    "top_p": ("in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    "top_k": ("an integer, -1 or 0 (off) or >= 1", lambda v: _int(v) and v >= -1),
    "min_p": ("in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "repetition_penalty": ("> 0", lambda v: _number(v) and v > 0),
    "max_new_tokens": ("an integer >= 1", lambda v: _int(v) and v >= 1),
}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def generation_defaults(model_dir: Path) -> GenerationDefaults:
    """The sampling defaults of ``model_dir``'s ``generation_config.json`` (none without
    the file). :class:`ConfigError` names a field out of range, or an unreadable file."""
    p = Path(model_dir) / GENERATION_CONFIG_FILE
    if not p.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"bad {p}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"bad {p}: not a JSON object")
    out: dict[str, Any] = {}
    for name, (what, ok) in _GEN_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue  # absent or null: not a default (as vLLM)
        if not ok(value):
            raise ConfigError(
                f"{GENERATION_CONFIG_FILE}: {name}={value!r} must be {what} "
                "(ROLLBUS_GENERATION_CONFIG=none ignores the file)"
            )
        out["max_tokens" if name == "max_new_tokens" else name] = value
    for name in ("top_k", "max_tokens"):  # -1: off, as 0; past int32: as large as any
        if name in out:
            out[name] = min(max(0, out[name]), 2**31 - 1)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if name in out:
            out[name] = float(out[name])
    return GenerationDefaults(**out)


def model_vocab_size(model_dir: Path, fallback: int) -> int:
    """The model's token ids (config.json's ``vocab_size``: its embedding rows), or
    ``fallback`` for a dir without a usable config (the default tiny model's tokenizer)."""
    try:
        return int(read_hf_config(model_dir)["vocab_size"])
    except (ConfigError, KeyError, TypeError, ValueError):
        return fallback
