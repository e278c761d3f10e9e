"""What the decode session reports (per cycle, per generation) and the token
bookkeeping every mode shares (EOS, stop strings, max tokens, streamed text).
The session (decoder.Decoder) is the only writer of GenerationStats."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..policy.base import CycleResult


def width_text(guard: bool, max_width: int, width: int = 0) -> str:
    """The width, said once, as the status line and the logs say it: the rule
    (`guard <=16`: the guard chooses each cycle's width up to the drafter's
    trained block size; `fixed w5`: the guard off, every cycle verifies the
    block size) and, with the guard, what the last cycle verified (`w8 now`,
    `plain now`; nothing before the first cycle)."""
    if not guard:
        return f"fixed w{max_width}"
    now = "" if not width else " · plain now" if width == 1 else f" · w{width} now"
    return f"guard \u2264{max_width}{now}"


@dataclass
class GenerationStats:
    mode: str = "dflash"  # dflash | adaptive | lookup | off
    fallback: Optional[str] = None  # why DFlash was not used, if it was asked for
    # the width, said twice: the widest a cycle of this call may verify (the guard's ceiling, the
    # drafter's trained block size; or, the guard off, the fixed width) and what the last cycle verified
    max_width: int = 0
    width: int = 0  # (1: a plain step)
    guard: bool = False  # the guard chooses each cycle's width (else: fixed, or plain)
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from a prompt cache
    generation_tokens: int = 0
    cycles: int = 0
    plain_cycles: int = 0  # cycles that verified the anchor alone (policy fallback)
    drafted: int = 0
    accepted: int = 0
    cycle_tokens: int = 0  # tokens emitted by verify cycles (excludes the prefill token)
    prompt_time: float = 0.0
    generation_time: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_book: float = 0.0
    peak_memory: float = 0.0  # GB
    adaptive: Optional[dict] = None  # the width policy's state (AdaptiveWidth / Guard summary)
    policy: str = ""  # what decides the width and why, in a few words ("plain: DFlash 0.8x predicted ...")
    lookup_cycles: int = 0  # cycles whose drafts came from prompt lookup
    distributed: Optional[dict] = None  # a split target: ranks, split, collectives and their time (distributed.py)
    prompt_cache: Optional[dict] = None  # where the reused prefix came from: the prompt store's tier, load time

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify (accepted drafts + the bonus)."""
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens per second after the first token (the prefill's own)."""
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0

    def width_text(self) -> str:
        return width_text(self.guard, self.max_width, self.width)

    def add(self, c: CycleResult) -> None:
        self.cycles += 1
        self.width = c.width
        self.plain_cycles += c.width == 1
        self.lookup_cycles += c.source == "lookup"
        self.drafted += c.width - 1
        self.accepted += c.accepted
        self.cycle_tokens += c.emitted
        self.t_draft += c.t_draft
        self.t_verify += c.t_verify
        self.t_book += c.t_book

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, prompt_tps=self.prompt_tps,
                 generation_tps=self.generation_tps, tokens_per_second=self.generation_tps)
        return d


@dataclass
class GenerationResponse:
    text: str  # new text segment (may be empty)
    token: int
    from_draft: bool  # an accepted draft token (False: the target's own token)
    finish_reason: Optional[str]  # None, "stop" or "length"
    stats: GenerationStats
    cycle: Optional[CycleResult] = None  # the cycle that produced this token
    logprobs: object = None  # mx.array [V]: this step's log-probabilities (DecodeConfig.logprobs)
