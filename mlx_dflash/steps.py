"""The steps of a decode cycle, each a plain function over the target, its
caches and lazy arrays (generate.stream_generate strings them together):
prefill, draft, verify (+ accept, on the device), readback (the cycle's one
host sync), bookkeep (rollback + drafter context), and plain pipelined decoding."""

from __future__ import annotations

import time

import mlx.core as mx

from .drafter import Proposal
from .sampling import SamplingParams, accept_greedy, accept_sampled, probs, sample
from .stats import CycleStats


def lazy_pick(logits: mx.array, sp: SamplingParams) -> mx.array:
    return mx.argmax(logits, axis=-1) if sp.greedy else sample(probs(logits, sp))


def prefill(target, pc, rest, capture, sp, step):
    """Chunked like mlx-lm, so the first logits match it bit for bit. Returns
    (the first token, the captured features of every prompt row)."""
    feats = []
    while len(rest) > 1:
        n = min(step, len(rest) - 1)
        _, f = target(mx.array(rest[:n])[None], pc.target, capture)
        mx.eval(f if f is not None else [c.state for c in pc.target])
        if f is not None:
            feats.append(f)
        pc.tokens += rest[:n]
        rest = rest[n:]
    logits, f = target(mx.array(rest)[None], pc.target, capture)
    if f is not None:
        feats.append(f)
    pc.tokens += rest
    token = int(lazy_pick(logits[0, -1], sp).item())
    return token, cat_feats(feats)


def cat_feats(feats):
    """Concatenate captured feature blocks [1, n_i, F] (None entries skipped)."""
    feats = [x for x in feats if x is not None]
    return mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None)


def draft(run, target, pc, token, new_feats, width, sp, index=None):
    """The cycle's proposal (lazy; None when nothing is drafted) and its source:
    with an n-gram `index` (verify mode lookup), its full-width lookup, else DFlash."""
    if width < 2:
        return None, ""
    if index is not None:
        look = index.propose(width - 1)
        if look and (run.drafter is None or len(look) == width - 1):
            return Proposal(mx.array(look, mx.int32)), "lookup"
        if run.drafter is None:
            return None, ""
    prop = run.drafter.propose(target, token, new_feats, pc.drafter, width, sp.temperature)
    if not isinstance(prop.tokens, mx.array):  # a drafter may hand over a list
        prop.tokens = mx.array(list(prop.tokens), mx.int32)
    return prop, "dflash"


def verify(target, pc, token, drafts, q, sp, capture):
    """Verify [anchor, drafts] in one forward and accept on the device, lazily.
    Returns (the result row for `_readback`, the captured features)."""
    vin = mx.concatenate([mx.array([token], mx.int32), drafts.astype(mx.int32)])[None]
    logits, f = target(vin, pc.target, capture)
    if sp.greedy:
        a, tgt = accept_greedy(logits[0], drafts)
        return mx.concatenate([a[None], tgt]), f  # emitted = tgt[:a+1]
    a, nxt = accept_sampled(probs(logits[0], sp), drafts, q)
    return mx.concatenate([a[None], drafts.astype(mx.int32), nxt.astype(mx.int32)[None]]), f


def readback(res, sp):
    """The cycle's ONE host sync: the drafts, the verify and the acceptance are
    evaluated together. Returns (accepted count a, emitted tokens)."""
    r = res.tolist()
    a = r[0]
    return a, (r[1: a + 2] if sp.greedy else r[1: a + 1] + [r[-1]])


def bookkeep(target, pc, token, out, a, n, f, new_feats):
    """Roll back the rejected rows; the anchor and the accepted drafts become
    drafter context (their features), the bonus is the next anchor."""
    target.trim(pc.target, n - a)
    pc.tokens.append(token)
    pc.tokens += out[:a]
    if f is None:
        return None
    return f[:, : a + 1] if new_feats is None else mx.concatenate([new_feats, f[:, : a + 1]], axis=1)


def plain(target, pc, token, sp, emit, stats, gen_tic, capture=(), steps=None, feats=None, on_token=None):
    # feats: a list the caller owns; the captured features of every row fed are
    # appended to it as they are fed (they survive a caller that stops mid-run)
    """Plain decoding, pipelined like mlx-lm: the step that consumes token n is
    queued on its lazy value before it is read back, so building the graph
    overlaps the compute (when a stop comes, the queued step is wasted, as in mlx-lm).

    `token` has been emitted; its KV row is not cached yet. Ends after `steps`
    tokens, or one token after `on_token(tok, cycle)` returns True, and returns
    (the last token, emitted but not fed: the next anchor, or None when
    generation is over; the features in `feats`, concatenated)."""
    feats = feats if feats is not None else []
    queued = [0.0]  # seconds in async_eval: on mlx-cpu it can block on the step before

    def feed(tok):
        logits, f = target(tok.reshape(1, 1), pc.target, capture)
        nxt = lazy_pick(logits[0, -1], sp)
        t = time.perf_counter()
        mx.async_eval(nxt, *([f] if f is not None else []))
        queued[0] += time.perf_counter() - t
        return nxt, f

    y, f = feed(mx.array(token))
    pc.tokens.append(token)
    feats.append(f)
    n, last = 0, False
    while True:
        t0 = time.perf_counter()
        nxt = None
        if not last and len(emit.tokens) + 1 < emit.max_tokens and (steps is None or n + 1 < steps):
            nxt, f = feed(y)  # y may not be the last token: queue its step now
        t_wait = time.perf_counter()
        tok = int(y.item())
        t_wait, queued[0] = time.perf_counter() - t_wait + queued[0], 0.0
        if nxt is not None:  # its KV row went in with the queued step: the cache and
            pc.tokens.append(tok)  # pc.tokens agree at every yield, even if the caller stops
            feats.append(f)
        n += 1
        cyc = CycleStats(1, 0, 1, t_verify=time.perf_counter() - t0, t_wait=t_wait)
        stats.add(cyc)
        if on_token is not None and on_token(tok, cyc):
            last = True  # the step already queued on tok gives the run's last token
        stats.generation_time = time.perf_counter() - gen_tic
        yield emit.push(tok, False, cyc)
        if emit.done or nxt is None:
            cat = cat_feats(feats)
            return (None if emit.done else tok), cat
        y = nxt
