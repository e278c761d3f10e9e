"""The target's compute dtype: which dtype its float weights (and its drafter's)
run in.

The `dtype` setting, and $MLX_DFLASH_DTYPE, is one of checkpoint, float32,
bfloat16, float16 or auto. `auto` on the CPU backend is the dtype this machine
runs the model's 1-token step fastest in, of the checkpoint's own and float32
(never narrower than the checkpoint: widening bf16 to float32 is exact,
narrowing is not), measured once per model and machine and cached; float32 only
where the wider weights fit in memory with a margin. mlx-cpu runs bf16 matmuls
outside BLAS, several times slower than float32, which leaves a bf16 drafter
no room to pay. On Metal `auto` keeps the checkpoint's dtype (its half-precision
kernels are the fast ones).

Greedy output is token for token mlx-lm's at the dtype in use: the lossless
tests compare against mlx-lm running the very model object the engine runs."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..platform import fastblas
from ..platform.paths import cache_dir

DTYPE_ENV = "MLX_DFLASH_DTYPE"
SETTINGS = ("auto", "checkpoint", "float32", "bfloat16", "float16")
NAMES = {"float32": mx.float32, "fp32": mx.float32, "float16": mx.float16, "fp16": mx.float16,
         "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}
MEMORY_SHARE = 0.5  # float32 weights may add at most this share of the memory available now
FASTER = 1.1  # float32 must be this much faster to be chosen (timings on a busy machine vary)
CACHE_VERSION = 1


def dtype_name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def param_dtype(m):
    """The dtype a model computes in: its first floating parameter's."""
    for _, v in tree_flatten(m.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def cast(m, dtype) -> None:
    """Cast floating, non-quantized parameters (quantized weights stay as they are)."""
    upd = [(k, v.astype(dtype)) for k, v in tree_flatten(m.parameters())
           if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype]
    if upd:
        m.update(tree_unflatten(upd))
        mx.eval(m.parameters())


def on_cpu() -> bool:
    """Whether MLX computes on the CPU here (no Metal, or the CPU chosen)."""
    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def backend() -> str:
    return "cpu" if on_cpu() else "metal"


@dataclass
class DtypeChoice:
    """What the target computes in, and why (one line for the user)."""

    name: str  # the dtype in use, e.g. "float32"
    setting: str  # what was asked for: auto, checkpoint, float32, ...
    source: str  # where that came from: "setting", "$MLX_DFLASH_DTYPE", "default"
    why: str  # why this dtype, one line
    checkpoint: str = ""  # the checkpoint's own dtype
    fresh: bool = False  # measured just now (not read from the cache)
    measured: Optional[dict] = None  # {"checkpoint_ms", "float32_ms"} of a 1-token step

    @property
    def cast(self):
        """The dtype to cast the weights to (the drafter's too), or None where they
        stay as stored. A dtype named in a setting applies to both models even where
        the target already has it."""
        if self.setting in NAMES:
            return NAMES[self.name]
        return None if self.name == self.checkpoint else NAMES[self.name]

    def line(self) -> str:
        return f"compute dtype {self.name} ({self.why})"

    def short(self) -> str:
        return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(self.name, self.name)


def requested(dtype: Optional[str] = None) -> tuple:
    """(what is asked for, where from). `dtype` is the setting or an argument;
    $MLX_DFLASH_DTYPE applies where it is None or auto. Raises ValueError (one
    line) for an unknown name."""
    src = "setting"
    env = os.environ.get(DTYPE_ENV, "").strip()
    if dtype is None or str(dtype).strip().lower() in ("", "auto"):
        if env and env.lower() != "auto":
            dtype, src = env, f"${DTYPE_ENV}"
        elif dtype is None and not env:
            dtype, src = "checkpoint", "default"
        else:
            dtype, src = "auto", (f"${DTYPE_ENV}" if dtype is None else "setting")
    d = str(dtype).strip().lower()
    if d in ("none", ""):
        d = "checkpoint"
    if d not in NAMES and d not in ("auto", "checkpoint"):
        raise ValueError(f"unknown dtype '{dtype}' ({src}); use one of {', '.join(SETTINGS)}")
    return (dtype_name(NAMES[d]) if d in NAMES else d), src


def float_bytes(m) -> tuple:
    """(bytes of the float parameters as stored, the same in float32)."""
    now = f32 = 0
    for _, v in tree_flatten(m.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            now += v.nbytes
            f32 += v.size * 4
    return now, f32


def available_memory() -> Optional[int]:
    """Bytes of memory available to a new allocation now (Linux: MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def step_times(model, dtypes, rounds: int = 3, steps: int = 3, context: int = 32) -> dict:
    """Median ms of a 1-token step of `model` in each of `dtypes` (casting it in
    place, round-robin so load that comes and goes hits them alike). The model is
    left in the last dtype. The step is the guard's 1-token step: a forward over
    `context` cached tokens."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    ts = {dtype_name(d): [] for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            cast(model, d)
            cache = make_prompt_cache(model)
            mx.eval(model(mx.arange(context)[None] % 64, cache=cache))
            for i in range(steps + 1):
                t0 = time.perf_counter()
                mx.eval(model(mx.array([[7]]), cache=cache))
                dt = time.perf_counter() - t0
                trim_prompt_cache(cache, 1)
                if i:  # the first is a warm-up
                    ts[dtype_name(d)].append(dt)
    return {k: round(sorted(v)[len(v) // 2] * 1e3, 3) for k, v in ts.items()}


def cache_key(path) -> dict:
    """The model (its folder, config and weight files) and the machine."""
    p = Path(path).resolve()
    files = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime))
                   for f in p.glob("*") if f.suffix in (".json", ".safetensors"))
    return {"v": CACHE_VERSION, "model": str(p), "files": files,
            "machine": {"platform": platform.platform(), "machine": platform.machine(),
                        "processor": platform.processor(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                        "device": str(mx.default_device()), "blas": fastblas.STATE["blas"]}}


def cache_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / "dtype" / f"{digest}.json"


def cached(path) -> Optional[dict]:
    """The measured choice for the model in `path` on this machine, or None."""
    key = json.loads(json.dumps(cache_key(path), default=str))
    try:
        j = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    return j if isinstance(j, dict) and j.get("key") == key and j.get("name") in NAMES else None


def _save(path, body: dict) -> None:
    key = json.loads(json.dumps(cache_key(path), default=str))
    p = cache_path(key)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **body}, indent=1))
        os.replace(tmp, p)
    except OSError:
        pass  # a read-only cache: measure again next time


