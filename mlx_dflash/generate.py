"""The lossless decode loop (DFLASH2.md section 4), as a generator.

`stream_generate` reads as its steps: plan (mode, width, policy), reuse the
prompt cache, prefill, then per cycle: ask the policy, draft, verify + accept
(one host readback), roll back and keep the context features, emit.

Verify modes:
- `dflash` (default): the DFlash drafter at width w. With the default width the
  `policy.Guard` runs plain decoding whenever drafting is measured not to pay
  (reversibly); an explicit width other than the default, or `guard=False`,
  drafts at exactly that width on every cycle.
- `adaptive`: per-cycle width and cut from the calibrated cost curve (policy.AdaptiveWidth).
- `lookup`: prompt-lookup drafts (lookup.py), for any model; with a drafter,
  lookup when it has a full-width match, else DFlash.
- `off`: plain decoding, pipelined like mlx-lm."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .drafter import Drafter, Proposal
from .lookup import NgramIndex
from .sampling import SamplingParams, accept_greedy, accept_sampled, probs, sample
from .stats import CycleStats, Emitter, GenerationResponse, GenerationStats  # noqa: F401 (public names)
from .target import Target

VERIFY_MODES = ("dflash", "adaptive", "lookup", "off")
DEFAULT_BLOCK_SIZE = 5
# the guard's calibration, once per model, drafter and machine (then cached on
# disk): widths 1 and w, ~0.2 s on the embedded pair
GUARD_CALIBRATION = dict(budget_s=0.15, min_rounds=3, plain_steps=4, context=128)


@dataclass
class PromptCache:
    """Target KV cache + drafter context kept across calls (chat turns, server
    requests): a new prompt that extends `tokens` only prefills the rest."""

    target: list = None
    drafter: list = None
    tokens: List[int] = field(default_factory=list)  # tokens whose K/V sit in `target`
    drafter_id: Optional[int] = None  # the drafter the context rows belong to


def _notice(msg: str) -> None:
    print(f"mlx-dflash: {msg}", file=sys.stderr)


def _encode(tokenizer: TokenizerWrapper, prompt) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    return list(prompt)


def _lazy_pick(logits: mx.array, sp: SamplingParams) -> mx.array:
    return mx.argmax(logits, axis=-1) if sp.greedy else sample(probs(logits, sp))


# -- plan: what this call runs ----------------------------------------------------------


@dataclass
class _Run:
    mode: str  # dflash | adaptive | lookup | off
    width: int
    drafter: Optional[object]  # used for drafts (None: lookup only / off)
    capture: list
    policy: object = None  # policy.Fixed | Guard | AdaptiveWidth
    index: Optional[NgramIndex] = None  # lookup mode


def _plan(target, drafter, ids, pc, verify_mode, block_size, guard, max_context, stats) -> _Run:
    mode = verify_mode
    if mode in ("dflash", "adaptive") and drafter is None:
        mode, stats.fallback = "off", "no drafter"
    if mode != "off" and max_context is not None and len(ids) > max_context:
        mode, stats.fallback = "off", f"prompt longer than max_context ({len(ids)} > {max_context})"
    use = drafter if mode != "off" else None
    w = 1
    if mode != "off":
        limit = drafter.block_size if use is not None else 64
        w = block_size or min(DEFAULT_BLOCK_SIZE, limit)
        if not 1 <= w <= limit:
            what = "the drafter's trained block size" if use is not None else "the lookup limit"
            raise ValueError(f"block size {w} must be between 1 and {what} {limit}")
    if mode != "off" and not target.can_trim(pc.target):
        mode, use, stats.fallback = "off", None, "target KV cache cannot be trimmed"
        _notice("this target's KV cache cannot be trimmed; using plain decoding")
    stats.mode, stats.block_size = mode, w
    run = _Run(mode, w, use, list(use.config.target_layer_ids) if use is not None else [])
    from . import calibrate, policy

    if mode == "adaptive":  # per-cycle width from the measured cost curve
        run.policy = policy.AdaptiveWidth(calibrate.get_costs(target.model, drafter, w), w)
    elif mode == "dflash" and (guard if guard is not None else block_size in (None, DEFAULT_BLOCK_SIZE)) and w > 1:
        costs = calibrate.get_costs(target.model, drafter, widths=(1, w), **GUARD_CALIBRATION)
        run.policy = policy.Guard(w, costs, calibrate.load_observed(target.model, drafter))
    elif mode != "off":
        run.policy = policy.Fixed(w)
    if mode == "lookup":
        run.index = NgramIndex(ids)
        run.policy.reason = f"lookup width {w}" + (" (else DFlash)" if use is not None else "")
    stats.policy = run.policy.reason if run.policy else f"plain: {stats.fallback or 'verify mode off'}"
    return run


def _reuse(target, pc, ids, run, stats) -> int:
    """Keep the cached prefix shared with `ids` (always leaving >= 1 token to
    process). Drafter context rows always cover a prefix of the target's cached
    tokens; rows beyond what both share are dropped. Returns its length."""
    d = run.drafter
    if d is not None and (pc.drafter is None or pc.drafter_id != id(d)):
        pc.drafter, pc.drafter_id = d.make_cache(), id(d)
    keep = len(pc.tokens) if d is None else min(len(pc.tokens), pc.drafter[0].offset)
    common = 0
    for x, y in zip(pc.tokens[:keep], ids[:-1]):
        if x != y:
            break
        common += 1
    if common < len(pc.tokens):
        if target.can_trim(pc.target, len(pc.tokens) - common):
            target.trim(pc.target, len(pc.tokens) - common)
        else:
            pc.target, common = target.make_cache(), 0
    if pc.drafter is not None and pc.drafter[0].offset > common:
        for c in pc.drafter:
            c.trim(c.offset - common)
    stats.reused_tokens = common
    pc.tokens = list(ids[:common])
    return common


# -- the steps of a cycle ---------------------------------------------------------------


def _prefill(target, pc, rest, capture, sp, step):
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
    token = int(_lazy_pick(logits[0, -1], sp).item())
    return token, (mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None))


def _draft(run, target, pc, token, new_feats, width, sp):
    """The cycle's proposal (lazy; None when nothing is drafted) and its source."""
    if width < 2:
        return None, ""
    if run.index is not None:
        look = run.index.propose(width - 1)
        if look and (run.drafter is None or len(look) == width - 1):
            return Proposal(mx.array(look, mx.int32)), "lookup"
        if run.drafter is None:
            return None, ""
    prop = run.drafter.propose(target, token, new_feats, pc.drafter, width, sp.temperature)
    if not isinstance(prop.tokens, mx.array):  # a drafter may hand over a list
        prop.tokens = mx.array(list(prop.tokens), mx.int32)
    return prop, "dflash"


