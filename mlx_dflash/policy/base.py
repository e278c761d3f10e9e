"""The policy interface: what a decode engine asks each cycle (`next(state)`
-> `Plain(n)` or `Draft(width, source)`) and reports after it
(`observe(CycleResult)`), and the simple policies (fixed width, lookup first,
plain). Policies are pure: numbers in, decisions out; no model in here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .costs import Observed

DFLASH, LOOKUP = "dflash", "lookup"  # draft sources


@dataclass
class CycleResult:
    """One draft + verify cycle (or one plain step: width 1), as the session
    saw it: what the policy observes and the stats add up."""

    width: int  # verify width w: anchor + w-1 drafts
    accepted: int  # drafts accepted
    emitted: int  # tokens this cycle produced (accepted + bonus, less any cut by a stop)
    t_draft: float = 0.0  # host time building the draft (it is computed with the verify)
    t_verify: float = 0.0  # draft + verify compute and the one readback
    t_book: float = 0.0
    source: str = ""  # "dflash" | "lookup" | "" (plain)
    t_wait: float = 0.0  # of t_verify: blocked in the readback (compute not hidden behind the host)
    conf: Optional[list] = None  # the verified drafts' confidences, when the policy read them (adaptive)

@dataclass(frozen=True)
class Plain:
    """Decode plainly: at most n more tokens (None: until the policy says otherwise)."""

    n: Optional[int] = None


@dataclass(frozen=True)
class Draft:
    """Draft `width - 1` tokens from `source` and verify them with the anchor."""

    width: int
    source: str = DFLASH


@dataclass
class LoopState:
    """What a policy may look at when it decides: tokens left before max_tokens
    and what each draft source offers now (`sources[name](n)`: how many of n
    drafts it can propose; DFlash offers all n, lookup what the context repeats)."""

    left: int
    sources: Dict[str, Callable[[int], int]]
    in_plain: bool = False  # asked between two plain tokens (a plain run is under way)
    context: int = 0  # tokens cached (0: not told)

    def offers(self, source: str, n: int) -> int:
        f = self.sources.get(source)
        return f(n) if f is not None and n > 0 else 0


class Policy:
    """The interface the decode session drives. `reason` says in a few words
    what decided the last choice and why (GenerationStats.policy)."""

    reason: str = ""
    reads_confidence = False  # `trim` needs the drafts' confidences read back (one extra sync)
    uses_drafter = True  # may ask for DFlash drafts (else a one-shot call captures no features)
    uses_lookup = False  # may ask for prompt-lookup drafts (the session keeps an n-gram index)
    widest = 0  # the widest verify it may ask for (0: none)

    def next(self, state: LoopState):
        raise NotImplementedError

    def observe(self, result: CycleResult) -> None:
        """A cycle (or one plain token: width 1, source "") ended."""

    def trim(self, tokens: list, conf: list) -> int:
        """How many of the proposed drafts to verify (all, unless the policy cuts)."""
        return len(tokens)

    def observed(self) -> Optional[Observed]:
        """What to carry to the next request on the same model objects (None: nothing)."""
        return None

    def summary(self) -> Optional[dict]:
        """The policy's state for the stats (GenerationStats.adaptive)."""
        return None


class PlainOnly(Policy):
    """Verify mode off: plain decoding, pipelined like mlx-lm."""

    uses_drafter = False

    def __init__(self, why: str = "verify mode off"):
        self.reason = f"plain: {why}"

    def next(self, state: LoopState):
        return Plain()


class Fixed(Policy):
    """Verify width w on every cycle, DFlash drafts: what the user set, exactly."""

    def __init__(self, width: int):
        self.w = self.widest = width
        self.reason = f"fixed width {width}"

    def next(self, state: LoopState):
        return Draft(self.w, DFLASH)


class LookupFirst(Policy):
    """Verify mode lookup: prompt-lookup drafts at width w (lookup.py). With a
    drafter, lookup where the context has a full-width match, DFlash elsewhere;
    without one, lookup wherever the context matches, plain decoding between."""

    def __init__(self, width: int, with_drafter: bool):
        self.w, self.dflash, self.widest = width, with_drafter, width
        self.uses_drafter, self.uses_lookup = with_drafter, True
        self.reason = f"lookup width {width}" + (" (else DFlash)" if with_drafter else "")

    def next(self, state: LoopState):
        n = state.offers(LOOKUP, self.w - 1)
        if n and (not self.dflash or n == self.w - 1):
            return Draft(n + 1, LOOKUP)
        return Draft(self.w, DFLASH) if self.dflash else Plain()
