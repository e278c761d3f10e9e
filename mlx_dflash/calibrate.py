"""Calibration: what speculation costs for one model (+ drafter) on this machine.

Two records, both cached per model, drafter and machine (`cost_key`):

- `Costs`: the verify / draft cost curve c(w), d(w) in 1-token target steps,
  timed up front (`measure_costs`, budgeted) for verify mode `adaptive`, which
  plans over every width.
- `Observed`: what the decode loop itself measured while it ran: seconds per
  plain token (pipelined, as plain decoding really runs), seconds per
  draft + verify cycle at each width, tokens per cycle. The guard of the default
  mode (policy.Guard) needs nothing else, so the first request pays no
  calibration time; the record is refreshed by every run and dropped when stale.

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
from typing import Dict, Optional

import mlx.core as mx

COST_CONTEXT = 256  # tokens of cached context the cost curve is measured at
COST_BUDGET_S = 0.5  # wall-clock budget of the timed rounds (plus one warm-up and a prefill)
COST_MAX_AGE_S = 30 * 86400  # re-measure monthly: a curve taken on a busy day must not stick
OBSERVED_MAX_AGE_S = 7 * 86400  # live timings older than a week are not trusted as a prior


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


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_costs(model, drafter=None, max_width: int = 5, context: int = COST_CONTEXT,
                  budget_s: float = COST_BUDGET_S, min_rounds: int = 5, max_rounds: int = 25) -> Costs:
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
        target.trim(cache, w)
        return dt

    def draft(w):
        t0 = time.perf_counter()
        p = drafter.propose(target, 1, None, dcache, w)
        mx.eval(p.tokens)
        return time.perf_counter() - t0

    def plain(n=8):  # pipelined like the loop's plain path: queue step i+1 before reading i
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
        target.trim(cache, n)
        return dt

    widths = range(1, max_width + 1)
    dwidths = range(2, max_width + 1) if real_drafter else ()
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
              for w in range(2, max_width + 1)})
    return Costs(t1, c, d, context, time.time(), _median(tp))


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
        "model": _config_of(model), "model_params": params(model),
        "drafter": _config_of(drafter) if drafter is not None else None,
        "drafter_params": params(drafter) if hasattr(drafter, "parameters") else None,
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                    "device": str(mx.default_device()), "blas": fastblas.STATE["blas"],
                    "blas_threads": os.environ.get("MLX_DFLASH_BLAS_THREADS")},
    }
    key = json.loads(json.dumps(key, default=str, sort_keys=True))
    if drafter is None or hasattr(drafter, "parameters"):  # test doubles change behaviour, not shape
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


def load_cached(key: dict, max_width: int) -> Optional[Costs]:
    j = _read(cost_path(key), key)
    try:
        costs = Costs.from_json(j["costs"]) if j else None
    except (KeyError, ValueError, TypeError):
        return None
    if costs is None or costs.max_width < max_width or time.time() - costs.measured_at > COST_MAX_AGE_S:
        return None
    return costs


def save_cached(key: dict, costs: Costs) -> Path:
    return _write(cost_path(key), key, {"costs": costs.to_json()})


_MEMO: Dict[str, Costs] = {}  # one process measures (or reads) each curve once


def get_costs(model, drafter=None, max_width: int = 5, refresh: bool = False) -> Costs:
    """The cost curve for this model + drafter on this machine: memoised, then
    the on-disk cache, else measured now (and cached)."""
    key = cost_key(model, drafter)
    k = json.dumps(key, sort_keys=True)
    got = None if refresh else _MEMO.get(k)
    if got is None or got.max_width < max_width:
        got = None if refresh else load_cached(key, max_width)
        if got is None:
            got = measure_costs(model, drafter, max_width)
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
    """Live timings of one model + drafter on this machine (seconds), and the
    guard's state worth carrying to the next request of the same objects."""

    t_plain: float = 0.0  # per plain token, pipelined (0: not seen)
    t_cycle: Dict[int, float] = field(default_factory=dict)  # per draft + verify cycle, by width
    tau: Dict[int, float] = field(default_factory=dict)  # tokens per cycle, by width
    updated_at: float = 0.0
    backoff: int = 0  # the guard's plain-run length when the last request ended (process only)

    def to_json(self) -> dict:
        return {"t_plain": self.t_plain, "t_cycle": {str(k): v for k, v in self.t_cycle.items()},
                "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, j: dict) -> "Observed":
        return cls(float(j["t_plain"]), {int(k): float(v) for k, v in j["t_cycle"].items()},
                   updated_at=float(j.get("updated_at", 0.0)))


_OBS: Dict[tuple, tuple] = {}  # (id(model), id(drafter)) -> (weakrefs, Observed): this process


def load_observed(model, drafter) -> Optional[Observed]:
    """This process's record for these very objects (costs, acceptance, backoff),
    else the machine's timings from disk (costs only: acceptance depends on the
    prompts, which the next process does not share), else None."""
    memo = _OBS.get((id(model), id(drafter)))
    if memo and memo[0]() is model and memo[1]() is drafter:
        return memo[2]
    key = cost_key(model, drafter)
    j = _read(_path(key, "observed"), key)
    try:
        obs = Observed.from_json(j["observed"]) if j else None
    except (KeyError, ValueError, TypeError):
        return None
    if obs is None or time.time() - obs.updated_at > OBSERVED_MAX_AGE_S:
        return None
    return obs


def save_observed(model, drafter, obs: Observed, to_disk: bool = True) -> None:
    obs.updated_at = time.time()
    _OBS[(id(model), id(drafter))] = (_ref(model), _ref(drafter), obs)
    if to_disk and obs.t_plain and obs.t_cycle:
        key = cost_key(model, drafter)
        try:
            _write(_path(key, "observed"), key, {"observed": obs.to_json()})
        except OSError:
            pass  # read-only cache dir: this process still remembers
