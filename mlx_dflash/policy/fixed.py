"""The fixed-width policy: every drafting row verifies the same width each
cycle, whatever it costs (the benchmarks' side-by-side widths, and the
reference the guard is measured against)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .base import DFLASH, LOOKUP, CycleResult, Decision, Policy, Row
from .costs import Observed
from .lookup_gate import LookupTally


class FixedWidth(Policy):
    """Every row that drafts verifies `width` rows each cycle (at most its own
    widest), from prompt lookup where the row may look up and its context
    offers a full block, else from the drafter: whatever it costs. A
    benchmark's fixed width (the side-by-side runs at width w), and the
    reference a guard is measured against."""

    def __init__(self, width: int):
        self.width = width
        self.tallies: Dict[int, LookupTally] = {}  # uid -> its lookup cycles (for the reason)

    def decide(self, rows: Sequence[Row]) -> Decision:
        widths, sources = [], []
        for r in rows:
            w = min(self.width, r.plan.cap, r.left + 1) if r.plan.drafts else 1
            src = ""
            if w > 1 and r.plan.lookup and r.offers(LOOKUP, w - 1) == w - 1:
                src = LOOKUP
            elif w > 1 and r.plan.drafter:
                src = DFLASH
            widths.append(w if src else 1)
            sources.append(src)
        return Decision(tuple(widths), tuple(sources))

    def observe(self, rows: Sequence[Row], results: List[CycleResult]) -> None:
        for r, res in zip(rows, results):
            if res.source == LOOKUP:
                self.tallies.setdefault(r.uid, LookupTally()).add(res.accepted, res.width - 1)

    def leave(self, row: Row) -> Optional[Observed]:
        self.tallies.pop(row.uid, None)
        return None

    def reason(self, row: Row) -> str:
        if not row.plan.drafts:
            return f"plain: {row.plan.fallback or 'verify mode off'}"
        t = self.tallies.get(row.uid)
        return f"fixed width {min(self.width, row.plan.cap)}" + (t.tail() if t is not None else "")
