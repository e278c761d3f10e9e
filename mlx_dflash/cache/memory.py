"""One memory budget for a server: the process (weights included), the prompt
store's memory tier and the caches of the requests running stay under `limit`.

`Footprint` says what one request of a model costs (measured from one tiny
forward at load: every cache kind, the drafter's context, the captured
features, a prefill chunk's transient logits and activations); `MemoryBudget`
admits a request by its projection (prompt plus its token limit), spills the
prompt store's memory tier to disk before refusing anything, makes a request
that cannot fit now wait for others to finish, and refuses one that can never
fit (413) or that waited too long (429), each in one line."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..target import rollback as rb
from ..target.adapter import Target

DEFAULT_SHARE = 0.75  # of the machine's memory, when no budget is set
WAIT_S = 120.0  # a request that cannot fit waits this long for others to finish, then 429
PROBE = 4  # tokens of the probe forward
GB = 1e9


def machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def rss() -> int:
    """This process's resident memory (Linux: /proc; elsewhere MLX's own arrays and cache)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return mx.get_active_memory() + mx.get_cache_memory()


def default_limit(setting_gb: Optional[float]) -> int:
    """The budget in bytes: the setting (memory_budget_gb), else a share of the machine."""
    return int(setting_gb * GB) if setting_gb else int(machine_memory() * DEFAULT_SHARE)


@dataclass
class Footprint:
    """Bytes a request of one model holds, by what grows with it."""

    per_token: int  # target caches per token (every row layer)
    fixed: int  # caches that do not grow: recurrent states, full sliding windows
    feature: int  # captured features per prompt token (pending until the first draft)
    drafter_row: int  # the drafter's context per row
    transient: int  # per token of a prefill chunk: logits and activations while it runs
    scores: int = 0  # per (chunk row, context column): attention scores and mask, where they are materialized

    def project(self, prompt: int, max_tokens: int, chunk: int = 2048, window: Optional[int] = None,
                sink: int = 0) -> int:
        n = prompt + max_tokens
        rows = n if window is None else min(n, window + sink)
        c = min(prompt, chunk)
        return (self.per_token * n + self.fixed + self.feature * prompt + self.drafter_row * rows
                + self.transient * c + self.scores * c * prompt)


