"""The lossless decode loop (DFLASH2.md section 4), as a generator.

`stream_generate` reads as its steps: plan (mode, width, policy), reuse the
prompt cache, prefill, then per cycle: ask the policy, draft, verify + accept
(one host readback), roll back and keep the context features, emit.

Verify modes:
- `dflash` (default): the DFlash drafter at width w. With the default width
  (block_size None or 5) `policy.Guard` runs plain decoding whenever drafting
  is predicted not to pay (calibrated cycle cost vs live acceptance), probing
  now and then, and verifies prompt-lookup drafts (the continuation of an
  n-gram the context repeats) wherever their gate predicts they pay, in any
  state; any other width, or `guard=False`, drafts at exactly that width on
  every cycle (`guard=True` guards any width; `lookup=False` keeps the
  guard's lookup drafts out).
- `adaptive`: per-cycle width and cut from the calibrated cost curve (adaptive.AdaptiveWidth).
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
from .prompt_cache import PromptCache, lookup_index, reusable, reuse  # noqa: F401 (PromptCache, reusable: public here too)
from .sampling import SamplingParams
from .stats import CycleStats, Emitter, GenerationResponse, GenerationStats  # noqa: F401 (public names)
from .steps import bookkeep, cat_feats, draft, plain, prefill, readback, verify
from .target import Target

VERIFY_MODES = ("dflash", "adaptive", "lookup", "off")
DEFAULT_BLOCK_SIZE = 5
# the guard's calibration, once per model, drafter and machine (then cached on
# disk for a month): widths 1 and w, three rounds, 16 pipelined plain steps each
# (fewer overstate a plain token: the pipeline's first step does not overlap);
# about 1.5 s on the embedded pair in bfloat16 on a 2-core x86 CPU
GUARD_CALIBRATION = dict(budget_s=0.3, min_rounds=3, plain_steps=16, context=128)


def _notice(msg: str) -> None:
    print(f"mlx-dflash: {msg}", file=sys.stderr)


def _encode(tokenizer: TokenizerWrapper, prompt) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    return list(prompt)


# -- plan: what this call runs ----------------------------------------------------------


@dataclass
class _Run:
    mode: str  # dflash | adaptive | lookup | off
    width: int
    drafter: Optional[object]  # used for drafts (None: lookup only / off)
    capture: list
    policy: object = None  # policy.Fixed | Guard | AdaptiveWidth
    index: Optional[NgramIndex] = None  # lookup mode, and the guard's lookup drafts
    lookup_due: bool = False  # the guard's lookup gate ended a plain run: verify the context's lookup next


def _plan(target, drafter, ids, pc, verify_mode, block_size, guard, max_context, stats, carry=True,
          lookup=True, keep=False) -> _Run:
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
    from .adaptive import AdaptiveWidth

    if mode == "adaptive":  # per-cycle width from the measured cost curve
        run.policy = AdaptiveWidth(calibrate.get_costs(target.model, drafter, w), w)
    elif mode == "dflash" and (guard if guard is not None else block_size in (None, DEFAULT_BLOCK_SIZE)) and w > 1:
        costs = calibrate.get_costs(target.model, drafter, widths=(1, w), **GUARD_CALIBRATION)
        # a seeded call does not inherit the last call's state: same seed, same widths, same sample
        prior = calibrate.load_observed(target.model, drafter) if carry else None
        run.policy = policy.Guard(w, costs, prior, lookup=lookup)
        # DFlash cannot pay here: the drafter never runs, and without a prompt cache to
        # keep (a one-shot call) no features are captured either; with one they are, so
        # the cached prefix stays reusable by a later call that drafts
        if run.policy.hopeless and not keep:
            run.drafter, run.capture = None, []
        if lookup:  # the guard also verifies prompt-lookup drafts where they pay
            run.index = lookup_index(pc, ids)
    elif mode != "off":
        run.policy = policy.Fixed(w)
    if mode == "lookup":
        run.index = lookup_index(pc, ids)
        run.policy.reason = f"lookup width {w}" + (" (else DFlash)" if use is not None else "")
    stats.policy = run.policy.reason if run.policy else f"plain: {stats.fallback or 'verify mode off'}"
    return run


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
    lookup: bool = True,
) -> Iterator[GenerationResponse]:
    """Generate from `model` (an mlx-lm model), speculatively with `drafter`.

    Yields one GenerationResponse per token; the last one has `finish_reason`.
    Greedy output is token-for-token what mlx-lm's own `stream_generate` gives.
    Prompts longer than `max_context` tokens use plain decoding (DFlash gains
    shrink with context; the fallback is reported in the stats).

    `guard` (verify mode dflash): None = on when `block_size` is None or the
    default width (5), off for any other width; True / False force it. The
    guard also verifies prompt-lookup drafts where they pay, unless `lookup`
    is False. The stats' `policy` says what decided each width and why."""
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
    run = _plan(target, drafter, ids, pc, verify_mode, block_size, guard, max_context, stats, seed is None, lookup,
                prompt_cache is not None)
    common = reuse(target, pc, ids, run.drafter, stats)
    emit = Emitter(tokenizer, stop, max_tokens, stats)

    tic = time.perf_counter()
    pending = None
    if run.drafter is not None:  # (a call without the drafter leaves them for a later one)
        pending, pc.pending = pc.pending, None
    token, new_feats = prefill(target, pc, ids[common:], run.capture, sp, prefill_step_size)
    new_feats = cat_feats([pending, new_feats])  # rows the drafter has not seen: the next draft takes them
    stats.prompt_time = time.perf_counter() - tic
    gen_tic = time.perf_counter()
    if run.index is not None:
        run.index.append(token)
    rows = [new_feats]  # feature blocks of fed rows the drafter has not seen yet, in order
    try:
        yield emit.push(token, False)
        if emit.done:
            return
        if run.mode == "off":
            yield from plain(target, pc, token, sp, emit, stats, gen_tic)
            return
        yield from _speculate(run, target, pc, token, rows, sp, emit, stats, gen_tic, max_tokens)
    finally:
        if run.drafter is not None:  # they stay with the cache: the next call's first draft takes them
            pc.pending = cat_feats(rows)
        _remember(run, target, drafter)


