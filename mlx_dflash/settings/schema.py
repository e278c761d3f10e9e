"""The settings' values: what each key is, its type, how a typed value is read,
and the checks that need no model files (check_model, check_global). The file
itself is settings.py (SettingsStore); checks against model files are the model
manager's (settings_checks.check_settings, passed to the store as its checker)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Optional

from ..engine.sampling_params import SamplingParams
from ..policy.modes import VERIFY_MODES  # the names only: settings import no mlx

QUANT_BITS = ("auto", None, 4, 8)  # auto: 4-bit on Metal, full precision on mlx-cpu (drafter_precision)
GROUP_SIZES = (32, 64, 128)
ACTIVATION_DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: $MLX_DFLASH_DTYPE if set, else the fastest measured here (dtype_choice); checkpoint: as stored
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16", "checkpoint")


class SettingsError(ValueError):
    """A bad setting, an unreadable settings file or an unknown model (one line)."""


def did_you_mean(word: str, choices, cutoff: float = 0.6) -> str:
    """" (did you mean 'port'?)" for a near miss, else ""."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f" (did you mean '{near[0]}'?)" if near else ""


def verify_modes() -> tuple:
    """Valid verify modes (policy/modes.py; registry.py runs each)."""
    return tuple(VERIFY_MODES)


@dataclass
class ModelSettings:
    dflash_enabled: bool = True
    drafter: Optional[str] = None  # path or model id; None: the best compatible one found
    # the guard (on): it chooses each cycle's verify width, from plain decoding up to the
    # drafter's trained block size; off: every cycle verifies exactly block_size rows
    guard: bool = True
    block_size: int = 5
    verify_mode: str = "dflash"
    drafter_quant_bits: Optional[object] = "auto"  # "auto" | None (full precision) | 4 | 8
    drafter_quant_group_size: int = 64
    drafter_activation_dtype: str = "auto"  # auto = the target's dtype
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    system_prompt: str = ""
    # the context a model is planned for (its memory estimate, `models list`); DFlash
    # has no length fallback: the guard prices a cycle at the context's length
    max_context: int = 4096
    dtype: str = "auto"  # the target's compute dtype: auto = the fastest here (float32 on mlx-cpu for bf16)
    # long context (LONG_CONTEXT_KEYS below): the drafter's context window and sink, the target's KV quantization
    drafter_window: Optional[int] = 1024  # None: the drafter attends to every context row
    drafter_sink: int = 64
    kv_bits: Optional[int] = None  # None | 4 | 8 (mlx-lm's kv_bits)
    kv_group_size: int = 64
    quantized_kv_start: int = 5000  # mlx-lm's default: rows before the cache is quantized
    # server: a tool call the model opens is decoded under a grammar (offered names, JSON arguments);
    # off: calls stay as the model writes them (one that does not parse comes back as text)
    tool_grammar: bool = True

    def generation_kwargs(self) -> dict:
        """Keyword arguments for `stream_generate`."""
        mode = self.verify_mode if self.dflash_enabled else "off"
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, block_size=self.block_size, guard=self.guard,
                    verify_mode=mode, **{f: getattr(self, f) for f in LONG_CONTEXT_KEYS.values()})


@dataclass
class GlobalSettings:
    model_dirs: list = field(default_factory=list)
    default_model: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    cors_origins: list = field(default_factory=list)
    prompt_cache_mb: int = 2048  # server: memory for cached prompt prefixes across requests (0: none)
    # cached prompt prefixes on disk (serve, chat, generate; survive restarts), LRU (0: memory only)
    prompt_cache_disk_gb: float = 10.0
    # server: weights, cached prompts in memory and running requests' KV stay under it (none: 75% of the memory)
    memory_budget_gb: Optional[float] = None
    max_batch: object = "auto"  # server: requests decoded together (mlx_dflash.engine.batch), 1..64 (1: one at a
    # time), or "auto": measured once per model and machine (batch_costs.auto_max_batch)

    def prompt_store_bytes(self) -> tuple:
        """(memory, disk) budgets of the prompt store in bytes."""
        return self.prompt_cache_mb << 20, int(self.prompt_cache_disk_gb * 1e9)


# user-facing key (file, CLI) -> dataclass field
MODEL_KEYS = {
    "dflash.enabled": "dflash_enabled",
    "drafter": "drafter",
    "guard": "guard",
    "block_size": "block_size",
    "verify_mode": "verify_mode",
    "drafter.quant_bits": "drafter_quant_bits",
    "drafter.quant_group_size": "drafter_quant_group_size",
    "drafter.activation_dtype": "drafter_activation_dtype",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "max_tokens",
    "system_prompt": "system_prompt",
    "max_context": "max_context",
    "dtype": "dtype",
    "tool_grammar": "tool_grammar",
}