def footprint(model, drafter=None) -> Footprint:
    """Measured from the caches of one PROBE-token forward through the model's own
    code (any family, any cache kind), and the drafter's layer shapes."""
    target = Target(model)
    cache = target.make_cache()
    capture = list(drafter.config.target_layer_ids) if drafter is not None else []
    logits, feats = target(mx.zeros((1, PROBE), dtype=mx.int32), cache, capture)
    mx.eval([c.state for c in cache], logits, feats if feats is not None else [])
    per_token = fixed = 0
    for x in (x for c in cache for x in rb.leaves(c)):
        st = [a for a in _arrays(x.state)]
        size = sum(int(a.nbytes) for a in st)
        if isinstance(x, rb.RotatingKVCache):  # a full window: bytes per row times its size
            fixed += size // max(1, x.keys.shape[2]) * x.max_size
        elif isinstance(x, rb.ROW_CACHES) and getattr(x, "keys", None) is not None:
            cap = x.keys[0].shape[2] if isinstance(x.keys, (list, tuple)) else x.keys.shape[2]
            per_token += size // max(1, cap)
        else:
            fixed += size
    feature = int(feats.nbytes) // PROBE if feats is not None else 0
    drafter_row = 0
    if drafter is not None:
        for layer in drafter.layers:
            w = layer.self_attn.k_proj.weight
            drafter_row += 2 * w.shape[0] * logits.dtype.size  # (rows in the activation dtype)
    args = getattr(model, "args", None)
    hidden = target.hidden_size
    inter = getattr(args, "intermediate_size", None) or 4 * hidden
    item = logits.dtype.size
    # a chunk's logits (the model's own forward computes every row's) and its widest activations
    transient = target.vocab_size * item + (6 * hidden + 3 * int(inter)) * item
    heads = int(getattr(args, "num_attention_heads", None) or max(1, hidden // 64))
    scores = (heads + 1) * 4  # float32 scores per head, and the mask (MLX's CPU attention materializes them)
    return Footprint(per_token, fixed, feature, drafter_row, transient, scores)


def _arrays(x):
    if isinstance(x, mx.array):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _arrays(y)


class Refused(Exception):
    """A request the budget will not run: `status` 413 (it can never fit) or 429 (not now)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class MemoryBudget:
    """Admission against `limit` bytes. `base`: what the process holds besides
    the store and the requests (weights, libraries: its RSS when made);
    `store`: the prompt store now (its memory tier spills to disk; the store
    takes one thread at a time)."""

    def __init__(self, limit: int, fp: Footprint, base: Optional[int] = None,
                 store: Callable[[], object] = lambda: None, wait_s: float = WAIT_S):
        self.limit, self.fp = int(limit), fp
        self.base = rss() if base is None else int(base)
        self.store, self.wait_s = store, wait_s
        self.running: Dict[object, int] = {}
        self.cv = threading.Condition()
        self.refused = {413: 0, 429: 0}
        self.waited = 0
        self.spilled = 0
        self.peak = 0
        # freed buffers MLX keeps for reuse count against the budget too: a bounded share
        self.slack = max(64 << 20, self.limit // 16)
        mx.set_cache_limit(self.slack)

    def _store_bytes(self) -> int:
        s = self.store()
        if s is None:
            return 0
        d = getattr(s, "disk", None)
        return s.nbytes + (d.queued_bytes if d is not None else 0)

    def committed(self) -> int:
        return self.base + self.slack + self._store_bytes() + sum(self.running.values())

    def project(self, prompt: int, max_tokens: int, **kw) -> int:
        return self.fp.project(prompt, max_tokens, **kw)

    def spill(self, nbytes: int) -> int:
        """Move at least `nbytes` of the store's memory tier to disk (what it can)."""
        s = self.store()
        if s is None or nbytes <= 0:
            return 0
        freed = s.spill(nbytes)
        self.spilled += freed
        return freed

    def admit(self, key, need: int, what: str = "") -> None:
        """Reserve `need` bytes for request `key` (released by release(key)), spilling
        the store first; waits while other requests run; Refused if it cannot."""
        deadline = time.monotonic() + self.wait_s
        with self.cv:
            while True:
                over = self.committed() + need - self.limit
                if over > 0:
                    self.cv.release()  # (spilling writes the store: not under this lock)
                    try:
                        self.spill(over)
                    finally:
                        self.cv.acquire()
                    over = self.committed() + need - self.limit
                if over <= 0:
                    self.running[key] = need
                    self.peak = max(self.peak, self.committed())
                    self._cap_store()
                    return
                alone = self.base + self.slack + need
                if alone > self.limit:
                    self.refused[413] += 1
                    room = max(0, self.limit - self.base - self.slack)
                    raise Refused(413, f"this request needs about {need / GB:.2f} GB of memory{what}, more than "
                                       f"the {room / GB:.2f} GB the server's memory budget "
                                       f"({self.limit / GB:.2f} GB) leaves beside the model; lower max_tokens or "
                                       "shorten the prompt, or raise memory_budget_gb")
                left = deadline - time.monotonic()
                if (not self.running and not self._store_bytes()) or left <= 0:  # (writes to disk free memory)
                    self.refused[429] += 1
                    raise Refused(429, f"the server's memory budget ({self.limit / GB:.2f} GB) is taken by "
                                       f"{len(self.running)} running requests and cached prompts; retry later")
                self.waited += 1
                self.cv.wait(min(left, 1.0))

    def release(self, key) -> None:
        with self.cv:
            if self.running.pop(key, None) is None:
                return
            self.cv.notify_all()
            self._cap_store()
        over = self.committed() - self.limit  # (the finished request's cache went to the store)
        if over > 0:
            self.spill(over)

    def _cap_store(self) -> None:
        """The store's memory tier may hold what the running requests leave (its puts
        between two admissions evict to disk beyond that)."""
        s = self.store()
        if s is not None:
            s.cap = max(0, self.limit - self.base - self.slack - sum(self.running.values()))

    def summary(self) -> dict:
        return {"limit": self.limit, "committed": self.committed(), "base": self.base, "running": len(self.running),
                "reserved": sum(self.running.values()), "store": self._store_bytes(), "peak": self.peak,
                "rss": rss(), "waited": self.waited, "spilled": self.spilled,
                "refused_413": self.refused[413], "refused_429": self.refused[429]}


def warn_if_over(b: MemoryBudget) -> None:
    """One line when the model alone already takes the budget (every request will be refused)."""
    if b.base + b.slack >= b.limit:
        sys.stderr.write(f"mlx-dflash: the memory budget ({b.limit / GB:.2f} GB) is below what the loaded model "
                         f"already takes ({b.base / GB:.2f} GB); raise memory_budget_gb\n")