def _verify(target, pc, token, drafts, q, sp, capture):
    """Verify [anchor, drafts] in one forward and accept on the device, lazily.
    Returns (the result row for `_readback`, the captured features)."""
    vin = mx.concatenate([mx.array([token], mx.int32), drafts.astype(mx.int32)])[None]
    logits, f = target(vin, pc.target, capture)
    if sp.greedy:
        a, tgt = accept_greedy(logits[0], drafts)
        return mx.concatenate([a[None], tgt]), f  # emitted = tgt[:a+1]
    a, nxt = accept_sampled(probs(logits[0], sp), drafts, q)
    return mx.concatenate([a[None], drafts.astype(mx.int32), nxt.astype(mx.int32)[None]]), f


def _readback(res, sp):
    """The cycle's ONE host sync: the drafts, the verify and the acceptance are
    evaluated together. Returns (accepted count a, emitted tokens)."""
    r = res.tolist()
    a = r[0]
    return a, (r[1: a + 2] if sp.greedy else r[1: a + 1] + [r[-1]])


def _bookkeep(target, pc, token, out, a, n, f, new_feats):
    """Roll back the rejected rows; the anchor and the accepted drafts become
    drafter context (their features), the bonus is the next anchor."""
    target.trim(pc.target, n - a)
    pc.tokens.append(token)
    pc.tokens += out[:a]
    if f is None:
        return None
    return f[:, : a + 1] if new_feats is None else mx.concatenate([new_feats, f[:, : a + 1]], axis=1)