# -- long context (issue 23): the drafter's bounded context and the target's KV quantization
LONG_CONTEXT_KEYS = {
    "drafter.window": "drafter_window",
    "drafter.sink": "drafter_sink",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "quantized_kv_start": "quantized_kv_start",
}
MODEL_KEYS.update(LONG_CONTEXT_KEYS)


# The fields a model's settings and a request's decode config (engine/decode_config.py) share:
# one check each, so a setting never holds a value generation refuses, nor the reverse.
KV_BITS = (None, 2, 3, 4, 5, 6, 8)  # mx.quantize's widths (mlx-lm's kv_bits)
DECODE_CHECKS = {
    "max_tokens": (lambda v: v >= 1, "must be >= 1"),
    "block_size": (lambda v: v is None or v >= 1, "must be >= 1"),
    "drafter_window": (lambda v: v is None or v >= 1, "must be >= 1 (or none: unbounded)"),
    "drafter_sink": (lambda v: v >= 0, "must be >= 0"),
    "kv_bits": (lambda v: v in KV_BITS, "must be none or one of 2, 3, 4, 5, 6, 8"),
    "kv_group_size": (lambda v: v in GROUP_SIZES, "must be 32, 64 or 128"),
    "quantized_kv_start": (lambda v: v >= 0, "must be >= 0"),
}


def check_decode_fields(values, label=lambda name: name) -> None:
    """ValueError (one line, the field named by `label`) for the first shared
    field of `values` (an object with those attributes) that fails its check."""
    for name, (ok, what) in DECODE_CHECKS.items():
        v = getattr(values, name)
        if not ok(v):
            raise ValueError(f"{label(name)} {what}, got {v}")


GLOBAL_KEYS = {f.name: f.name for f in fields(GlobalSettings)}
FIELD_TO_KEY = {v: k for k, v in MODEL_KEYS.items()}
_TYPES = {  # field -> (type, optional)
    "dflash_enabled": (bool, False), "drafter": (str, True), "block_size": (int, False), "guard": (bool, False),
    "verify_mode": (str, False), "drafter_quant_bits": (int, True), "drafter_quant_group_size": (int, False),
    "drafter_activation_dtype": (str, False), "temperature": (float, False), "top_p": (float, False),
    "top_k": (int, False), "min_p": (float, False), "max_tokens": (int, False), "system_prompt": (str, False),
    "max_context": (int, False), "dtype": (str, False), "tool_grammar": (bool, False),
    "model_dirs": (list, False), "default_model": (str, True), "host": (str, False), "port": (int, False),
    "api_key": (str, True), "cors_origins": (list, False), "prompt_cache_mb": (int, False),
    "prompt_cache_disk_gb": (float, False), "memory_budget_gb": (float, True),
    "max_batch": (int, False),
}
AUTO_FIELDS = ("drafter_quant_bits", "max_batch")  # integer fields that also take "auto"
_TYPES.update({"drafter_window": (int, True), "drafter_sink": (int, False), "kv_bits": (int, True),
               "kv_group_size": (int, False), "quantized_kv_start": (int, False)})


def model_field(key: str) -> str:
    """A model key as the user writes it ("dflash.enabled") or a field name -> the field."""
    if key in MODEL_KEYS:
        return MODEL_KEYS[key]
    if key in FIELD_TO_KEY:
        return key
    raise SettingsError(f"unknown model setting '{key}'{did_you_mean(key, MODEL_KEYS)}; "
                        f"valid: {', '.join(MODEL_KEYS)}")


def global_field(key: str) -> str:
    if key in GLOBAL_KEYS:
        return key
    raise SettingsError(f"unknown global setting '{key}'{did_you_mean(key, GLOBAL_KEYS)}; "
                        f"valid: {', '.join(GLOBAL_KEYS)}")


