"""The policy interface: what the decode engine asks before each cycle of the
set of sequences it runs (`decide(rows)` -> a `Decision`: one verify width for
the set and each row's draft source) and reports after it (`observe(rows,
results)`, one `CycleResult` per row). A single stream is a set of one.

What a policy may read of a row (the engine's Sequence) is `Row`: its plan
(what it may draft with and how wide: registry.plan), tokens left, context
length, and what a draft source offers it now and of what grade. Policies are
pure: numbers in, decisions out; no model in here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

from .costs import Observed

DFLASH, LOOKUP = "dflash", "lookup"  # draft sources (drafting/proposers.py)


@dataclass
class CycleResult:
    """One row's share of a draft + verify cycle (or of one plain step: width 1),
    as the engine saw it: what the policy observes and the stats add up."""

    width: int  # verify width of the row: anchor + width-1 drafts
    accepted: int  # drafts accepted
    emitted: int  # tokens this cycle produced (accepted + bonus, less any cut by a stop)
    t_draft: float = 0.0  # host time building the draft (it is computed with the verify)
    t_verify: float = 0.0  # draft + verify compute and the one readback
    t_book: float = 0.0
    source: str = ""  # "dflash" | "lookup" | "" (plain)
    t_wait: float = 0.0  # of t_verify: blocked in the readback (compute not hidden behind the host)
    conf: Optional[list] = None  # the verified drafts' confidences, when the policy read them (adaptive)
    t_step: float = 0.0  # wall time since the engine's previous step was accounted: all it cost (0: unknown)


@dataclass(frozen=True)
class Plan:
    """What one sequence may draft with, decided once when it starts
    (registry.plan): the rule every path shares."""

    mode: str  # the verify mode that runs: dflash | adaptive | lookup | off
    cap: int = 1  # its widest verify (1: it never drafts)
    fixed: bool = False  # it verifies exactly `cap` rows whenever it drafts (an unguarded width)
    drafter: bool = False  # the DFlash drafter drafts for it (its features are captured)
    lookup: bool = False  # it may verify prompt-lookup drafts (an n-gram index of its tokens is kept)
    fallback: Optional[str] = None  # why it runs another mode than it asked for
    carry: bool = True  # the guard's state carries to and from other requests (not a seeded call)

    @property
    def drafts(self) -> bool:
        return self.cap > 1

    @property
    def guarded(self) -> bool:
        """The guard chooses its widths (it drafts, at no fixed width): what needs measured costs."""
        return self.drafts and not self.fixed


class Row(Protocol):
    """What a policy reads of a sequence."""

    uid: int
    plan: Plan

    @property
    def left(self) -> int:  # tokens before max_tokens
        ...

    @property
    def context(self) -> int:  # tokens in its cache
        ...

    @property
    def unseen(self) -> int:  # context rows the drafter takes in at its next draft (its catch-up)
        ...

    def offers(self, source: str, n: int) -> int:  # how many of n drafts `source` can propose now
        ...

    def grade(self, source: str) -> int:  # what its offer rests on now (lookup: the n-gram match's length)
        ...


@dataclass(frozen=True)
class Decision:
    """One cycle of the set: row b verifies `widths[b]` rows (its anchor and
    widths[b] - 1 drafts from `sources[b]`: DFLASH, LOOKUP, or "" for its anchor
    alone). All widths 1 is a plain step: `steps` of them may run, pipelined,
    before the policy is asked again (None: until it says otherwise; it is
    still asked between tokens)."""

    widths: Tuple[int, ...]
    sources: Tuple[str, ...]
    steps: Optional[int] = None

    @property
    def width(self) -> int:
        return max(self.widths, default=1)

    @classmethod
    def plain(cls, rows: Sequence[Row], steps: Optional[int] = None) -> "Decision":
        return cls((1,) * len(rows), ("",) * len(rows), steps)


class Policy:
    """The interface the engine drives (one instance per engine: per-row state
    is keyed by the row's uid). `reason(row)` says in a few words what decided
    the last choice for that row and why (GenerationStats.policy)."""

    reads_confidence = False  # `trim` needs the drafts' confidences read back (one extra sync)

    def decide(self, rows: Sequence[Row]) -> Decision:
        raise NotImplementedError

    def observe(self, rows: Sequence[Row], results: List[CycleResult]) -> None:
        """A cycle (or one plain step) ended; results[b] is row b's."""

    def trim(self, row: Row, tokens: list, conf: list) -> int:
        """How many of the proposed drafts to verify (all, unless the policy cuts)."""
        return len(tokens)

    def uses_drafter(self, plan: Plan, context: int) -> bool:
        """Whether the DFlash drafter may draft for a row of this plan and prompt
        length (else a one-shot call captures no features)."""
        return plan.drafter

    def leave(self, row: Row) -> Optional[Observed]:
        """The row is done: forget it; what to carry to the next request on the
        same model objects (None: nothing)."""
        return None

    def reason(self, row: Row) -> str:
        return ""

    def summary(self, row: Row) -> Optional[dict]:
        """The policy's state for the row's stats (GenerationStats.adaptive)."""
        return None

