"""Calibration: measuring what speculation costs for one model (+ drafter) on
this machine, by timing the engine's own steps (engine.Engine: prefill,
verify + readback, draft, and its pipelined plain decoding), so what the
policies are told is what runs.

`measure_costs` times them in interleaved rounds (ratios within a round,
median over rounds: load drift cancels), within a wall-clock budget.
`Calibration` is what a session asks for costs and the guard's carried-over
state: held per loaded model in a `costs.CostBook`, curves cached on disk per
model, drafter and machine and measured again when older than a month. The
default mode's guard needs only widths 1 and w (~0.2 s once per machine);
verify mode `adaptive` needs every width. Nothing here decides anything:
policy.py does, from these numbers."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..policy.base import DFLASH, Plan
from ..policy.costs import COST_CONTEXT, CostBook, Costs, Observed, median, need
from .decode_config import DecodeConfig
from .engine import Engine
from .measuring import checkpoint
from .sequence import cat_feats

CATCH_ROWS = 256  # context rows a timed catch-up takes in (its cost per row: Costs.u)
COST_BUDGET_S = 0.5  # wall-clock budget of the timed rounds (plus one warm-up and a prefill)


# Past this many tokens of context the timed steps run over random K/V rows: a
# step's cost depends on the shapes, not the values, and a real prefill of the
# 16k-64k contexts the guard prices would stall a user's first long request for
# minutes on a slow machine (seen: 20 min for 16k on a busy 2-core CPU).
SYNTHETIC_FROM = 2048


def extend_with_random_rows(cache: list, rows: int, seed: int = 0) -> None:
    """Grow every attention layer's K/V in `cache` by `rows` random rows, in
    pieces as a prefill grows it (a sliding-window layer up to its window);
    recurrent layers keep their fixed-size state. The cache must hold at least
    one real row (its shapes and dtype are taken from it)."""
    for i, c in enumerate(cache):
        if not isinstance(c, (KVCache, RotatingKVCache)) or c.keys is None:
            continue
        left = rows if not isinstance(c, RotatingKVCache) else max(0, min(rows, c.max_size - c.offset))
        k, v = c.keys, c.values
        while left > 0:
            m = min(4096, left)
            key = mx.random.key(seed + 7919 * i + left)
            c.update_and_fetch(mx.random.normal((*k.shape[:2], m, k.shape[3]), key=key).astype(k.dtype),
                               mx.random.normal((*v.shape[:2], m, v.shape[3]), key=key).astype(v.dtype))
            left -= m
        mx.eval(c.keys, c.values)


def measure_costs(model, drafter=None, max_width: int = 5, context: int = COST_CONTEXT,
                  budget_s: float = COST_BUDGET_S, min_rounds: int = 5, max_rounds: int = 25,
                  widths: Optional[Sequence[int]] = None, plain_steps: int = 8, target=None,
                  stop: Optional[Callable[[], bool]] = None) -> Costs:
    """Time, over `context` cached tokens and capturing the drafter's tapped
    layers as the loop does, the engine's own steps on a set of one: verifies of
    1..max_width rows (its verify and its one readback), drafts of 2..max_width
    positions (its DFlash proposer), and a run of `plain_steps` tokens of its
    pipelined plain decoding. `target`: the target adapter (a split target's on
    every rank). `stop`: asked between the timed pieces; when it says so, the
    measurement ends with Interrupted (a server's request comes first)."""
    eng = Engine(model, None, drafter, target=target)
    real_rows = context if context <= SYNTHETIC_FROM else SYNTHETIC_FROM // 2
    ids = ((mx.arange(real_rows) * 7919 + 11) % eng.target.vocab_size).tolist()
    # the drafter's context as a decode holds it by default (a sink and a window: a draft costs the same at any
    # length). Timed over the whole context, a 5-position draft read 27 ms at 16k tokens where a decode pays 6
    # (bench/long_context/curve_window.py), and what was paid only ever raises a price; a decode that attends
    # to more rows (drafter_window None) pays more than this prices, which is what prices as paid learn
    uid = eng.submit(ids, DecodeConfig(verify_mode="off" if drafter is None else "dflash", guard=False,
                                       block_size=2 if drafter is not None else None, max_tokens=1 << 30,
                                       prefill_step_size=1 << 20), keep=drafter is not None)
    try:
        return _measure(eng, ids, real_rows, context, widths, max_width, budget_s, min_rounds, max_rounds,
                        plain_steps, stop)
    finally:
        eng.close(uid)


def _prefilled(eng, real_rows, context, stop):
    """The session's one request, its prompt prefilled (the steps timed after it start from its first
    token) and its context extended with random rows and features to `context` (SYNTHETIC_FROM)."""
    s = eng.waiting[0]
    while not eng.rows:
        eng._prefill(s)
        checkpoint(stop)
    if context > real_rows:
        extend_with_random_rows(s.pc.target, context - real_rows)
        feats = cat_feats(s.pending)
        if feats is not None:
            s.pending = [mx.concatenate([feats, mx.random.normal((1, context - real_rows, feats.shape[2]),
                                                                  key=mx.random.key(1)).astype(feats.dtype)],
                                        axis=1)]
    mx.eval([c.state for c in s.pc.target])
    return s


def _measure(eng, ids, real_rows, context, widths, max_width, budget_s, min_rounds, max_rounds, plain_steps,
             stop) -> Costs:
    """Timed in turn: verifies, drafts and plain runs in rounds (c, d, the plain token), then the
    drafter's catch-up (u)."""
    drafter = eng.drafter
    s = _prefilled(eng, real_rows, context, stop)
    pc = s.pc
    restore = eng.target.checkpoint(pc.target)  # timing steps leave the cache exactly as it was
    anchor, tokens = s.anchor, list(pc.tokens)
    real = drafter is not None
    row = None  # (a context row's width and dtype, for the catch-up's rows)
    if real:
        f0 = cat_feats(s.pending)
        row = (f0.shape[2], f0.dtype) if f0 is not None else None
        mx.eval(eng.propose([s], [2], [DFLASH])[1])  # fills the drafter's context once

    def reset():
        restore()
        pc.tokens[:] = tokens
        s.anchor, s.pending = anchor, []
        eng._flight = eng._due = None

    def verify(w):
        drafts = mx.array([ids[len(ids) - w + 1:] if w > 1 else []], mx.int32).reshape(1, w - 1)
        t0 = time.perf_counter()
        res, f = eng.verify(drafts, [w - 1], [None])
        eng.readback(res, [w - 1])
        if f is not None:
            mx.eval(f)
        dt = time.perf_counter() - t0
        reset()
        return dt

    def draft(w):
        t0 = time.perf_counter()
        mx.eval(eng.propose([s], [w], [DFLASH])[1])
        return time.perf_counter() - t0

    def catch_up():
        """A 2-position draft that first takes in CATCH_ROWS context rows, less one that takes in none,
        per row (what a probe's first draft pays after a prompt or plain steps: the rows' projections)."""
        base = draft(2)
        s.pending = [mx.random.normal((1, CATCH_ROWS, row[0]), key=mx.random.key(2)).astype(row[1])]
        mx.eval(s.pending)
        dt = draft(2) - base
        s.pending = []
        return dt / CATCH_ROWS

    def plain(n=plain_steps):
        s.plan = Plan("off")  # (the policy decides plain for a row that never drafts)
        t0 = time.perf_counter()
        for _ in range(n):
            eng._plain()
        eng._flight = None
        dt = (time.perf_counter() - t0) / n
        s.plan = plan
        reset()
        return dt

    plan = s.plan
    widths = sorted(set(widths or range(1, max_width + 1)) | {1})
    dwidths = [w for w in widths if w > 1] if real else ()
    checkpoint(stop)
    for w in widths:  # warm-up: first calls at a new shape are slow
        verify(w)
    for w in dwidths:
        draft(w)
    plain(2)
    checkpoint(stop)
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
        checkpoint(stop)
    # ratios within a round, then the median over rounds: the machine's load
    # drifts between rounds and cancels within one; spikes fall out of the median
    t1 = median(tv[1])
    c = {w: median([a / b for a, b in zip(tv[w], tv[1])]) for w in widths}
    d = {1: 0.0}
    d.update({w: (median([a / b for a, b in zip(td[w], tv[1])]) if real else 0.0) for w in widths if w > 1})
    # the catch-up last: the rows it takes in stay in the drafter's context (no attention among them: what
    # a row costs does not depend on the rows before it)
    u = median([max(0.0, catch_up()) / t1 for _ in range(3)]) if row is not None else 0.0
    # a plain token, as a ratio to the 1-token step within each round like c and d
    # (the session's plain run includes the loop's own per-token work). The median:
    # the fastest round (used before) picked a lucky round on a busy machine and
    # made every cycle look ~2x dearer than fixed widths measured it
    return Costs(t1, c, d, context, time.time(), t1 * median([a / b for a, b in zip(tp, tv[1])]), u)


class Calibration:
    """What a decode session asks for: a model's cost curve (held, cached, else
    measured now) and the guard's state carried from the last request."""

    def __init__(self, book: Optional[CostBook] = None):
        self.book = book or CostBook()

    def costs(self, model, drafter=None, max_width: int = 0, refresh: bool = False,
              widths: Sequence[int] = (), enough: Sequence[int] = (), at: Optional[int] = None,
              **measure) -> Costs:
        """The cost curve with widths 1..max_width (and `widths`): held here, or
        cached on disk, else measured now (`measure`: budget and rounds for
        measure_costs) and cached. A curve held or cached with the widths in
        `enough` will do (the guard chooses among the widths it has). `at`: the
        curve measured over that many cached tokens, kept apart from the default one."""
        got = None if refresh else self.book.curve(model, drafter, max_width, enough or widths, at)
        if got is None:
            # never narrower than the curve it replaces: verify mode adaptive's widths 1..5 measured over
            # the guard's 1, 2, 3, 5, 8 would leave the guard choosing among 5 and below from then on
            had = self.book.curve(model, drafter, 0, (), at)
            ws = need(max_width, widths) | (set(had.c) if had is not None else set())
            got = measure_costs(model, drafter, max(ws), widths=sorted(ws), **measure)
            self.book.keep(model, drafter, got, context=at)
        return got

    def remember(self, model, drafter, costs: Costs) -> None:
        """Use (and cache) a curve measured elsewhere, e.g. by a benchmark run."""
        self.book.keep(model, drafter, costs)

    def prior(self, model, drafter) -> Optional[Observed]:
        return self.book.observed(model, drafter)

    def keep(self, model, drafter, obs: Observed) -> None:
        self.book.observe(model, drafter, obs)


DEFAULT = Calibration()  # what stream_generate uses: one per process


def get_costs(model, drafter=None, max_width: int = 0, refresh: bool = False, widths: Sequence[int] = (),
              **measure) -> Costs:
    return DEFAULT.costs(model, drafter, max_width, refresh, widths, **measure)


def remember(model, drafter, costs: Costs) -> None:
    DEFAULT.remember(model, drafter, costs)