def parse_value(name: str, text: str):
    """A value typed on the command line -> the field's type ("none" clears an optional)."""
    typ, optional = _TYPES[name]
    t = text.strip()
    if optional and t.lower() in ("none", "null", ""):
        return None
    if name in AUTO_FIELDS and t.lower() == "auto":
        return "auto"
    try:
        if typ is bool:
            v = {"true": True, "on": True, "yes": True, "1": True,
                 "false": False, "off": False, "no": False, "0": False}[t.lower()]
            return v
        if typ is int:
            return int(t)
        if typ is float:
            v = float(t)
            if not math.isfinite(v):
                raise ValueError
            return v
        if typ is list:
            return [s.strip() for s in t.split(",") if s.strip()]
    except (KeyError, ValueError):
        want = {bool: "true or false", int: "an integer", float: "a finite number"}[typ]
        if name == "max_batch":
            want = "auto or an integer"
        raise SettingsError(f"{FIELD_TO_KEY.get(name, name)} must be {want}, got '{text}'") from None
    return text


def check_type(name: str, v):
    """Coerce JSON/Python values to the field's type; one-line error if impossible."""
    typ, optional = _TYPES[name]
    key = FIELD_TO_KEY.get(name, name)
    if v is None:
        if optional:
            return None
        raise SettingsError(f"{key} cannot be empty")
    if name in AUTO_FIELDS and isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    if typ is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)  # an int too large for a float overflows
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise SettingsError(f"{key} must be a finite number, got {str(v)[:20]}")
        return f
    if typ is list and isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    if typ is list and isinstance(v, str):
        return parse_value(name, v)
    if typ is not list and isinstance(v, typ) and not (typ is int and isinstance(v, bool)):
        return v
    if isinstance(v, str) and typ is not str:
        return parse_value(name, v)
    raise SettingsError(f"{key} must be {typ.__name__}{' or none' if optional else ''}, got {v!r}")


def check_model(s: ModelSettings) -> None:
    """Checks that need no model files (see `SettingsStore.set_model` for those that do)."""
    modes = verify_modes()
    if s.verify_mode not in modes:
        raise SettingsError(f"unknown verify mode '{s.verify_mode}'; valid: {', '.join(modes)}")
    if s.drafter_quant_bits not in QUANT_BITS:
        raise SettingsError(f"drafter.quant_bits must be none, 4 or 8 (or auto), got {s.drafter_quant_bits}")
    if s.drafter_quant_group_size not in GROUP_SIZES:
        raise SettingsError(f"drafter.quant_group_size must be 32, 64 or 128, got {s.drafter_quant_group_size}")
    if s.drafter_activation_dtype not in ACTIVATION_DTYPES:
        raise SettingsError(f"unknown drafter.activation_dtype '{s.drafter_activation_dtype}'; "
                            f"valid: {', '.join(ACTIVATION_DTYPES)}")
    for name in ("temperature", "top_p", "min_p"):  # NaN passes every comparison below
        if not math.isfinite(getattr(s, name)):
            raise SettingsError(f"{name} must be a finite number, got {getattr(s, name)}")
    if s.dtype not in COMPUTE_DTYPES:
        raise SettingsError(f"unknown dtype '{s.dtype}'; valid: {', '.join(COMPUTE_DTYPES)}")
    try:  # the engine's own checks, so settings never hold values generation refuses
        SamplingParams(s.temperature, s.top_p, s.top_k, s.min_p)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if s.max_context < 1:
        raise SettingsError(f"max_context must be >= 1, got {s.max_context}")
    try:
        check_decode_fields(s, lambda field: FIELD_TO_KEY[field])
    except ValueError as e:
        raise SettingsError(str(e)) from None


def check_global(g: GlobalSettings) -> None:
    """Checks that need no model files (see `SettingsStore.set_global` for those that do)."""
    if not 0 < g.port < 65536:
        raise SettingsError(f"port must be in 1..65535, got {g.port}")
    if not g.host:
        raise SettingsError("host cannot be empty")
    if g.prompt_cache_mb < 0:
        raise SettingsError(f"prompt_cache_mb must be >= 0 (0 turns the prompt cache off), got {g.prompt_cache_mb}")
    if not 0 <= g.prompt_cache_disk_gb < 1 << 20:
        raise SettingsError(f"prompt_cache_disk_gb must be >= 0 (0 keeps cached prompts in memory only), "
                            f"got {g.prompt_cache_disk_gb}")
    if g.memory_budget_gb is not None and not 0 < g.memory_budget_gb < 1 << 20:
        raise SettingsError(f"memory_budget_gb must be > 0 (or none: 75% of this machine's memory), "
                            f"got {g.memory_budget_gb}")
    if g.max_batch != "auto" and not 1 <= g.max_batch <= 64:
        raise SettingsError(f"max_batch must be auto or in 1..64 (1: one request at a time), got {g.max_batch}")
