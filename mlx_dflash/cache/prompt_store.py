"""Prompt cache across requests: several cached prefixes at once (target KV /
recurrent state + drafter context), LRU under a memory budget, matched to a new
prompt by the longest common prefix of token ids; with a disk tier (disk.py),
every entry put is also written to disk in the background, and a prompt the
disk serves better than memory is loaded from it (the memory tier first, then
the disk), so prefixes outlive the process and are shared between processes.

The decode loop works on one `PromptCache` and mutates it. `take` hands out an
entry the store no longer holds (a deep copy, or the entry itself when the new
prompt simply continues it), so a generation never changes what is stored;
`put` gives the finished cache back, evaluated: the server's threads share
the store and MLX's streams are per thread, so no entry may hold lazy arrays
(a lone request's pending features, say) for another thread to evaluate."""

from __future__ import annotations

import copy
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..platform.paths import cache_dir
from ..target.adapter import Target
from .disk import DiskTier, root_dir
from .identity import identity
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


def _locked(method):
    """One thread at a time in the store (the memory budget spills from the requests' threads)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reused_tokens: int = 0


class PromptStore:
    """LRU of PromptCache entries bounded by `budget` bytes (0: keep none), over
    an optional `disk` tier (DiskTier of the same model)."""

    def __init__(self, budget: int, disk: Optional[DiskTier] = None, keep_last: bool = False):
        self.budget = max(0, int(budget))
        self.disk = disk
        self.keep_last = keep_last  # the newest entry stays whatever its size (a chat's live conversation)
        self.cap: Optional[int] = None  # the room a server's memory budget leaves it now (memory.py), if less
        self.entries: "OrderedDict[int, Tuple[PromptCache, int]]" = OrderedDict()  # key -> (cache, bytes)
        self.stats = StoreStats()
        self.shared: set = set()  # keys of branch points: always copied, never taken over
        self._next = 0
        self._lock = threading.RLock()  # (_locked)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b for _, b in self.entries.values())

    @property
    def room(self) -> int:
        """Bytes it may hold now: its budget, or less when the server's memory budget says so."""
        return self.budget if self.cap is None else min(self.budget, self.cap)

    def __len__(self) -> int:
        return len(self.entries)

    @_locked
    def clear(self) -> None:
        """Forget every entry in memory (the disk tier keeps its own)."""
        self.entries.clear()
        self.shared.clear()

    @staticmethod
    def usable(pc: PromptCache, drafter, with_drafter: bool) -> int:
        """How many of `pc`'s tokens the decode loop can keep (generate.reusable:
        with a drafter, those its context covers as rows or pending features)."""
        return reusable(pc, drafter if with_drafter else None)

    @_locked
    def match(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False
              ) -> Tuple[Optional[object], int]:
        """(key of the entry sharing the longest reusable prefix with `ids`, its length).
        An entry whose cache cannot drop its extra tokens now (recurrent state,
        a wrapped sliding window: Target.can_trim) counts only when all its
        tokens are a prefix of the prompt; one token is always left to process.
        A disk entry (key: its Entry) is the match only when it serves more
        tokens than any entry in memory."""
        key, n = self._match_memory(target, ids, drafter, with_drafter)
        if self.disk is not None:
            e, dn, _ = self.disk.match(ids, with_drafter and drafter is not None)
            if dn > n:
                return e, dn
        return key, n

    def _match_memory(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False
                      ) -> Tuple[Optional[int], int]:
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

    @_locked
    def branch_point(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False) -> int:
        """The longest prefix `ids` shares with an entry that cannot be cut back
        to it (recurrent state): where conversations branch, e.g. after a shared
        system prompt. 0 when `match` already reuses as much."""
        _, n = self.match(target, ids, drafter, with_drafter)
        head = ids[:-1]
        best = max((common_prefix(pc.tokens[: self.usable(pc, drafter, with_drafter)], head)
                    for pc, _ in self.entries.values()), default=0)
        if self.disk is not None:
            best = max(best, self.disk.match(ids, with_drafter and drafter is not None)[2])
        return best if best > n else 0

    @_locked
    def take(self, target: Target, ids: Sequence[int], drafter=None, with_drafter: bool = False
             ) -> Tuple[PromptCache, int]:
        """A PromptCache the caller may mutate, holding the best reusable prefix
        of `ids` (a fresh one when nothing matches), and the matched length."""
        key, n = self.match(target, ids, drafter, with_drafter)
        if key is not None and not isinstance(key, int):  # the disk serves more: loaded (a private copy)
            pc = self.disk.load(key, n, drafter)
            if pc is not None:
                self.stats.hits += 1
                self.stats.reused_tokens += n
                pc.origin = dict(pc.origin, tokens=n)
                return pc, n
            key, n = self._match_memory(target, ids, drafter, with_drafter)  # (broken: dropped, logged)
        if key is None:
            self.stats.misses += 1
            return PromptCache(), 0
        self.stats.hits += 1
        self.stats.reused_tokens += n
        pc, _ = self.entries[key]
        pc.origin = {"tier": "memory", "tokens": n}
        if n == self.usable(pc, drafter, with_drafter) and (
                key not in self.shared or target.can_trim(pc.target, len(pc.tokens))):
            # the prompt continues all this entry can give: the longer one replaces
            # it, no copy. A branch point of a recurrent target (put(shared=True))
            # stays for the next conversation: it is copied.
            del self.entries[key]
            return pc, n
        self.entries.move_to_end(key)
        return copy.deepcopy(pc), n

    @_locked
    def put(self, pc: PromptCache, target: Optional[Target] = None, shared: bool = False) -> None:
        """Keep `pc` (the caller hands it over). Trimmable entries whose tokens
        are a prefix of it are dropped (it serves their prompts as well); the
        least recently used go when over budget."""
        if not pc.tokens or pc.target is None:
            return
        _evaluate(pc)
        pc.origin = None
        if self.disk is not None:  # in the background (it captures the arrays now)
            self.disk.save(pc)
        size = cache_bytes(pc)
        if size > self.room and not self.keep_last:
            return
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
        while self.nbytes > self.room and len(self.entries) > 1:
            self._evict_one()

    def _evict_one(self) -> int:
        """The least recently used entry leaves memory (to disk, when it is not
        there already). Returns its bytes."""
        k, (pc, size) = self.entries.popitem(last=False)
        self.shared.discard(k)
        self.stats.evictions += 1
        if self.disk is not None:
            self.disk.save(pc)
        return size

    @_locked
    def spill(self, nbytes: int) -> int:
        """Free at least `nbytes` of memory (the server's memory budget asks), least
        recently used entries first, to disk. Returns the bytes freed."""
        freed = 0
        while freed < nbytes and self.entries:
            freed += self._evict_one()
        return freed

    def close(self, timeout: Optional[float] = None) -> bool:
        """Wait for the disk tier's writes (a process about to exit)."""
        return self.disk.flush(timeout) if self.disk is not None else True

    @_locked
    def summary(self) -> dict:
        out = {"entries": len(self.entries), "bytes": self.nbytes, "budget": self.budget,
               "tokens": [len(pc.tokens) for pc, _ in self.entries.values()], **self.stats.__dict__}
        if self.disk is not None:
            out["disk"] = self.disk.summary()
        return out


def open_store(budget: int, disk_budget: int, model, tokenizer=None, drafter=None, name: Optional[str] = None,
               keep_last: bool = False) -> PromptStore:
    """The prompt store of a loaded model: `budget` bytes in memory (0: no prompt
    cache at all, unless `keep_last`) over a disk tier of `disk_budget` bytes
    under the user cache folder (0: memory only)."""
    disk = None
    if disk_budget > 0 and (budget > 0 or keep_last):
        disk = DiskTier(root_dir(cache_dir()), identity(model, tokenizer, drafter, name), disk_budget)
    return PromptStore(budget, disk, keep_last)


def tokens_of(store: PromptStore) -> List[List[int]]:
    """The token ids of every entry, least recently used first (tests, /metrics)."""
    return [list(pc.tokens) for pc, _ in store.entries.values()]
