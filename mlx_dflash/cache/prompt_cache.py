"""What a call keeps for the next one (chat turns, server requests): the
target's KV cache, the drafter's context and the lookup index, and how much of a
new prompt can continue from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafting.lookup import NgramIndex


@dataclass
class PromptCache:
    """Target KV cache + drafter context kept across calls (chat turns, server
    requests): a new prompt that extends `tokens` only prefills the rest."""

    target: list = None
    drafter: list = None
    tokens: List[int] = field(default_factory=list)  # tokens whose K/V sit in `target`
    drafter_id: Optional[int] = None  # the drafter the context rows belong to
    drafter_layout: Tuple[Optional[int], int] = (None, 0)  # its context's (window, sink): Drafter.make_cache
    # captured target features of tokens[drafter offset:], not yet in the drafter's
    # context (plain steps and accepted rows since the last draft): the next call
    # hands them to its first draft, so the whole cached prefix stays reusable
    pending: Optional[mx.array] = None
    index: Optional[NgramIndex] = None  # the n-gram index of the last call's text (lookup drafts)
    # where the prompt store found it: {"tier": "memory" | "disk", "tokens": n, ...} (stats, /metrics)
    origin: Optional[dict] = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable(pc: PromptCache, drafter, layout: Optional[Tuple[Optional[int], int]] = None) -> int:
    """How many leading `pc.tokens` a call with `drafter` (None: none) can reuse:
    the drafter's context must cover them, as context rows or pending features
    (in a cache of that `layout`, when given)."""
    if drafter is None:
        return len(pc.tokens)
    if pc.drafter is None or pc.drafter_id != id(drafter) or layout not in (None, pc.drafter_layout):
        return 0
    rows = pc.pending.shape[1] if pc.pending is not None else 0
    return min(len(pc.tokens), pc.drafter[0].offset + rows)


def origin(pc: PromptCache, reused: int) -> Optional[dict]:
    """Where the `reused` tokens of a call came from (the prompt store's tier and
    load time; None: nothing reused, or a cache kept by its caller)."""
    return dict(pc.origin, tokens=reused) if reused and pc.origin else None


def lookup_index(pc, ids) -> NgramIndex:
    """The lookup index of `ids`: the last call's, extended, when its text is a
    prefix of them (a chat's next turn indexes only the new tokens), else new."""
    idx, n = pc.index, len(pc.index.tokens) if pc.index is not None else 0
    if idx is None or n > len(ids) or ids[:n] != idx.tokens:
        idx = NgramIndex(ids)
    else:
        idx.extend(ids[n:])
    pc.index = idx
    return idx


def reuse(target, pc, ids, drafter, layout: Tuple[Optional[int], int] = (None, 0)) -> int:
    """Keep the cached prefix shared with `ids` (always leaving >= 1 token to
    process). Drafter context rows always cover a prefix of the target's cached
    tokens; rows beyond what both share are dropped (`drafter`: the one this
    call drafts with, or None; `layout`: its context's (window, sink), a cache
    of another layout starts over). Returns its length."""
    d = drafter
    if d is not None and (pc.drafter is None or pc.drafter_id != id(d) or pc.drafter_layout != tuple(layout)):
        pc.drafter, pc.drafter_id, pc.pending = d.make_cache(*layout), id(d), None
        pc.drafter_layout = tuple(layout)
    common = common_prefix(pc.tokens[:reusable(pc, d)], ids[:-1])
    if common < len(pc.tokens):
        if target.can_trim(pc.target, len(pc.tokens) - common):
            target.trim(pc.target, len(pc.tokens) - common)
        else:
            pc.target, common = target.make_cache(), 0
    off = pc.drafter[0].offset if pc.drafter is not None else 0
    if pc.drafter is not None and off > common:
        for c in pc.drafter:
            c.trim(c.offset - common)
        pc.pending = None
    elif pc.pending is not None:  # the pending rows of the shared prefix stay pending
        pc.pending = pc.pending[:, : common - off] if common > off else None
    pc.tokens = list(ids[:common])
    return common
