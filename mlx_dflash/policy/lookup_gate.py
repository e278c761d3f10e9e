"""One row's prompt-lookup gate: whether verifying a lookup proposal (the
continuation of an n-gram the row's context has seen) pays, from the row's live
share of lookup drafts accepted, kept apart by the proposal's grade: the length
of the n-gram it matched. A 2-token match is mostly chance, a 4-token one mostly
a copy: over 11 prompts 17% of the drafts after a 2-token match were right, 28%
after a 3-token one, 79% after a 4-token one (bench/short_answers/ngram_shares.log),
so one share for all would price a chance match at what copies earn. The guard
(guard.py) asks it for its rows; `LookupTally` counts what a row's lookup cycles
gave, for the stats of the guard and of a fixed width (fixed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass
class LookupTally:
    """A row's lookup cycles and their drafts, as verified."""

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, accepted: int, n: int) -> None:
        self.cycles += 1
        self.drafted += n
        self.accepted += accepted

    def tail(self) -> str:
        """Its part of a row's reason."""
        return f"; lookup: {self.cycles} cycles, {self.accepted / self.drafted:.0%} accepted" \
            if self.drafted else ""


class LookupGate:
    """One row's prompt-lookup gate. A lookup proposal of n drafts costs a verify
    of n + 1 rows and nothing to draft; it pays when the expected tokens
    1 + alpha * n reach that cost in plain steps, by MARGIN, plus SWITCH (the
    plain run it cuts short drains its pipeline and starts a new one). alpha is
    the share accepted at the proposal's grade (the module docstring): it starts
    at ALPHA0 (or the last request's) and follows the live acceptance at that
    grade; while lookup does not pay, every GAP-th match is verified anyway, so
    a text that starts repeating itself is noticed."""

    ALPHA0, RATE, GAP = 0.5, 0.2, 16
    MARGIN, SWITCH = 1.1, 0.5  # measured: bf16 on mlx-cpu, where a verify of 5 costs ~2.6 plain
    # tokens, lookup at 40% acceptance cost 3-5% without them

    def __init__(self, alpha: Optional[Dict[int, float]] = None):
        self.skipped = 0
        self.alpha: Dict[int, float] = dict(alpha or {})  # grade -> share of its drafts accepted
        self.tally = LookupTally()

    def rate(self, grade: int) -> float:
        """The share of drafts accepted expected of a proposal of this grade: its
        own, never above a longer match's (a longer match is the likelier copy),
        so text where even long matches fail (random ids, hashes) stops short
        ones too, and the prior (ALPHA0) where a grade has none yet."""
        longer = [a for g, a in self.alpha.items() if g > grade]
        return min([self.alpha.get(grade, self.ALPHA0)] + longer)

    def tokens(self, n: int, grade: int) -> float:
        """Expected tokens of a cycle verifying n lookup drafts of this grade (the bonus included)."""
        return 1 + self.rate(grade) * n

    @classmethod
    def cycle_pays(cls, tokens: float, rows: int, cost: float) -> bool:
        """Whether a cycle of `rows` rows that yields `tokens` (each row's own token
        included) and costs `cost` plain steps of those rows pays (a plain step
        yields one token a row)."""
        return tokens >= rows * (cls.MARGIN * cost + cls.SWITCH)

    def pays(self, n: int, grade: int, kv: Dict[int, float], rate: Optional[float] = None) -> bool:
        """Whether verifying n lookup drafts of this grade (one row alone) beats
        what the row would do instead: plain steps (rate None), or a DFlash cycle
        yielding `rate` tokens per plain step's time (its tau / k_drafting(w))."""
        if n < 1:
            return False
        if rate is None:
            return self.cycle_pays(self.tokens(n, grade), 1, kv[n + 1])
        return self.tokens(n, grade) > rate * kv[n + 1]

    def explore(self, rows: int = 1, cost: float = 1.0) -> bool:
        """A proposal skipped: True on every (GAP x rows x cost)-th skip, so a text
        that starts repeating itself is noticed, at about 1/GAP of the time at
        any length and batch size: `cost` is the exploring verify's price in plain
        steps (it grows with the context), and each of `rows` rows explores at
        1/rows of the pace (a cycle made for one row's lookup costs every row a verify)."""
        self.skipped += 1
        if self.skipped >= self.GAP * rows * max(1.0, cost):
            self.skipped = 0
            return True
        return False

    def take(self, n: int, grade: int, kv: Dict[int, float], rate: Optional[float] = None) -> bool:
        """Verify this n-draft proposal of this grade (one row alone)? (Counts the
        skips of a gate that does not pay; an explore in place of a DFlash cycle
        loses up to `rate` tokens per plain step's time, so it comes that much more rarely.)"""
        return n >= 1 and (self.pays(n, grade, kv, rate) or
                           self.explore(cost=kv[n + 1] * max(1.0, rate or 1.0)))

    def observe(self, accepted: int, n: int, grade: int) -> None:
        self.tally.add(accepted, n)
        self.alpha[grade] = self.rate(grade) + self.RATE * (accepted / n - self.rate(grade))

    def tail(self) -> str:
        """Its part of a row's reason."""
        return self.tally.tail()
