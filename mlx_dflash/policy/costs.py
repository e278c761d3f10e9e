"""What speculation costs for one model (+ drafter) on one machine, as data:
the cost curve (`Costs`), the guard's carried-over live state (`Observed`),
the curves' on-disk cache (per model, drafter and machine: `cost_key`), and
`CostBook`, the per-loaded-model cache object that holds both in a process.
Measuring is calibrate.py's; deciding is policy.py's."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..platform import fastblas
from ..platform.paths import cache_dir

COST_CONTEXT = 256  # tokens of cached context the cost curve is measured at
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
    # the drafter's catch-up: what a draft costs beyond d(w) per context row it takes in first (the rows
    # plain steps or a prefill captured since its last draft), in units of t1 (0: not measured)
    u: float = 0.0

    @property
    def max_width(self) -> int:
        return max(self.c)

    def to_json(self) -> dict:
        return {"t1": self.t1, "c": {str(k): v for k, v in self.c.items()},
                "d": {str(k): v for k, v in self.d.items()}, "context": self.context,
                "measured_at": self.measured_at, "t_plain": self.t_plain, "u": self.u}

    @classmethod
    def from_json(cls, j: dict) -> "Costs":
        return cls(float(j["t1"]), {int(k): float(v) for k, v in j["c"].items()},
                   {int(k): float(v) for k, v in j["d"].items()}, int(j.get("context", COST_CONTEXT)),
                   float(j.get("measured_at", 0.0)), float(j.get("t_plain", 0.0)), float(j.get("u", 0.0)))


# bumped when a measurement changes, so curves measured the old way are not reused
# (2: 16 pipelined plain steps, not 4, and the fastest round: both inflated t_plain;
# 3: timed through the decode session's own steps, plain steps with feature capture, a plain
# token as the median ratio to the 1-token step; 4: drafts timed with the drafter's context bounded as a decode
# bounds it, not over the whole context; 5: the drafter's catch-up per context row, u)
COST_METHOD = 5


class Unpriced(Exception):
    """A curve the price needs is neither held nor cached, and this engine does
    not measure inside a request (a server: it measures while idle). `key`:
    ("length", tokens or None for the base curve) or ("rows", batch size)."""

    def __init__(self, key: tuple):
        self.key = key
        super().__init__(f"the costs at {curve_name(key)}")


def curve_name(key: tuple) -> str:
    """A measured curve's name in messages: its length or its number of rows."""
    kind, n = key
    return "short contexts" if n is None else f"{n} tokens" if kind == "length" else f"{n} rows"


def interpolate(curve: Dict[int, float], w: int) -> float:
    """A cost curve at width w, linear between the nearest measured widths (the
    guard measures only 1 and its width; the realistic bench a few)."""
    lo = max(x for x in curve if x <= w)
    hi = min(x for x in curve if x >= w)
    return curve[lo] if lo == hi else curve[lo] + (curve[hi] - curve[lo]) * (w - lo) / (hi - lo)


@dataclass
class Observed:
    """The guard's live state worth carrying to the next request on the same
    model objects (acceptance depends on the prompts, so it is not written to disk)."""

    tau: Dict[int, float] = field(default_factory=dict)  # tokens per cycle, by width
    backoff: int = 0  # the guard's next plain-run length (0: the first)
    wait: int = 0  # plain tokens still due when the last request ended (0: it was drafting)
    deferred: int = 0  # plain steps since a probe fell due, each refused as too dear for the room left
    # share of the guard's lookup drafts accepted, by grade (the length of the n-gram match: lookup_gate.py)
    lookup_alpha: Dict[int, float] = field(default_factory=dict)
    p: Optional[List[float]] = None  # the guard's per-position acceptance (when it chooses the width)
    tries: Optional[List[float]] = None  # the evidence behind p, tries per position (None: a prior's weight)
    # by (set size B, drafting): what the guard's cycles took beyond their price, in plain steps (observed
    # seconds over an observed plain step's, less the measured k(w)): costs measured apart miss work per cycle
    paid: Dict[tuple, float] = field(default_factory=dict)
    excess: Dict[tuple, List[float]] = field(default_factory=dict)  # the last cycles behind paid, by the same key