def _ratio_text(ms: dict, ckpt: str) -> str:
    r = ms[ckpt] / ms["float32"]
    return f"a {ckpt} step costs {r:.1f}x a float32 one on this CPU"


def choose(model, setting: str = "auto", source: str = "setting", path=None) -> DtypeChoice:
    """The compute dtype for `model` (loaded, in its checkpoint's dtype). `path`,
    the model's folder, keys the cache of measured choices (None: measure, keep
    nothing). The model is left in its checkpoint's dtype; cast it to
    `choice.cast` where that is not None."""
    ckpt_dt = param_dtype(model)
    ckpt = dtype_name(ckpt_dt)
    mk = lambda name, why, **kw: DtypeChoice(name, setting, source, why, ckpt, **kw)  # noqa: E731
    if setting == "checkpoint":
        return mk(ckpt, f"the checkpoint's, from the {source}" if source != "default" else "the checkpoint's")
    if setting != "auto":
        return mk(setting, f"from the {source}")
    if not on_cpu():
        return mk(ckpt, "auto: the checkpoint's; Metal runs it natively")
    if ckpt_dt == mx.float32:
        return mk(ckpt, "auto: the checkpoint's, already float32")
    now, f32 = float_bytes(model)
    avail = available_memory()
    if avail is not None and f32 - now > MEMORY_SHARE * avail:
        return mk(ckpt, f"auto: float32 would need {(f32 - now) / 1e9:.1f} GB more; "
                        f"{avail / 1e9:.1f} GB free")
    hit = cached(path) if path is not None else None
    if hit is not None:
        return mk(hit["name"], hit["why"], measured=hit.get("measured"))
    mx.eval(model.parameters())
    ms = step_times(model, (ckpt_dt, mx.float32))
    cast(model, ckpt_dt)  # exact: the float32 copy was widened from it
    if ms["float32"] * FASTER < ms[ckpt]:
        name, why = "float32", f"auto: measured, {_ratio_text(ms, ckpt)}"
    else:
        name, why = ckpt, f"auto: measured, float32 is not faster here ({ms['float32']:.1f} vs {ms[ckpt]:.1f} ms a step)"
    measured = {"checkpoint_ms": ms[ckpt], "float32_ms": ms["float32"]}
    if path is not None:
        _save(path, {"name": name, "why": why, "measured": measured, "when": time.time()})
    return mk(name, why, fresh=True, measured=measured)


def name_of(dtype) -> str:
    """A dtype given as a name or an mx.Dtype -> its name."""
    return dtype if isinstance(dtype, str) else dtype_name(dtype)


def compute_dtype(dtype=None) -> tuple:
    """(the dtype asked for: an mx.Dtype, or None for the checkpoint's own or auto;
    where that came from). Reads no model: discovery's memory estimate."""
    setting, src = requested(None if dtype is None else name_of(dtype))
    return NAMES.get(setting), src
