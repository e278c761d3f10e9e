"""Calibration: what speculation costs for one model (+ drafter) on this machine.

`Costs` is the cost curve in 1-token target steps: verify c(w), draft d(w),
and t_plain, a token of pipelined plain decoding (how plain decoding really
runs). `measure_costs` times them in interleaved rounds (ratios within a round,
median over rounds: load drift cancels), within a wall-clock budget; the
result is cached on disk per model, drafter and machine (`cost_key`) and
measured again when older than a month. The default mode's guard needs only
widths 1 and w (`get_costs(..., widths=(1, w))`, ~0.2 s once per machine);
verify mode `adaptive` needs every width.

`Observed` carries the guard's live acceptance and backoff from one request
to the next one on the same model objects (this process only).

Nothing here decides anything: policy.py does, from these numbers."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx

COST_CONTEXT = 256  # tokens of cached context the cost curve is measured at
COST_BUDGET_S = 0.5  # wall-clock budget of the timed rounds (plus one warm-up and a prefill)
COST_MAX_AGE_S = 30 * 86400  # re-measure monthly: a curve taken on a busy day must not stick


@dataclass
class Costs:
    """Measured on one model + drafter, on this machine."""

    t1: float  # seconds of a 1-token target step (with feature capture), the unit below
    c: Dict[int, float]  # verify cost c(w) = t(w tokens) / t1, w = 1..max_width
    d: Dict[int, float]  # draft cost d(w) = t(draft w positions) / t1; d(1) = 0
    context: int = COST_CONTEXT
    measured_at: float = 0.0  # unix time
    t_plain: float = 0.0  # seconds per token of pipelined plain decoding (0: not measured)

    @property
    def max_width(self) -> int:
        return max(self.c)

    def to_json(self) -> dict:
        return {"t1": self.t1, "c": {str(k): v for k, v in self.c.items()},
                "d": {str(k): v for k, v in self.d.items()}, "context": self.context,
                "measured_at": self.measured_at, "t_plain": self.t_plain}

    @classmethod
    def from_json(cls, j: dict) -> "Costs":
        return cls(float(j["t1"]), {int(k): float(v) for k, v in j["c"].items()},
                   {int(k): float(v) for k, v in j["d"].items()}, int(j.get("context", COST_CONTEXT)),
                   float(j.get("measured_at", 0.0)), float(j.get("t_plain", 0.0)))


# bumped when a measurement changes, so curves measured the old way are not reused
# (2: 16 pipelined plain steps, not 4, and the fastest round: both inflated t_plain)
COST_METHOD = 2


def interpolate(curve: Dict[int, float], w: int) -> float:
    """A cost curve at width w, linear between the nearest measured widths (the
    guard measures only 1 and its width; the realistic bench a few)."""
    lo = max(x for x in curve if x <= w)
    hi = min(x for x in curve if x >= w)
    return curve[lo] if lo == hi else curve[lo] + (curve[hi] - curve[lo]) * (w - lo) / (hi - lo)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_costs(model, drafter=None, max_width: int = 5, context: int = COST_CONTEXT,
                  budget_s: float = COST_BUDGET_S, min_rounds: int = 5, max_rounds: int = 25,
                  widths: Optional[Sequence[int]] = None, plain_steps: int = 8) -> Costs:
    """Time target forwards of 1..max_width tokens over `context` cached tokens
    (capturing the drafter's tapped layers, as the decode loop does), drafter
    proposals of 2..max_width positions, in interleaved rounds, and a short run
    of pipelined plain steps."""
    from .drafter import Drafter
    from .target import Target

    target = Target(model)
    capture = list(drafter.config.target_layer_ids) if drafter is not None else []
    cache = target.make_cache()
    ids = (mx.arange(context) * 7919 + 11) % target.vocab_size
    _, feats = target(ids[None], cache, capture)
    mx.eval([c.state for c in cache])
    restore = target.checkpoint(cache)  # timing steps leave the cache exactly as it was
    real_drafter = isinstance(drafter, Drafter)  # test doubles have no cost worth measuring
    dcache = None
    if real_drafter:
        dcache = drafter.make_cache()
        mx.eval(drafter.propose(target, 1, feats, dcache, 2).tokens)  # fills the drafter context once

    def verify(w):
        t0 = time.perf_counter()
        logits, f = target(ids[-w:][None], cache, capture)
        mx.argmax(logits[0], axis=-1).tolist()  # the loop reads the argmax back too
        if f is not None:
            mx.eval(f)
        dt = time.perf_counter() - t0
        restore()
        return dt

    def draft(w):
        t0 = time.perf_counter()
        p = drafter.propose(target, 1, None, dcache, w)
        mx.eval(p.tokens)
        return time.perf_counter() - t0

    def plain(n=plain_steps):  # pipelined like the loop's plain path: queue step i+1 before reading i
        y = ids[-1:]
        t0 = time.perf_counter()
        for _ in range(n):
            logits, _ = target(y.reshape(1, 1), cache, ())
            nxt = mx.argmax(logits[0, -1])
            mx.async_eval(nxt)
            y.item()
            y = nxt
        y.item()
        dt = (time.perf_counter() - t0) / n
        restore()
        return dt

    widths = sorted(set(widths or range(1, max_width + 1)) | {1})
    dwidths = [w for w in widths if w > 1] if real_drafter else ()
    for w in widths:  # warm-up: first calls at a new shape are slow
        verify(w)
    for w in dwidths:
        draft(w)
    plain(2)
    tv = {w: [] for w in widths}
    td = {w: [] for w in dwidths}
    tp = []
    start = time.perf_counter()
    for r in range(max_rounds):
        for w in widths:
            tv[w].append(verify(w))
        for w in dwidths:
            td[w].append(draft(w))
        tp.append(plain())
        if r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    # ratios within a round, then the median over rounds: the machine's load
    # drifts between rounds and cancels within one; spikes fall out of the median
    t1 = _median(tv[1])
    c = {w: _median([a / b for a, b in zip(tv[w], tv[1])]) for w in widths}
    d = {1: 0.0}
    d.update({w: (_median([a / b for a, b in zip(td[w], tv[1])]) if real_drafter else 0.0)
              for w in widths if w > 1})
    # a plain token: the fastest round. Pipelining hides the graph building only
    # while a core is free, so a busy round overstates it, and an overstated plain
    # token makes a draft cycle look cheap: the guard would draft where it loses
    return Costs(t1, c, d, context, time.time(), t1 * min(a / b for a, b in zip(tp, tv[1])))


# -- the per-model, per-machine cache -----------------------------------------------


def cache_dir() -> Path:
    home = os.environ.get("MLX_DFLASH_HOME")
    if home:
        return Path(home) / "cache"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlx-dflash"))


def _config_of(obj) -> dict:
    args = getattr(obj, "args", None) or getattr(obj, "config", None)
    if args is None:
        return {"type": type(obj).__name__}
    if hasattr(args, "to_dict"):
        return args.to_dict()
    try:
        return asdict(args)
    except TypeError:
        return {k: v for k, v in vars(args).items() if not k.startswith("_")}


_KEYS: Dict[tuple, tuple] = {}  # (id(model), id(drafter)) -> (weakrefs, key): hashing params once


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def cost_key(model, drafter=None) -> dict:
    """What the costs depend on. The model is identified by its config and its
    parameters' shapes and dtypes (the mlx-lm model object does not know its
    weights file; cost depends on shapes, dtypes and quantization, not values)."""
    memo = _KEYS.get((id(model), id(drafter)))
    if memo and memo[0]() is model and memo[1]() is drafter:
        return memo[2]
    from mlx.utils import tree_flatten

    from . import fastblas

    def params(m):
        h = hashlib.sha1()
        for k, v in tree_flatten(m.parameters()):
            h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
        return h.hexdigest()[:16]

    key = {
        "method": COST_METHOD,
        "model": _config_of(model), "model_params": params(model),
        "drafter": _config_of(drafter) if drafter is not None else None,
        "drafter_params": params(drafter) if hasattr(drafter, "parameters") else None,
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                    "device": str(mx.default_device()), "blas": fastblas.STATE["blas"],
                    "blas_threads": os.environ.get("MLX_DFLASH_BLAS_THREADS")},
    }
    key = json.loads(json.dumps(key, default=str, sort_keys=True))
    _KEYS[(id(model), id(drafter))] = (_ref(model), _ref(drafter), key)
    return key


def _path(key: dict, kind: str) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "calibration" / f"{kind}-{digest}.json"


def cost_path(key: dict) -> Path:
    return _path(key, "costs")


def _read(p: Path, key: dict):
    try:
        j = json.loads(p.read_text())
    except (OSError, ValueError):
        return None  # missing or corrupt: measure again
    return j if isinstance(j, dict) and j.get("key") == key else None


def _write(p: Path, key: dict, body: dict) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, **body}, indent=1))
    os.replace(tmp, p)  # atomic: a concurrent reader never sees half a file
    return p


def load_cached(key: dict, max_width: int = 0, widths: Sequence[int] = ()) -> Optional[Costs]:
    """The cached curve if it has widths 1..max_width (and `widths`) and is fresh."""
    j = _read(cost_path(key), key)
    try:
        costs = Costs.from_json(j["costs"]) if j else None
    except (KeyError, ValueError, TypeError):
        return None
    need = set(range(1, max_width + 1)) | set(widths)
    if costs is None or not need <= set(costs.c) or time.time() - costs.measured_at > COST_MAX_AGE_S:
        return None
    return costs


def save_cached(key: dict, costs: Costs) -> Path:
    return _write(cost_path(key), key, {"costs": costs.to_json()})


_MEMO: Dict[str, Costs] = {}  # one process measures (or reads) each curve once


def get_costs(model, drafter=None, max_width: int = 0, refresh: bool = False,
              widths: Sequence[int] = (), **measure) -> Costs:
    """The cost curve for this model + drafter on this machine, with widths
    1..max_width (and `widths`): memoised, then the on-disk cache, else measured
    now (`measure`: budget and rounds for measure_costs) and cached."""
    key = cost_key(model, drafter)
    k = json.dumps(key, sort_keys=True)
    need = set(range(1, max_width + 1)) | set(widths) | {1}
    got = None if refresh else _MEMO.get(k)
    if got is None or not need <= set(got.c) or (not got.t_plain and widths):
        got = None if refresh else load_cached(key, max_width, widths)
        if got is None:
            got = measure_costs(model, drafter, max(need), widths=sorted(need), **measure)
            try:
                save_cached(key, got)
            except OSError:
                pass  # read-only cache dir: measure again next process
        _MEMO[k] = got
    return got


def remember(model, drafter, costs: Costs) -> None:
    """Use (and cache) a curve measured elsewhere, e.g. by a benchmark run."""
    key = cost_key(model, drafter)
    _MEMO[json.dumps(key, sort_keys=True)] = costs
    try:
        save_cached(key, costs)
    except OSError:
        pass


# -- what the loop observed ---------------------------------------------------------


@dataclass
class Observed:
    """The guard's live state worth carrying to the next request on the same
    model objects (acceptance depends on the prompts, so it is not written to disk)."""

    tau: Dict[int, float] = field(default_factory=dict)  # tokens per cycle, by width
    backoff: int = 0  # the guard's next plain-run length (0: the first)
    wait: int = 0  # plain tokens still due when the last request ended (0: it was drafting)
    lookup_alpha: Optional[float] = None  # share of the guard's lookup drafts accepted


_OBS: Dict[tuple, tuple] = {}  # (id(model), id(drafter)) -> (weakrefs, Observed)


def load_observed(model, drafter) -> Optional[Observed]:
    memo = _OBS.get((id(model), id(drafter)))
    if memo and memo[0]() is model and memo[1]() is drafter:
        return memo[2]
    return None


def save_observed(model, drafter, obs: Observed) -> None:
    _OBS[(id(model), id(drafter))] = (_ref(model), _ref(drafter), obs)