def median(xs: Sequence[float]) -> float:
    """The middle of xs (of an even count, the mean of the two middle ones: of
    two samples, one spike counts half): a timing's spikes fall out."""
    ys, n = sorted(xs), len(xs)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def monotone(ys: List[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators):
    a wider verify or draft is never cheaper, whatever the timing noise says."""
    blocks = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


class CostModel:
    """k(w, B, L): what a cycle of width w costs in plain steps, with B rows of
    L tokens of context each, drafting from the drafter or not (a cycle of
    prompt-lookup drafts pays the verify alone). One plain step is one token
    per row (pipelined: t_plain, when measured).

    From the measured curves: `curve(at)` is the single-stream curve measured
    over `at` cached tokens (None: the base one); seconds per cycle and per
    plain token are linear in the length between two curves (and past them), as
    attention's reads are. `batch(B)` is the curve of a B-row set (batch_costs:
    a [B, w] verify in units of a [B, 1] step), scaled by the single stream's
    growth with the length. Curves are fetched when first needed (a short set
    never measures a long or batched one); a fetch may raise Unpriced, which
    passes through (nothing is cached for that price: it is asked again)."""

    def __init__(self, curve: Callable[[Optional[int]], Costs], widths: Sequence[int],
                 batch: Optional[Callable[[int], Costs]] = None, priced_at: Callable[[int], Optional[int]] = None):
        self.curve, self.batch, self.priced_at = curve, batch, priced_at or (lambda n: None)
        base = curve(None)
        self.widths = sorted((set(widths) & set(base.c)) | {1})  # the measured ones (the guard chooses among them)
        self._single = {None: self._seconds(base)}
        self._u = base.u * base.t1  # seconds of the drafter's catch-up per context row
        self._k: Dict[tuple, Dict[int, float]] = {}
        self._plain: Dict[tuple, float] = {}

    def _seconds(self, cv: Costs) -> tuple:
        """(context, {w: seconds of a drafting cycle}, {w: of a verify alone}, seconds per plain token),
        every width up to the widest (linear between the measured ones)."""
        ws = list(range(1, self.widths[-1] + 1))
        c = monotone([interpolate(cv.c, x) for x in ws])
        d = monotone([interpolate(cv.d, x) for x in ws])
        return (cv.context, {x: (cx + dx) * cv.t1 for x, cx, dx in zip(ws, c, d)},
                {x: cx * cv.t1 for x, cx in zip(ws, c)}, cv.t_plain or cv.t1)

    def _one(self, at: Optional[int]) -> tuple:
        if at not in self._single:
            self._single[at] = self._seconds(self.curve(at))
        return self._single[at]

    def _between(self, L: int) -> tuple:
        """(lo, hi, f): the seconds of the two curves that bracket L tokens, and L's place between them
        (seconds are linear in the length: attention's reads)."""
        lo, at = self._single[None], self.priced_at(L)
        hi = self._one(at) if at is not None else lo
        return lo, hi, (L - lo[0]) / (hi[0] - lo[0]) if hi[0] != lo[0] else 0.0

    def single(self, L: int) -> Dict[bool, Dict[int, float]]:
        """{drafting: {w: k}} for one row at L tokens of context."""
        lo, hi, f = self._between(L)
        plain = self._plain_at(L)
        return {drafting: {x: max(lo[i][x] + f * (hi[i][x] - lo[i][x]), 1e-9) / plain for x in lo[i]}
                for drafting, i in ((True, 1), (False, 2))}

    def plain_seconds(self, B: int, L: int) -> float:
        """One plain step of B rows at L tokens, in seconds, as measured apart: the unit of one row's k
        (several rows: their curve's step, t1, scaled by the single stream's growth with the length, as
        k is)."""
        key = (B, self._bucket(L))
        if key not in self._plain:
            one = self._plain_at(key[1])
            self._plain[key] = one if B == 1 or self.batch is None else \
                self.batch(B).t1 * one / max(self._single[None][3], 1e-9)
        return self._plain[key]

    def _plain_at(self, L: int) -> float:
        """One row's plain step at L tokens, in seconds (linear between the curves that bracket L)."""
        lo, hi, f = self._between(L)
        return max(lo[3] + f * (hi[3] - lo[3]), 1e-9)

    def catch_up(self, B: int = 1, L: int = 0) -> float:
        """What one context row costs the drafter to take in, for each of B rows, in the set's plain
        steps at L tokens (the base curve's u: the drafter's context is bounded, so a row costs the same
        at any length; 0 where it was not measured)."""
        return B * self._u / self.plain_seconds(B, L)

    def k(self, B: int = 1, L: int = 0, drafting: bool = True) -> Dict[int, float]:
        """{w: k(w, B, L)} for every w up to the widest measured (1: a plain step, 1)."""
        key = (B, self._bucket(L), drafting)
        if key not in self._k:
            one = self.single(key[1])
            if B == 1 or self.batch is None:
                k = one[drafting]
            else:
                cv = self.batch(B)
                base = self.single(0)
                ws = sorted(one[drafting])
                c = monotone([interpolate(cv.c, x) for x in ws])
                d = monotone([interpolate(cv.d, x) if drafting else 0.0 for x in ws])
                k = {x: (cx + dx) * one[drafting][x] / base[drafting][x] for x, cx, dx in zip(ws, c, d)}
            k[1] = 1.0
            self._k[key] = k
        return self._k[key]

    @staticmethod
    def _bucket(L: int) -> int:
        """Lengths priced alike (costs move slowly with the length): 64-token steps, then 1/8 steps."""
        if L <= 512:
            return 0
        step = max(64, 1 << max(0, L.bit_length() - 4))
        return L - L % step


# -- the on-disk cache -----------------------------------------------------------------


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


def cost_key(model, drafter=None) -> dict:
    """What the costs depend on. The model is identified by its config and its
    parameters' shapes and dtypes (the mlx-lm model object does not know its
    weights file; cost depends on shapes, dtypes and quantization, not values)."""
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
    return json.loads(json.dumps(key, default=str, sort_keys=True))


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
    """Atomic (a concurrent reader never sees half a file). A failed write (full
    disk, read-only folder) leaves no temp file and says so in one line; the
    measurement is kept in memory and made again by the next process."""
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, **body}, indent=1))
        os.replace(tmp, p)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        sys.stderr.write(f"mlx-dflash: measured costs not saved to {p.parent} ({e.strerror or e}); "
                         "they are measured again next time\n")
        raise
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


