"""What a batched cycle costs, c(w, B): measured once per model, drafter,
machine and batch size (then cached with the single-stream curves: costs.py's
CostBook, keyed by the batch size), through the batch engine's own steps (a
batched verify with feature capture, its ragged rollback, the batched draft).

The unit is one plain batched step at B rows (a [B, 1] verify: what plain
batched decoding runs per token), so k(w, B) = c(w) + d(w) is a cycle's cost
in plain batched steps, the number the batch guard divides by.

`auto_max_batch`: the server's default batch size, from the same measured
curves: the plain batched step's seconds at 1, 2, 4, 8, 16 rows
(`pick_max_batch`). `prefill_together_pays`: whether new prompts that arrive
together should be prefilled in one batched forward on this machine (a GPU
idles on a short prompt; a compute-bound CPU does not)."""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from ..policy.costs import CostBook, Costs, Unpriced, load_record, median, save_record
from ..target.adapter import Target, TargetError
from . import batch_cache as bc
from .measuring import checkpoint

BATCH_WIDTHS = (1, 2, 3, 5, 8)  # measured (capped at the drafter's block size); between: interpolated
MEASURED_B = (1, 2, 4, 8, 16, 32)  # batch sizes measured; between: linear in B
AUTO_B = (1, 2, 4, 8, 16)  # the sizes `max_batch auto` chooses from
AUTO_GAIN = 1.10  # doubling the rows must raise aggregate plain throughput this much
ROW_CONTEXT = 8192  # tokens of cache each row is budgeted for when sizing the batch (a long agent request)
MEMORY_SHARE = 0.9  # of the device's (recommended) memory, what weights and rows may use
PREFILL_PROBE = (40, 64, 88, 112)  # prompt lengths of the prefill probe (ragged, as requests arrive)
PREFILL_GAIN = 0.75  # prefilled together only where that takes at most this share of one after another


def measure(model, drafter, B: int, widths: Sequence[int], context: int = 128, rounds: int = 3,
            stop: Optional[Callable[[], bool]] = None) -> Costs:
    """Time [B, w] verifies (capture on, rolled back) and B-row drafts of w
    positions. `stop`: asked between the timed pieces (measuring.checkpoint)."""
    target = Target(model)
    capture = list(drafter.config.target_layer_ids) if drafter is not None else []
    ids = ((mx.arange(context) * 7919 + 11) % target.vocab_size).tolist()
    c = target.make_cache()  # one row prefilled alone, as the engine does; B copies of it joined
    _, feats = target(mx.array(ids)[None], c, capture)
    mx.eval([x.state for x in c])
    cache = None
    for _ in range(B):
        cache = bc.join(cache, bc.to_batch(c))
    mx.eval([x.state for x in cache])
    checkpoint(stop)
    real = drafter is not None
    dcaches = [drafter.make_cache() for _ in range(B)] if real else []
    if real:
        t, _ = drafter.propose_batch(target, [ids[-1]] * B, [feats] * B, dcaches, 2, [0.0] * B, [None] * B)
        mx.eval(t)

    def verify(w):
        t0 = time.perf_counter()
        logits, f = target(mx.zeros((B, w), mx.int32), cache, capture)
        mx.eval(mx.argmax(logits, axis=-1), *([f] if f is not None else []))
        bc.rollback(target, cache, w, [w] * B)
        return time.perf_counter() - t0

    def draft(w):
        t0 = time.perf_counter()
        t, _ = drafter.propose_batch(target, [ids[-1]] * B, [None] * B, dcaches, w, [0.0] * B, [None] * B)
        mx.eval(t)
        return time.perf_counter() - t0

    widths = sorted(set(widths) | {1})
    dw = [w for w in widths if w > 1] if real else []
    for w in widths:  # warm-up: first calls at a new shape are slow
        verify(w)
    for w in dw:
        draft(w)
    tv = {w: [] for w in widths}
    td = {w: [] for w in dw}
    for _ in range(rounds):
        checkpoint(stop)
        for w in widths:
            tv[w].append(verify(w))
        for w in dw:
            td[w].append(draft(w))
    # ratios within a round, then the median: the machine's load drifts between rounds
    c = {w: median([a / b for a, b in zip(tv[w], tv[1])]) for w in widths}
    d = {1: 0.0}
    d.update({w: median([a / b for a, b in zip(td[w], tv[1])]) if real else 0.0 for w in widths if w > 1})
    t1 = median(tv[1])
    return Costs(t1, c, d, context, time.time(), t1)


