"""Draft sources behind one interface, for a set of one sequence or many:
`offers(seq, n)` says how many of n drafts a source can propose for a row now,
`grade(seq)` what that offer rests on (a source whose drafts are right more or
less often by kind says which kind: lookup, the length of its n-gram match; 0
where all are alike), `propose(target, seqs, widths)` proposes each row's
drafts (row b: widths[b] - 1 of them) for the verify that follows, lazily. A
new source (an MTP head, a draft tree) is one class here and one `PROPOSERS`
line; the policy picks a source per row by its name (policy.base: DFLASH, LOOKUP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx

from ..policy.base import DFLASH, LOOKUP


@dataclass
class Proposals:
    """A source's drafts for its rows: tokens [rows, W - 1] (int32, lazy; past a
    row's own count, filler that is never accepted), each row's count, and per
    row its proposal distribution q [count, V] (None: a one-hot proposal) and the
    drafts' confidences (None where the source gives none)."""

    tokens: mx.array
    counts: List[int]
    q: List[Optional[mx.array]]
    conf: List[object]


class DFlashProposer:
    """The DFlash / DFlash 2 drafter: one parallel forward proposes every row's
    block, from the features of its rows it has not seen yet (which it takes
    into the row's drafter context). A drafter is anything with `propose` (one
    row) and `propose_batch` (many): drafting/drafter.Drafter, or a test's."""

    name = DFLASH

    def __init__(self, drafter):
        self.drafter = drafter

    def offers(self, seq, n: int) -> int:
        return n

    def grade(self, seq) -> int:
        return 0

    def propose(self, target, seqs, widths: List[int]) -> Proposals:
        W = max(widths)
        if len(seqs) == 1:  # alone: the drafter's own one-row forward (its confidences too)
            s = seqs[0]
            p = self.drafter.propose(target, s.anchor, s.take_pending(), s.pc.drafter, W, s.sp.temperature,
                                     s.next_key())
            toks = p.tokens if isinstance(p.tokens, mx.array) else mx.array(list(p.tokens), mx.int32)
            return Proposals(toks.astype(mx.int32).reshape(1, W - 1), [W - 1], [p.q], [p.conf])
        toks, qs = self.drafter.propose_batch(target, [s.anchor for s in seqs], [s.take_pending() for s in seqs],
                                              [s.pc.drafter for s in seqs], W, [s.sp.temperature for s in seqs],
                                              [s.next_key() for s in seqs])
        return Proposals(toks, [w - 1 for w in widths], list(qs), [None] * len(seqs))


class LookupProposer:
    """Prompt lookup (lookup.py): the continuation of the longest n-gram that ends
    the row's context and occurred before in it; drafted for free (one-hot)."""

    name = LOOKUP

    def __init__(self, drafter=None):
        pass

    def offers(self, seq, n: int) -> int:
        return len(seq.pc.index.propose(n)) if seq.pc.index is not None else 0

    def grade(self, seq) -> int:
        return seq.pc.index.match()[0] if seq.pc.index is not None else 0

    def propose(self, target, seqs, widths: List[int]) -> Proposals:
        W = max(widths)
        looks = [s.pc.index.propose(w - 1) for s, w in zip(seqs, widths)]
        toks = mx.array([lk + [0] * (W - 1 - len(lk)) for lk in looks], mx.int32).reshape(len(seqs), W - 1)
        return Proposals(toks, [len(lk) for lk in looks], [None] * len(seqs), [None] * len(seqs))


def propose_rows(drafter, target, anchors, feats, caches, width: int, temperatures, keys):
    """`propose_batch` one row at a time through the drafter's `propose`: for a
    drafter that wraps another (a benchmark's replayed acceptance) or a test's."""
    toks, qs = [], []
    for a, f, c, t, k in zip(anchors, feats, caches, temperatures, keys):
        p = drafter.propose(target, a, f, c, width, t, k)
        toks.append((p.tokens if isinstance(p.tokens, mx.array) else mx.array(list(p.tokens))).astype(mx.int32)
                    .reshape(width - 1))
        qs.append(p.q)
    return mx.stack(toks), qs


PROPOSERS: Dict[str, type] = {DFLASH: DFlashProposer, LOOKUP: LookupProposer}
