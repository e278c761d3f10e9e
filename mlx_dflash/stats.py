"""What the decode session reports (per cycle, per generation) and the token
bookkeeping every mode shares (EOS, stop strings, max tokens, streamed text).
The session (decoder.Decoder) is the only writer of GenerationStats."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple


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


@dataclass
class GenerationStats:
    mode: str = "dflash"  # dflash | adaptive | lookup | off
    fallback: Optional[str] = None  # why DFlash was not used, if it was asked for
    block_size: int = 0
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

    def add(self, c: CycleResult) -> None:
        self.cycles += 1
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


class Emitter:
    """Token bookkeeping shared by every mode: EOS, stop strings (also across a
    block), max tokens, and text held back while it may begin a stop string.
    Only the unsent tail of the text is kept: per-token work does not grow
    with the length of the answer. `push` returns (text to send, finish reason)."""

    def __init__(self, tokenizer, stop: Optional[Sequence[str]], max_tokens: int):
        # without a tokenizer (calibration, token-id sessions): no text and no EOS
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.max_tokens = max_tokens
        self.tokens: List[int] = []
        self.buf = ""  # text not yet sent (at most `hold` chars between tokens)
        self.done = False

    @property
    def left(self) -> int:
        return self.max_tokens - len(self.tokens)

    def push(self, token: int) -> Tuple[str, Optional[str]]:
        """Account one token; sets self.done when generation must end."""
        if token in self.eos:
            return self._final("stop")
        self.tokens.append(token)
        if self.detok is not None:
            self.detok.add_token(token)
            self.buf += self.detok.last_segment
        if self.stop:
            # a stop string ending in the new text starts within the held-back tail
            hits = [i for i in (self.buf.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.buf = self.buf[: min(hits)]
                return self._final("stop", flush=False)
        if len(self.tokens) >= self.max_tokens:
            return self._final("length")
        cut = max(0, len(self.buf) - self.hold) if self.stop else len(self.buf)
        text, self.buf = self.buf[:cut], self.buf[cut:]
        return text, None

    def _final(self, reason, flush=True):
        self.done = True
        if flush and self.detok is not None:
            self.detok.finalize()
            self.buf += self.detok.last_segment
        text, self.buf = self.buf, ""
        return text, reason