class BatchCosts:
    """k(w, B) for one model + drafter: cached curves at MEASURED_B (measured
    when first needed, or with `measure` False: Unpriced until `at(B)` measures
    them), linear in B between them."""

    def __init__(self, model, drafter, book: CostBook, widest: int, measure: bool = True):
        self.model, self.drafter, self.book, self.measure = model, drafter, book, measure
        self._missing = set()  # sizes looked up and found neither held nor cached (not read from disk again)
        self.widths = sorted({w for w in BATCH_WIDTHS if w <= widest} | {widest, 1})
        self._held: Dict[int, Dict[int, float]] = {}  # B -> {w: verify + draft}
        self._verify: Dict[int, Dict[int, float]] = {}  # B -> {w: the verify alone}
        self._t1: Dict[int, float] = {}

    def curve(self, B: int, verify: bool = False) -> Dict[int, float]:
        """{w: cost of a cycle at width w in plain batched steps} at B rows
        (`verify`: without the drafter forward, a cycle of prompt-lookup drafts)."""
        lo, hi, f = self._between(B)
        a, b = self._at(lo, verify), self._at(hi, verify)
        return {w: a[w] + f * (b[w] - a[w]) for w in self.widths}

    def plain_s(self, B: int) -> float:
        """Seconds of one plain [B, 1] step, as the curves at the sizes around B measured it."""
        lo, hi, f = self._between(B)
        for b in (lo, hi):
            self._at(b)  # (held, or Unpriced: the step's seconds come with the size's curve)
        return self._t1[lo] + f * (self._t1[hi] - self._t1[lo])

    @staticmethod
    def _between(B: int) -> tuple:
        """(lo, hi, f): the measured sizes around B, and B's place between them (costs are linear in B)."""
        lo = max([b for b in MEASURED_B if b <= B] or [1])
        hi = min([b for b in MEASURED_B if b >= B] or [MEASURED_B[-1]])
        return lo, hi, 0.0 if hi == lo else (B - lo) / (hi - lo)

    def verify_curve(self, B: int) -> Dict[int, float]:
        return self.curve(B, verify=True)

    def _at(self, B: int, verify: bool = False) -> Dict[int, float]:
        if B not in self._held:
            self._fetch(B, self.measure)
        return self._verify[B] if verify else self._held[B]

    def at(self, B: int, stop: Optional[Callable[[], bool]] = None) -> None:
        """Hold the curve at B rows (a measured size): cached, else measured now
        (`stop`: see measure)."""
        if B not in self._held:
            self._fetch(B, True, stop)

    def _fetch(self, B: int, measuring: bool, stop: Optional[Callable[[], bool]] = None) -> None:
        """Hold the curve at B rows: held by the book or cached on disk, else measured
        now (`measuring`) or Unpriced (a size found missing is not read from disk again)."""
        if not measuring and B in self._missing:
            raise Unpriced(("rows", B))
        got: Optional[Costs] = self.book.curve(self.model, self.drafter, widths=self.widths, batch=B)
        if got is None:
            if not measuring:
                self._missing.add(B)
                raise Unpriced(("rows", B))
            got = measure(self.model, self.drafter, B, self.widths, stop=stop)
            self.book.keep(self.model, self.drafter, got, batch=B)
        self._held[B] = {w: got.c[w] + got.d.get(w, 0.0) for w in self.widths}
        self._verify[B] = {w: got.c[w] for w in self.widths}
        self._t1[B] = got.t1
        self._missing.discard(B)

    def step_s(self, B: int) -> float:
        """Seconds of one plain batched step at B rows (a measured size): from
        its curve when held or cached, else a few [B, 1] steps measured alone
        (what `max_batch auto` needs at load; the widths are measured later)."""
        if B in self._t1:
            return self._t1[B]
        got = self.book.curve(self.model, self.drafter, widths=(1,), batch=B)
        if got is None:
            got = measure(self.model, self.drafter, B, [1])
            self.book.keep(self.model, self.drafter, got, batch=B)
        return got.t1


