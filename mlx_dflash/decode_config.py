"""One generation's options (`DecodeConfig`), validated in one place and built
the same way by every app: the saved model settings, then the request's or the
command line's overrides."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional, Sequence

from .modes import DEFAULT_BLOCK_SIZE, POLICIES
from .sampling import SamplingParams


@dataclass
class DecodeConfig:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    block_size: Optional[int] = None  # verify width; None: the default (5, guarded)
    verify_mode: str = "dflash"
    stop: Optional[Sequence[str]] = None
    # verify mode dflash: None = guarded at the default width only; True / False force it
    guard: Optional[bool] = None
    lookup: bool = True  # the guard also verifies prompt-lookup drafts where they pay
    prefill_step_size: int = 2048
    max_context: Optional[int] = None  # longer prompts decode plainly
    # mlx-lm logits processors, (tokens, logits [1, V]) -> logits, applied before sampling;
    # they see one position at a time, so a call with any decodes plainly
    logits_processors: List[Callable] = field(default_factory=list)
    logprobs: bool = False  # each response carries its step's log-probabilities (plain decoding)
    plain_reason: Optional[str] = None  # the caller's words for why this call decodes plainly

    def __post_init__(self):
        if self.verify_mode not in POLICIES:
            raise ValueError(f"unknown verify mode '{self.verify_mode}'; valid: {', '.join(POLICIES)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        self.sampling()  # validates temperature, top_p, top_k, min_p

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)

    @property
    def default_width(self) -> bool:
        return self.block_size in (None, DEFAULT_BLOCK_SIZE)

    @property
    def needs_plain(self) -> Optional[str]:
        """Why this call must decode plainly, or None."""
        if self.plain_reason:
            return self.plain_reason
        why = (["logprobs"] if self.logprobs else []) + (["logits processors"] if self.logits_processors else [])
        return f"{' and '.join(why)} requested (plain decoding applies them)" if why else None

    def width(self, limit: int, what: str) -> int:
        """The verify width, checked against `limit` (the drafter's trained block size)."""
        w = self.block_size or min(DEFAULT_BLOCK_SIZE, limit)
        if not 1 <= w <= limit:
            raise ValueError(f"block size {w} must be between 1 and {what} {limit}")
        return w

    @classmethod
    def from_settings(cls, settings, drafter=None, **overrides) -> "DecodeConfig":
        """The model's saved settings (`ModelSettings.generation_kwargs()`), its
        block size fitted to `drafter` as loading fits it, then `overrides` (None
        values mean "not given": the saved setting stays)."""
        kw = dict(settings.generation_kwargs())
        if drafter is not None and kw.get("block_size"):
            kw["block_size"] = min(kw["block_size"], drafter.block_size)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown decode option(s): {', '.join(unknown)}")
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in kw.items() if k in names})
