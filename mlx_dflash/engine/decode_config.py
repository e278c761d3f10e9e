"""One generation's options (`DecodeConfig`), validated in one place and built
the same way by every app: the saved model settings, then the request's or the
command line's overrides."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional, Sequence

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from ..policy.registry import MODES, fit_block_size, plan
from ..settings.schema import check_decode_fields
from .sampling import SamplingParams



@dataclass
class DecodeConfig:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    # verify mode dflash: the guard chooses each cycle's width, from plain decoding up to the
    # drafter's trained block size (guard on), or every cycle verifies exactly block_size rows
    # (guard off). None (not given): the guard is on unless a block size is given
    block_size: Optional[int] = None  # None: 5 (policy.registry.DEFAULT_BLOCK_SIZE), at most the drafter's
    verify_mode: str = "dflash"
    stop: Optional[Sequence[str]] = None
    guard: Optional[bool] = None
    lookup: bool = True  # the guard also verifies prompt-lookup drafts where they pay
    prefill_step_size: int = 2048
    max_context: Optional[int] = None  # longer prompts decode plainly
    # mlx-lm logits processors, (tokens, logits [1, V]) -> logits, applied before sampling,
    # tokens = the prompt + the ids before that position. DFlash applies them to every row of
    # a verify (logits.py), so a processor may be called with histories that are NOT
    # extensions of the previous call's (a draft's row, then a rollback to the accepted
    # prefix; rows past a rejected draft): a stateful processor must compare `tokens` with
    # what it consumed and roll back (app/server/structured.py's Constrained does)
    logits_processors: List[Callable] = field(default_factory=list)
    logprobs: bool = False  # each response carries its step's log-probabilities (plain decoding)
    plain_reason: Optional[str] = None  # the caller's words for why this call decodes plainly
    # long context (issue 23). The drafter attends to a sink of the first drafter_sink
    # context rows plus a window of the last drafter_window (None: every row), so a
    # draft costs the same at any length; layers the checkpoint gives a sliding window
    # keep that window as published
    drafter_window: Optional[int] = 1024
    drafter_sink: int = 64
    # the target's KV cache quantized as mlx-lm's generate_step(kv_bits=...) does it:
    # each layer's cache becomes a QuantizedKVCache once it holds quantized_kv_start rows
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    # prefill_progress(done, total): called after each prefill chunk (tokens of this
    # call's uncached prompt); an exception it raises cancels the call, the prompt
    # cache keeps the chunks done
    prefill_progress: Optional[Callable[[int, int], None]] = None

    def __post_init__(self):
        if self.verify_mode not in MODES:
            raise ValueError(f"unknown verify mode '{self.verify_mode}'; valid: {', '.join(MODES)}")
        self.sampling()  # validates temperature, top_p, top_k, min_p
        check_decode_fields(self)  # the checks the model settings make of the same fields
        if self.prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)

    @property
    def guarded(self) -> bool:
        """Whether the guard chooses the width (verify mode dflash)."""
        return self.guard if self.guard is not None else self.block_size is None

    @property
    def needs_plain(self) -> Optional[str]:
        """Why this call must decode plainly, or None (logits processors do not:
        the verify applies them per row)."""
        if self.plain_reason:
            return self.plain_reason
        return "logprobs requested (plain decoding reports them per step)" if self.logprobs else None

    @property
    def drafter_layout(self) -> tuple:
        """The drafter context's (window, sink) (Drafter.make_cache)."""
        return (self.drafter_window, self.drafter_sink if self.drafter_window is not None else 0)

    def keeps_drafter_context(self, drafter, prompt_tokens: int) -> bool:
        """Whether decoding a prompt of that many tokens grows a drafter context
        (what a prompt store entry must cover to be reused for it)."""
        return plan(self, drafter, prompt_tokens).drafter

    def needs_costs(self, drafter, prompt_tokens: int) -> bool:
        """Whether the guard prices this call's cycles (from measured costs)."""
        return plan(self, drafter, prompt_tokens).guarded

    @classmethod
    def from_settings(cls, settings, drafter=None, **overrides) -> "DecodeConfig":
        """The model's saved settings (`ModelSettings.generation_kwargs()`), its
        block size fitted to `drafter` (registry.fit_block_size: the width's one
        owner), then `overrides` (None values mean "not given": the saved setting
        stays; a block size given here must fit the drafter)."""
        kw = dict(settings.generation_kwargs())
        if drafter is not None and kw.get("block_size"):
            kw["block_size"] = fit_block_size(kw["block_size"], drafter.block_size, explicit=False)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown decode option(s): {', '.join(unknown)}")
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in kw.items() if k in names})