def pick_max_batch(step_s: Callable[[int], float], row_bytes: int, free_bytes: Optional[int]) -> Tuple[int, str]:
    """The largest B in AUTO_B whose plain batched step (`step_s(B)` seconds at
    B rows) still raises aggregate throughput by AUTO_GAIN over B/2, every
    doubling on the way too, and whose rows (`row_bytes` each) fit in
    `free_bytes` (None: not known). Returns (B, why it stopped there)."""
    best, why = 1, f"{AUTO_B[-1]} rows is the largest size tried"
    prev = step_s(1)
    for B in AUTO_B[1:]:
        if free_bytes is not None and B * row_bytes > free_bytes:
            why = f"{B} rows of {ROW_CONTEXT} tokens would not fit in memory"
            break
        t = step_s(B)
        gain = (B / t) / ((B // 2) / prev)
        if gain < AUTO_GAIN:
            why = f"{B} rows would raise aggregate plain throughput by {gain - 1:+.0%} over {B // 2} (< 10%)"
            break
        best, prev = B, t
    return best, why


def row_bytes(target: Target, context: int = ROW_CONTEXT) -> int:
    """A row's target cache at `context` tokens, estimated from one short prefill:
    KV layers grow per token, sliding windows up to their window, recurrent
    states are fixed."""
    cache = target.make_cache()
    n = 16
    target(mx.zeros((1, n), mx.int32), cache)
    mx.eval([c.state for c in cache])
    total = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is None:  # recurrent: fixed size
            total += c.nbytes
            continue
        per = 2 * keys[..., :1, :].nbytes  # one position, keys and values
        total += per * min(context, getattr(c, "max_size", None) or context)
    return total


def free_memory() -> Optional[int]:
    """Bytes the batch's rows may still take (None: this device does not say)."""
    info = mx.device_info()
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not limit:
        return None
    return max(0, int(limit * MEMORY_SHARE) - mx.get_active_memory())


def auto_max_batch(model, drafter, book: Optional[CostBook] = None) -> Tuple[int, str]:
    """`max_batch auto` for this model (+ drafter) on this machine: (B, a one-line
    reason). The plain batched steps come from the batch guard's curves
    (measured once per model, drafter and machine, then cached); a model that
    cannot batch gets 1 with the reason."""
    try:
        target = Target(model)
        why = bc.unsupported(target)
    except TargetError as e:
        why = str(e)
    if why:
        return 1, f"it cannot decode in a batch: {why}"
    costs = BatchCosts(model, drafter, book or CostBook(), drafter.block_size if drafter is not None else 1)
    B, why = pick_max_batch(costs.step_s, row_bytes(target), free_memory())
    return B, why


def prefill_s(target: Target, prompts, capture, together: bool) -> float:
    """Seconds to prefill `prompts` as the batch engine would: each alone (all but
    its last token, then its last), or all in one left-padded forward and one
    [B, 1] forward."""
    t0 = time.perf_counter()
    if not together:
        for p in prompts:
            c = target.make_cache()
            _, f = target(mx.array(p[:-1])[None], c, capture)
            mx.eval([x.state for x in c], *([f] if f is not None else []))
            logits, f = target(mx.array(p[-1:])[None], c, capture)
            mx.eval(logits, *([f] if f is not None else []))
        return time.perf_counter() - t0
    heads = [p[:-1] for p in prompts]
    n = max(map(len, heads))
    pad = [n - len(h) for h in heads]
    c = bc.padded(target, pad)
    _, f = target(mx.array([[0] * q + h for q, h in zip(pad, heads)]), c, capture)
    mx.eval([x.state for x in c], *([f] if f is not None else []))
    logits, f = target(mx.array([[p[-1]] for p in prompts]), c, capture)
    mx.eval(logits, *([f] if f is not None else []))
    return time.perf_counter() - t0


def prefill_together_pays(model, drafter, B: int, book: Optional[CostBook] = None) -> Tuple[bool, str]:
    """Whether B short prompts arriving together are prefilled faster in one
    batched forward than one after another here: (yes / no, a one-line
    reason). Measured once per model, drafter, machine and B (one round of
    each way after a warm-up, then cached beside the cost curves). Together,
    every row waits for the whole forward, so it must save a clear share
    (PREFILL_GAIN) to be chosen."""
    target = Target(model)
    if B < 2:
        return False, "one row at a time"
    if not bc.paddable(target):
        return False, "this target's caches cannot be left-padded (recurrent, sliding-window or quantized layers)"
    key = dict((book or CostBook()).key(model, drafter), prefill_rows=B)
    got = load_record(key, "prefill")
    if got is not None and isinstance(got.get("pays"), bool) and isinstance(got.get("why"), str):
        return got["pays"], got["why"]
    capture = list(drafter.config.target_layer_ids) if drafter is not None else []
    prompts = [((mx.arange(PREFILL_PROBE[i % len(PREFILL_PROBE)]) * 7919 + 13 * i) % target.vocab_size).tolist()
               for i in range(B)]
    prefill_s(target, prompts[:2], capture, True)  # warm-up (both ways' kernels)
    prefill_s(target, prompts[:1], capture, False)
    alone = prefill_s(target, prompts, capture, False)
    together = prefill_s(target, prompts, capture, True)
    share = together / alone
    pays = share <= PREFILL_GAIN
    why = (f"{B} new prompts prefill together in {share:.0%} of the time one after another takes "
           f"({together * 1e3:.0f} vs {alone * 1e3:.0f} ms): {'together' if pays else 'one after another'}")
    save_record(key, "prefill", {"pays": pays, "why": why})
    return pays, why