def _speculate(run, target, pc, token, rows, sp, emit, stats, gen_tic, max_tokens):
    """The decode loop after the first token: ask the policy, then a plain run,
    or a cycle: draft, verify + accept, readback, bookkeep, emit. `rows` (the
    caller's list) always holds the features of fed rows the drafter has not seen."""
    pol, index = run.policy, run.index
    simple = hasattr(pol, "observe_plain")  # Fixed / Guard (else AdaptiveWidth: its own hooks)
    gate = getattr(pol, "lookup", None)  # the guard's lookup drafts (lookup.py), in any of its states
    while True:
        look = _guard_lookup(run, gate, pol.width(), max_tokens - len(emit.tokens))
        # -- plain steps (a policy fallback, or lookup with nothing to look up) --
        burst = 0 if look else pol.plain_steps()
        if burst > (0 if simple else 1) or (index is not None and run.drafter is None and not index.match()[0]):
            before = stats.plain_cycles
            token, _ = yield from plain(target, pc, token, sp, emit, stats, gen_tic, run.capture, burst or None,
                                        rows, _on_plain(pol, index, run, stats, simple))
            if simple:
                pol.observe_plain(stats.plain_cycles - before)
                _report(pol, stats)
            if token is None:
                return
            continue

        # -- draft (lazy: computed with the verify) --
        t0 = time.perf_counter()
        w = max(1, min(pol.width(), max_tokens - len(emit.tokens)))  # never draft past max_tokens
        if look:
            prop, source = Proposal(mx.array(look, mx.int32)), "lookup"
        else:
            prop, source = draft(run, target, pc, token, cat_feats(rows), w, sp, None if gate else index)
        if source == "dflash":
            rows.clear()  # the drafter took them into its context
        drafts, q, conf, t_cut = _cut(pol, prop) if source == "dflash" and not simple else \
            (prop.tokens if prop else mx.zeros((0,), mx.int32), prop.q if prop else None, None, 0.0)
        n = drafts.shape[0]

        # -- verify + accept (the one readback) --
        t2 = time.perf_counter()
        res, f = verify(target, pc, token, drafts, q, sp, run.capture)
        t_wait = time.perf_counter()
        a, out = readback(res, sp)
        t3 = time.perf_counter()

        # -- roll back; the anchor and accepted drafts become drafter context --
        rows.append(bookkeep(target, pc, token, out, a, n, f, None))
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
            if source == "lookup" and gate is not None:
                pol.observe_lookup(a, n)
            elif n:
                pol.observe(a + 1)
        else:
            pol.observe(cyc, conf)
        _report(pol, stats)
        stats.generation_time = time.perf_counter() - gen_tic
        yield from resps
        if emit.done:
            return


def _cut(pol, prop):
    """Verify mode adaptive: verify only the drafts worth their cost. Reads the
    drafts' confidences back: the one extra sync of that mode. Returns (drafts,
    q, conf, seconds waited)."""
    t = time.perf_counter()
    mx.eval(prop.tokens, prop.conf)
    t = time.perf_counter() - t
    conf = prop.conf.tolist() if isinstance(prop.conf, mx.array) else list(prop.conf)
    k = pol.cut(Proposal(prop.tokens.tolist(), prop.q, 0.0, conf))
    return prop.tokens[:k], (prop.q[:k] if prop.q is not None else None), conf[:k], t


def _report(pol, stats) -> None:
    stats.policy = pol.reason
    if hasattr(pol, "summary"):
        stats.adaptive = pol.summary()


def _on_plain(pol, index, run, stats, simple):
    """Per plain token: adaptive observes it; lookup indexes it and ends the run
    once the context has a match (lookup mode without a drafter) or the guard's
    gate takes one (returns True)."""
    gate = getattr(pol, "lookup", None)

    def on(tok, cyc):
        if not simple:
            pol.observe(cyc)
            stats.adaptive = pol.summary()
        if index is None:
            return False
        index.append(tok)
        if gate is not None:
            if not run.lookup_due:
                run.lookup_due = gate.take(len(index.propose(pol.width() - 1)))
            return run.lookup_due
        return run.drafter is None and index.match()[0] > 0
    return on


def _guard_lookup(run, gate, width, left):
    """The guard's lookup drafts for this cycle, or None: the context's lookup
    proposal (never past max_tokens) when the gate takes it, or took it at the
    end of the plain run just before."""
    if gate is None:
        return None
    n = min(width, left) - 1
    look = run.index.propose(n) if n >= 1 else []
    due, run.lookup_due = run.lookup_due, False
    return look if look and (due or gate.take(len(look))) else None


def _remember(run, target, drafter) -> None:
    """The guard's timings and state carry over to the next request."""
    if hasattr(run.policy, "observed"):
        from .calibrate import save_observed

        save_observed(target.model, drafter, run.policy.observed())


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