# -- the loop ---------------------------------------------------------------------------


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    drafter: Optional[Drafter] = None,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    block_size: Optional[int] = None,
    verify_mode: str = "dflash",
    stop: Optional[Sequence[str]] = None,
    prompt_cache: Optional[PromptCache] = None,
    prefill_step_size: int = 2048,
    max_context: Optional[int] = None,
    guard: Optional[bool] = None,
) -> Iterator[GenerationResponse]:
    """Generate from `model` (an mlx-lm model), speculatively with `drafter`.

    Yields one GenerationResponse per token; the last one has `finish_reason`.
    Greedy output is token-for-token what mlx-lm's own `stream_generate` gives.
    Prompts longer than `max_context` tokens use plain decoding (DFlash gains
    shrink with context; the fallback is reported in the stats).

    `guard` (verify mode dflash): None = on when `block_size` is None or the
    default width (5), off for any other width; True / False force it. The
    stats' `policy` says what decided each width and why."""
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode '{verify_mode}'; valid: {', '.join(VERIFY_MODES)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sp = SamplingParams(temperature, top_p, top_k, min_p, seed)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _encode(tokenizer, prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    if seed is not None:
        mx.random.seed(seed)

    target = Target(model)
    stats = GenerationStats(prompt_tokens=len(ids))
    pc = prompt_cache if prompt_cache is not None else PromptCache()
    if pc.target is None:
        pc.target = target.make_cache()
    run = _plan(target, drafter, ids, pc, verify_mode, block_size, guard, max_context, stats)
    common = _reuse(target, pc, ids, run, stats)
    emit = Emitter(tokenizer, stop, max_tokens, stats)

    tic = time.perf_counter()
    token, new_feats = _prefill(target, pc, ids[common:], run.capture, sp, prefill_step_size)
    stats.prompt_time = time.perf_counter() - tic
    gen_tic = time.perf_counter()
    if run.index is not None:
        run.index.append(token)
    yield emit.push(token, False)
    if emit.done:
        return
    if run.mode == "off":
        yield from _plain(target, pc, token, sp, emit, stats, gen_tic)
        return

    pol, index = run.policy, run.index
    simple = hasattr(pol, "observe_plain")  # Fixed / Guard (else AdaptiveWidth: its own hooks)
    try:
        while True:
            # -- plain steps (a policy fallback, or lookup with nothing to look up) --
            burst = pol.plain_steps()
            if burst > (0 if simple else 1) or (index is not None and run.drafter is None and not index.match()[0]):
                before = stats.plain_cycles
                token, new_feats = yield from _plain(
                    target, pc, token, sp, emit, stats, gen_tic, run.capture, burst or None, new_feats,
                    _on_plain(pol, index, run, stats, simple))
                if simple:
                    pol.observe_plain(stats.plain_cycles - before)
                    _report(pol, stats)
                if token is None:
                    return
                continue

            # -- draft --
            t0 = time.perf_counter()
            w = max(1, min(pol.width(), max_tokens - len(emit.tokens)))  # never draft past max_tokens
            prop, source = _draft(run, target, pc, token, new_feats, w, sp)
            drafts, q = (prop.tokens, prop.q) if prop is not None else (mx.zeros((0,), mx.int32), None)
            conf, t_cut = None, 0.0
            if prop is not None and source == "dflash":
                new_feats = None  # the drafter took them into its context
                if not simple:  # adaptive: verify only the drafts worth their cost (reads conf back)
                    t_cut = time.perf_counter()
                    mx.eval(prop.tokens, prop.conf)
                    t_cut = time.perf_counter() - t_cut
                    conf = prop.conf.tolist() if isinstance(prop.conf, mx.array) else prop.conf
                    k = pol.cut(Proposal(prop.tokens.tolist(), prop.q, 0.0, conf))
                    drafts, conf = drafts[:k], conf[:k]
                    q = q[:k] if q is not None else None
            n = drafts.shape[0]

            # -- verify + accept (the one readback) --
            t2 = time.perf_counter()
            res, f = _verify(target, pc, token, drafts, q, sp, run.capture)
            t_wait = time.perf_counter()
            a, out = _readback(res, sp)
            t3 = time.perf_counter()

            # -- roll back, keep context features --
            new_feats = _bookkeep(target, pc, token, out, a, n, f, new_feats)
            if index is not None:
                index.extend(out)
            token = out[-1]
            cyc = CycleStats(n + 1, a, 0, t2 - t0, 0.0, t3 - t2, time.perf_counter() - t3, source, t3 - t_wait + t_cut)

            # -- emit --
            resps = []
            for i, tok in enumerate(out):
                cyc.emitted += 1
                resps.append(emit.push(tok, i < a, cyc))
                if emit.done:
                    break
            stats.add(cyc)  # before yielding, so every token of the cycle sees it
            if simple:
                if n:
                    pol.observe(a + 1)
            else:
                pol.observe(cyc, conf)
            _report(pol, stats)
            stats.generation_time = time.perf_counter() - gen_tic
            yield from resps
            if emit.done:
                return
    finally:
        _remember(run, target, drafter)


def _report(pol, stats) -> None:
    stats.policy = pol.reason
    if hasattr(pol, "summary"):
        stats.adaptive = pol.summary()


def _on_plain(pol, index, run, stats, simple):
    """Per plain token: adaptive observes it; lookup indexes it and ends the run
    once the context has a match (returns True)."""
    def on(tok, cyc):
        if not simple:
            pol.observe(cyc)
            stats.adaptive = pol.summary()
        if index is not None:
            index.append(tok)
            return run.drafter is None and index.match()[0] > 0
        return False
    return on


def _remember(run, target, drafter) -> None:
    """The guard's timings and state carry over to the next request."""
    if hasattr(run.policy, "observed"):
        from .calibrate import save_observed

        save_observed(target.model, drafter, run.policy.observed())


def _plain(target, pc, token, sp, emit, stats, gen_tic, capture=(), steps=None, feats=None, on_token=None):
    """Plain decoding, pipelined like mlx-lm: the step that consumes token n is
    queued on its lazy value before it is read back, so building the graph
    overlaps the compute (when a stop comes, the queued step is wasted, as in mlx-lm).

    `token` has been emitted; its KV row is not cached yet. Ends after `steps`
    tokens, or one token after `on_token(tok, cycle)` returns True, and returns
    (the last token, emitted but not fed: the next anchor, or None when
    generation is over; the captured features of every row fed, after `feats`)."""
    queued = [0.0]  # seconds in async_eval: on mlx-cpu it can block on the step before

    def feed(tok):
        logits, f = target(tok.reshape(1, 1), pc.target, capture)
        nxt = _lazy_pick(logits[0, -1], sp)
        t = time.perf_counter()
        mx.async_eval(nxt, *([f] if f is not None else []))
        queued[0] += time.perf_counter() - t
        return nxt, f

    y, f = feed(mx.array(token))
    pc.tokens.append(token)
    feats = [feats, f] if feats is not None else [f]
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
            feats = [x for x in feats if x is not None]
            cat = mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None)
            return (None if emit.done else tok), cat
        y = nxt


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    stats: GenerationStats
    from_draft: List[bool] = field(default_factory=list)


def generate(model, tokenizer, prompt, drafter=None, **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end and collect the text, ids and stats."""
    tw = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    eos = set(tw.eos_token_ids)
    text, ids, src, r = [], [], [], None
    for r in stream_generate(model, tw, prompt, drafter, **kwargs):
        text.append(r.text)
        if not (r.finish_reason == "stop" and r.token in eos):
            ids.append(r.token)
            src.append(r.from_draft)
    return GenerationResult("".join(text), ids, r.finish_reason, r.stats, src)
