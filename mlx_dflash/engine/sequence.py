"""One request's state in the engine (engine.py): everything that is per
request. Its caches live in its PromptCache while it prefills, runs alone or
rests (`pc.target`), and in the engine's batch cache while it shares a cycle
with others; its drafter context and the features of its rows the drafter has
not seen yet (`pending`) are its own, as is its n-gram index (`pc.index`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx

from ..cache.prompt_cache import PromptCache
from ..drafting.drafter import taken_in
from ..policy.base import Plan
from .decode_config import DecodeConfig
from .emitter import Emitter
from .sampling import SamplingParams
from .stats import GenerationStats


def cat_feats(feats) -> Optional[mx.array]:
    """Concatenate captured feature blocks [1, n_i, F] (None entries skipped)."""
    feats = [x for x in feats if x is not None]
    return mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None)


@dataclass(eq=False)
class Sequence:
    uid: int
    config: DecodeConfig
    plan: Plan
    sp: SamplingParams
    emit: Emitter
    stats: GenerationStats
    pc: PromptCache  # its caches (pc.target: None while its rows are in the engine's batch cache)
    rest: List[int]  # prompt tokens not prefilled yet
    capture: bool  # its target features are captured: its drafter context grows
    returned: bool = False  # its caller handed it the prompt cache and takes it back (Engine.released)
    key: Optional[mx.array] = None  # sampled: its own PRNG key, so its draws do not depend on other rows
    pending: List[mx.array] = field(default_factory=list)  # features of its fed rows the drafter has not seen
    anchor: int = -1  # the last token emitted (its K/V not cached yet)
    hist: Optional[mx.array] = None  # with logits processors: the prompt + the ids before the anchor
    policy: object = None  # the policy deciding its cycles (the engine's guard, or its own: adaptive)
    sources: Dict[str, object] = field(default_factory=dict)  # name -> the draft source it may use (proposers.py)
    cancelled: bool = False
    t_start: float = field(default_factory=time.perf_counter)
    t_gen: float = 0.0

    # -- what a policy reads (policy.base.Row) ---------------------------------------------
    @property
    def left(self) -> int:
        return self.emit.left

    @property
    def context(self) -> int:
        return len(self.pc.tokens)

    @property
    def unseen(self) -> int:
        """Context rows its next draft takes in first (the drafter's catch-up)."""
        n = sum(f.shape[1] for f in self.pending if f is not None)
        return taken_in(self.pc.drafter, n) if self.pc.drafter else n

    def offers(self, source: str, n: int) -> int:
        pr = self.sources.get(source)
        return pr.offers(self, n) if pr is not None and n > 0 else 0

    def grade(self, source: str) -> int:
        pr = self.sources.get(source)
        return pr.grade(self) if pr is not None else 0

    # -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.cancelled or self.emit.done

    def next_key(self) -> Optional[mx.array]:
        if self.key is None:
            return None
        self.key, k = mx.random.split(self.key)
        return k

    def take_pending(self) -> Optional[mx.array]:
        """Its unseen features, for the drafter (which takes them into its context)."""
        f = cat_feats(self.pending)
        self.pending.clear()
        return f