def load_record(key: dict, kind: str) -> Optional[dict]:
    """Another measured decision cached beside the curves (e.g. the batch
    engine's prefill probe): its body if fresh, else None."""
    j = _read(_path(key, kind), key)
    if not j or time.time() - float(j.get("measured_at", 0.0)) > COST_MAX_AGE_S:
        return None
    return j


def save_record(key: dict, kind: str, body: dict) -> None:
    try:
        _write(_path(key, kind), key, {"measured_at": time.time(), **body})
    except OSError:
        pass  # read-only cache dir: measured again next process


def need(max_width: int = 0, widths: Sequence[int] = ()) -> set:
    return set(range(1, max_width + 1)) | set(widths) | {1}


class CostBook:
    """Per loaded model (+ drafter), in one process: its cost key (hashing the
    parameters once), the curves read or measured, and the guard's observed
    state. Entries go with their model objects (weak references)."""

    def __init__(self):
        self._entries: Dict[tuple, list] = {}  # (id(model), id(drafter)) -> [model ref, drafter ref, key, [((context, batch), curve)], observed]

    def _entry(self, model, drafter) -> list:
        k = (id(model), id(drafter))
        e = self._entries.get(k)
        if e is None or e[0]() is not model or e[1]() is not drafter:
            e = self._entries[k] = [_ref(model), _ref(drafter), None, [], None]
            if isinstance(e[0], weakref.ref):
                weakref.finalize(model, self._entries.pop, k, None)
        return e

    def key(self, model, drafter=None) -> dict:
        e = self._entry(model, drafter)
        if e[2] is None:
            e[2] = cost_key(model, drafter)
        return e[2]

    def curve(self, model, drafter, max_width: int = 0, widths: Sequence[int] = (),
              context: Optional[int] = None, batch: Optional[int] = None) -> Optional[Costs]:
        """A curve held here or cached on disk that covers the widths asked for (a
        guard's curve must have its pipelined plain token: `widths` asks for it),
        measured at `context` tokens (None: the one curve measured at the default)
        and, for the batch engine, at `batch` rows (None: a single stream)."""
        want = need(max_width, widths)
        e = self._entry(model, drafter)
        for tag, c in e[3]:
            if tag == (context, batch) and want <= set(c.c) and (c.t_plain or not widths):
                return c
        c = load_cached(self._disk_key(model, drafter, context, batch), max_width, widths)
        if c is not None:
            e[3].append(((context, batch), c))
        return c

    def _disk_key(self, model, drafter, context: Optional[int], batch: Optional[int]) -> dict:
        key = dict(self.key(model, drafter))
        if context is not None:
            key["context"] = context
        if batch is not None:
            key["batch"] = batch
        return key

    def keep(self, model, drafter, costs: Costs, save: bool = True, context: Optional[int] = None,
             batch: Optional[int] = None) -> None:
        """Hold `costs` (and cache it on disk); `context` / `batch`: it is the curve at
        that length / that many batch rows."""
        self._entry(model, drafter)[3].insert(0, ((context, batch), costs))
        if save:
            try:
                save_cached(self._disk_key(model, drafter, context, batch), costs)
            except OSError:
                pass  # read-only cache dir: measure again next process

    def observed(self, model, drafter) -> Optional[Observed]:
        return self._entry(model, drafter)[4]

    def observe(self, model, drafter, obs: Observed) -> None:
        self._entry(model, drafter)[4] = obs


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
