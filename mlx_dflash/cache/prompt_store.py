"""Prompt cache across requests: several cached prefixes at once (target KV /
recurrent state + drafter context), LRU under a memory budget, matched to a new
prompt by the longest common prefix of token ids.

The decode loop works on one `PromptCache` and mutates it. `take` hands out an
entry the store no longer holds (a deep copy, or the entry itself when the new
prompt simply continues it), so a generation never changes what is stored;
`put` gives the finished cache back, evaluated: the server's threads share
the store and MLX's streams are per thread, so no entry may hold lazy arrays
(a lone request's pending features, say) for another thread to evaluate."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..target.adapter import Target
from .prompt_cache import PromptCache, common_prefix, reusable


def _nbytes(caches) -> int:
    n = 0
    for c in caches or ():
        try:
            n += int(c.nbytes)
        except (AttributeError, NotImplementedError):  # a cache type without nbytes: count its arrays
            n += sum(int(getattr(a, "nbytes", 0)) for a in _arrays(c.state))
    return n


def _arrays(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _arrays(y)
    elif x is not None:
        yield x


def _evaluate(pc: PromptCache) -> None:
    """Every array `pc` holds (any cache kind's attributes: mlx-lm's, the drafter's context)."""
    held = [list(vars(c).values()) for c in list(pc.target or ()) + list(pc.drafter or ())]
    mx.eval([a for a in _arrays([held, pc.pending]) if isinstance(a, mx.array)])


def cache_bytes(pc: PromptCache) -> int:
    pending = int(pc.pending.nbytes) if pc.pending is not None else 0
    return _nbytes(pc.target) + _nbytes(pc.drafter) + pending


def _reach(pc: PromptCache) -> Tuple[int, int]:
    """(tokens cached, tokens the drafter context covers as rows or pending features)."""
    rows = pc.drafter[0].offset + (pc.pending.shape[1] if pc.pending is not None else 0) if pc.drafter else -1
    return len(pc.tokens), rows


def _covers(a: PromptCache, b: PromptCache) -> bool:
    """Whether trimming `a` serves every prompt `b` serves (b's tokens and
    drafter rows are a prefix of a's)."""
    (na, da), (nb, db) = _reach(a), _reach(b)
    return nb <= na and db <= da and common_prefix(b.tokens, a.tokens) == nb


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reused_tokens: int = 0


class PromptStore:
    """LRU of PromptCache entries bounded by `budget` bytes (0: keep none)."""

    def __init__(self, budget: int):
        self.budget = max(0, int(budget))
        self.entries: "OrderedDict[int, Tuple[PromptCache, int]]" = OrderedDict()  # key -> (cache, bytes)
        self.stats = StoreStats()
        self.shared: set = set()  # keys of branch points: always copied, never taken over
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.shared.clear()

    @staticmethod
    def usable(pc: PromptCache, drafter, with_drafter: bool) -> int:
        """How many of `pc`'s tokens the decode loop can keep (generate.reusable:
        with a drafter, those its context covers as rows or pending features)."""
        return reusable(pc, drafter if with_drafter else None)

    def match(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False
              ) -> Tuple[Optional[int], int]:
        """(key of the entry sharing the longest reusable prefix with `ids`, its length).
        An entry whose cache cannot drop its extra tokens now (recurrent state,
        a wrapped sliding window: Target.can_trim) counts only when all its
        tokens are a prefix of the prompt; one token is always left to process."""
        best, best_n = None, 0
        head = ids[:-1]
        for key, (pc, _) in self.entries.items():
            keep = self.usable(pc, drafter, with_drafter)
            n = common_prefix(pc.tokens[:keep], head)
            drop = len(pc.tokens) - n
            if n and drop and not target.can_trim(pc.target, drop):
                n = 0
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def branch_point(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False) -> int:
        """The longest prefix `ids` shares with an entry that cannot be cut back
        to it (recurrent state): where conversations branch, e.g. after a shared
        system prompt. 0 when `match` already reuses as much."""
        _, n = self.match(target, ids, drafter, with_drafter)
        head = ids[:-1]
        best = max((common_prefix(pc.tokens[: self.usable(pc, drafter, with_drafter)], head)
                    for pc, _ in self.entries.values()), default=0)
        return best if best > n else 0

    def take(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False
             ) -> Tuple[PromptCache, int]:
        """A PromptCache the caller may mutate, holding the best reusable prefix
        of `ids` (a fresh one when nothing matches), and the matched length."""
        key, n = self.match(target, ids, drafter, with_drafter)
        if key is None:
            self.stats.misses += 1
            return PromptCache(), 0
        self.stats.hits += 1
        self.stats.reused_tokens += n
        pc, _ = self.entries[key]
        if n == self.usable(pc, drafter, with_drafter) and (
                key not in self.shared or target.can_trim(pc.target, len(pc.tokens))):
            # the prompt continues all this entry can give: the longer one replaces
            # it, no copy. A branch point of a recurrent target (put(shared=True))
            # stays for the next conversation: it is copied.
            del self.entries[key]
            return pc, n
        self.entries.move_to_end(key)
        return copy.deepcopy(pc), n

    def put(self, pc: PromptCache, target: Optional[Target] = None, shared: bool = False) -> None:
        """Keep `pc` (the caller hands it over). Trimmable entries whose tokens
        are a prefix of it are dropped (it serves their prompts as well); the
        least recently used go when over budget."""
        if not pc.tokens or pc.target is None:
            return
        size = cache_bytes(pc)
        if size > self.budget:
            return
        _evaluate(pc)
        if target is not None and target.can_trim(pc.target, len(pc.tokens)):  # it can serve any prefix
            for k in [k for k, (e, _) in self.entries.items()
                      if e.drafter_id == pc.drafter_id and _covers(pc, e)]:
                del self.entries[k]
        for k in [k for k in self.shared if k not in self.entries]:
            self.shared.discard(k)
        self._next += 1
        self.entries[self._next] = (pc, size)
        if shared:
            self.shared.add(self._next)
        while self.nbytes > self.budget and len(self.entries) > 1:
            k, _ = self.entries.popitem(last=False)
            self.shared.discard(k)
            self.stats.evictions += 1

    def summary(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "budget": self.budget,
                "tokens": [len(pc.tokens) for pc, _ in self.entries.values()], **self.stats.__dict__}


def tokens_of(store: PromptStore) -> List[List[int]]:
    """The token ids of every entry, least recently used first (tests, /metrics)."""
    return [list(pc.tokens) for pc, _ in store.entries.values()]
