"""Where an engine's guard gets its prices: `CostSource` makes the CostModel
(policy/costs.py) for one model + drafter from the curves calibrate.py
(by context length) and batch_costs.py (by batch size) measure.

A curve that is neither held nor cached on disk is got one of two ways:
- measured at first need (`defer` False: a library call, where the call is
  the user's own; `generate` and the chat measure at load: `prepare_at_load`);
- deferred (the server): pricing raises Unpriced, so the guard decodes plain
  meanwhile (never slower than plain), and the curve joins `wanted`, which the
  server measures while it is idle (`measure_next`). Nothing is then ever
  measured inside a request: a first burst of requests is decoded plainly in
  one batch while the curves it needs are missing, never slower than serving
  the requests one after another."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

from ..policy.costs import CostModel, Costs, Unpriced, curve_name
from ..policy.registry import GUARD_CALIBRATION, guard_widths, priced_at
from .batch_costs import MEASURED_B, BatchCosts
from .measuring import Interrupted

PREPARED_CONTEXTS = (1024, 4096, 16384)  # long curves worth having before the first long request (agents send
# 10-30k tokens); 65536 is measured when a request that long first needs it


class CostSource:
    """The guard's prices for one engine. `batched`: the engine decodes sets of
    several rows (priced by batch size too); `defer`: see the module docstring."""

    def __init__(self, model, drafter, calibration, batched: bool = False, defer: bool = False):
        self.model, self.drafter, self.calibration, self.defer = model, drafter, calibration, defer
        cap = drafter.block_size
        self.widths = guard_widths(cap)
        self.enough = (1, min(5, cap))  # a curve held with these widths will do (the guard chooses among its own)
        self.rows = BatchCosts(model, drafter, calibration.book, cap, measure=not defer) if batched else None
        self.wanted: List[tuple] = []  # Unpriced keys, in the order they are to be measured
        self._missing = set()  # length keys looked up and found neither held nor cached (not read again)
        self._failed = set()  # keys whose measurement failed: not asked for again (plain where they are needed)

    def cost_model(self) -> CostModel:
        """The CostModel over these curves (Unpriced while the base curve is missing and deferred)."""
        return CostModel(self._curve, self.widths, self._batch if self.rows is not None else None, priced_at)

    def _curve(self, at: Optional[int]) -> Costs:
        key = ("length", at)
        if not self.defer:
            return self._measure_curve(at)
        got = None if key in self._missing else \
            self.calibration.book.curve(self.model, self.drafter, 0, self.enough, at)
        if got is None:
            self._missing.add(key)
            self.want(key, first=True)
            raise Unpriced(key)
        return got

    def _measure_curve(self, at: Optional[int], stop: Optional[Callable[[], bool]] = None) -> Costs:
        opts = dict(GUARD_CALIBRATION, context=at) if at is not None else dict(GUARD_CALIBRATION)
        if stop is not None:
            opts["stop"] = stop
        return self.calibration.costs(self.model, self.drafter, widths=self.widths, enough=self.enough, at=at,
                                      **opts)

    def _batch(self, B: int) -> Costs:
        """A B-row set's curve in units of a plain [B, 1] step, that step's seconds its t1 (CostModel's `batch`)."""
        try:
            v, t = self.rows.verify_curve(B), self.rows.curve(B)
        except Unpriced as e:
            self.want(e.key, first=True)
            raise
        return Costs(self.rows.plain_s(B), v, {w: t[w] - v[w] for w in v})

    # -- measuring ahead of the requests ---------------------------------------------------
    def want(self, key: tuple, first: bool = False) -> None:
        """Queue a curve (`first`: a request is waiting for it: before the others)."""
        if key in self._failed:
            return
        if key in self.wanted:
            if not first:
                return
            self.wanted.remove(key)
        self.wanted.insert(0, key) if first else self.wanted.append(key)

    def prepare(self, max_batch: int = 1, contexts: Sequence[int] = PREPARED_CONTEXTS) -> None:
        """Queue what the guard will likely need: the base curve, the batch sizes
        up to `max_batch` (and the measured size above it), the long curves."""
        self.want(("length", None))
        if self.rows is not None:
            top = min([b for b in MEASURED_B if b >= max_batch] or [MEASURED_B[-1]])
            for b in MEASURED_B:
                if 2 <= b <= top:
                    self.want(("rows", b))
        for n in contexts:
            self.want(("length", priced_at(n)))

    def held(self, key: tuple) -> bool:
        """Whether the curve of `key` is held or cached on disk."""
        kind, n = key
        if kind == "length":
            return self.calibration.book.curve(self.model, self.drafter, 0, self.enough, n) is not None
        return self.calibration.book.curve(self.model, self.drafter, widths=self.rows.widths, batch=n) is not None

    def measure_next(self, stop: Optional[Callable[[], bool]] = None) -> Optional[tuple]:
        """Get the first wanted curve (cached, else measured now): (what, seconds,
        whether it was measured), or None when nothing is wanted. `stop`: asked
        between the timed pieces; when it says so the curve stays first in line
        and measuring.Interrupted is raised."""
        if not self.wanted:
            return None
        key = self.wanted[0]
        t0, fresh = time.perf_counter(), not self.held(key)
        kind, n = key
        try:
            if kind == "length":
                self._measure_curve(n, stop)
                self._missing.discard(key)
            else:
                self.rows.at(n, stop)
        except Interrupted:
            raise
        except Exception:
            self.wanted.remove(key)
            self._failed.add(key)  # (not asked again: the guard stays plain where it lacks it)
            raise
        self.wanted.remove(key)
        return curve_name(key), time.perf_counter() - t0, fresh


def prepare_at_load(model, drafter, calibration, contexts: Sequence[int] = ()) -> Optional[str]:
    """What `generate` and the chat measure right after loading: the base curve
    and the long curves for `contexts`, so that their answers measure nothing
    (cached per model, drafter and machine: only a first load measures). A line
    for the log when something was measured, else None."""
    if drafter is None:
        return None
    src = CostSource(model, drafter, calibration)
    src.prepare(contexts=contexts)
    got = []
    while (one := src.measure_next()) is not None:
        got.append(one)
    fresh = [what for what, _, new in got if new]
    if not fresh:
        return None
    return (f"measured the guard's costs on this machine once ({', '.join(fresh)}) in "
            f"{sum(s for _, s, _ in got):.1f} s; cached for the next loads")
