"""The lossless decode loop: prefill, draft, verify, accept, trim, append
context features (DFLASH2.md section 4), as a generator."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .drafter import Drafter
from .sampling import SamplingParams, accept_speculative, probs, sample
from .target import Target

VERIFY_MODES = ("dflash", "adaptive", "off")
DEFAULT_BLOCK_SIZE = 5


@dataclass
class CycleStats:
    """One draft + verify cycle."""

    width: int  # verify width w: anchor + w-1 drafts
    accepted: int  # drafts accepted
    emitted: int  # tokens this cycle produced (accepted + bonus, less any cut by a stop)
    t_draft: float = 0.0
    t_select: float = 0.0
    t_verify: float = 0.0
    t_book: float = 0.0


@dataclass
class GenerationStats:
    mode: str = "dflash"  # dflash | adaptive | off
    fallback: Optional[str] = None  # why DFlash was not used, if it was asked for
    block_size: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from a prompt cache
    generation_tokens: int = 0
    cycles: int = 0
    plain_cycles: int = 0  # cycles that verified the anchor alone (adaptive fallback)
    drafted: int = 0
    accepted: int = 0
    cycle_tokens: int = 0  # tokens emitted by verify cycles (excludes the prefill token)
    prompt_time: float = 0.0
    generation_time: float = 0.0
    t_draft: float = 0.0
    t_select: float = 0.0
    t_verify: float = 0.0
    t_book: float = 0.0
    peak_memory: float = 0.0  # GB
    adaptive: Optional[dict] = None  # verify mode adaptive: the policy's state (AdaptiveWidth.summary)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify (accepted drafts + the bonus)."""
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens per second after the first token (the prefill's own)."""
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0

    def add(self, c: CycleStats) -> None:
        self.cycles += 1
        self.plain_cycles += c.width == 1
        self.drafted += c.width - 1
        self.accepted += c.accepted
        self.cycle_tokens += c.emitted
        self.t_draft += c.t_draft
        self.t_select += c.t_select
        self.t_verify += c.t_verify
        self.t_book += c.t_book

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, prompt_tps=self.prompt_tps,
                 generation_tps=self.generation_tps, tokens_per_second=self.generation_tps)
        return d


@dataclass
class GenerationResponse:
    text: str  # new text segment (may be empty)
    token: int
    from_draft: bool  # an accepted draft token (False: the target's own token)
    finish_reason: Optional[str]  # None, "stop" or "length"
    stats: GenerationStats
    cycle: Optional[CycleStats] = None  # the cycle that produced this token


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


class Emitter:
    """Token bookkeeping shared by every mode: EOS, stop strings (also across a
    block), max tokens, and text held back while it may begin a stop string."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: Sequence[str], max_tokens: int, stats):
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.max_tokens = max_tokens
        self.stats = stats
        self.tokens: List[int] = []
        self.full = ""
        self.sent = 0
        self.done = False

    def push(self, token: int, from_draft: bool, cycle=None) -> GenerationResponse:
        """Account one token; sets self.done when generation must end."""
        st = self.stats
        if token in self.eos:
            self.done = True
            return self._final(token, from_draft, "stop", cycle)
        self.tokens.append(token)
        st.generation_tokens = len(self.tokens)
        self.detok.add_token(token)
        self.full += self.detok.last_segment
        if self.stop:
            lo = max(0, self.sent - self.hold)
            hits = [i for i in (self.full.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                self.full = self.full[: min(hits)]
                self.done = True
                return self._final(token, from_draft, "stop", cycle, flush=False)
        if len(self.tokens) >= self.max_tokens:
            self.done = True
            return self._final(token, from_draft, "length", cycle)
        end = max(self.sent, len(self.full) - self.hold) if self.stop else len(self.full)
        text, self.sent = self.full[self.sent : end], end
        return GenerationResponse(text, token, from_draft, None, st, cycle)

    def _final(self, token, from_draft, reason, cycle, flush=True):
        if flush:
            self.detok.finalize()
            self.full += self.detok.last_segment
        text, self.sent = self.full[self.sent :], len(self.full)
        self.stats.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(text, token, from_draft, reason, self.stats, cycle)


def _encode(tokenizer: TokenizerWrapper, prompt) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    return list(prompt)


def _lazy_pick(logits: mx.array, sp: SamplingParams) -> mx.array:
    return mx.argmax(logits, axis=-1) if sp.greedy else sample(probs(logits, sp))


def _pick(logits: mx.array, sp: SamplingParams) -> int:
    return int(_lazy_pick(logits, sp).item())


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
) -> Iterator[GenerationResponse]:
    """Generate from `model` (an mlx-lm model), speculatively with `drafter`.

    Yields one GenerationResponse per token; the last one has `finish_reason`.
    Greedy output is token-for-token what mlx-lm's own `stream_generate` gives.
    Prompts longer than `max_context` tokens use plain decoding (DFlash gains
    shrink with context; the fallback is reported in the stats)."""
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
    mode = verify_mode if drafter is not None and verify_mode != "off" else "off"
    if verify_mode != "off" and drafter is None:
        stats.fallback = "no drafter"
    w = 1
    if mode != "off":
        w = block_size or min(DEFAULT_BLOCK_SIZE, drafter.block_size)
        if not 1 <= w <= drafter.block_size:
            raise ValueError(f"block size {w} must be between 1 and the drafter's trained block size {drafter.block_size}")
    pc = prompt_cache if prompt_cache is not None else PromptCache()
    if pc.target is None:
        pc.target = target.make_cache()
    if mode != "off" and max_context is not None and len(ids) > max_context:
        mode, stats.fallback = "off", f"prompt longer than max_context ({len(ids)} > {max_context})"
    if mode != "off" and not target.can_trim(pc.target):
        mode, stats.fallback = "off", "target KV cache cannot be trimmed"
        _notice("this target's KV cache cannot be trimmed; using plain decoding")
    stats.mode, stats.block_size = mode, w
    capture = list(drafter.config.target_layer_ids) if mode != "off" else []
    policy = None
    if mode == "adaptive":  # per-cycle width from the measured cost curve (adaptive.py)
        from .adaptive import AdaptiveWidth

        policy = AdaptiveWidth.create(model, drafter, max_width=w)

    # Reuse the cached prefix. Drafter context rows always cover a prefix of the
    # target's cached tokens; rows beyond what both share are dropped.
    if mode != "off" and (pc.drafter is None or pc.drafter_id != id(drafter)):
        pc.drafter, pc.drafter_id = drafter.make_cache(), id(drafter)
    keep = len(pc.tokens)
    if mode != "off":
        keep = min(keep, pc.drafter[0].offset)
    common = 0
    for x, y in zip(pc.tokens[:keep], ids[:-1]):  # always leave >= 1 token to process
        if x != y:
            break
        common += 1
    if common < len(pc.tokens):
        if target.can_trim(pc.target):
            target.trim(pc.target, len(pc.tokens) - common)
        else:
            pc.target, common = target.make_cache(), 0
    if pc.drafter is not None and pc.drafter[0].offset > common:
        for c in pc.drafter:
            c.trim(c.offset - common)
    stats.reused_tokens = common
    pc.tokens = list(ids[:common])

    emit = Emitter(tokenizer, stop, max_tokens, stats)
    tic = time.perf_counter()

    # -- prefill, chunked like mlx-lm so the first logits match it bit for bit --
    rest = ids[common:]
    feats = []
    while len(rest) > 1:
        n = min(prefill_step_size, len(rest) - 1)
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
    token = _pick(logits[0, -1], sp)
    new_feats = mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None)
    stats.prompt_time = time.perf_counter() - tic
    gen_tic = time.perf_counter()

    resp = emit.push(token, False)
    yield resp
    if emit.done:
        return
    if mode == "off":
        yield from _plain(target, pc, token, sp, emit, stats, gen_tic)
        return

    while True:
        remaining = max_tokens - len(emit.tokens)

        if policy and policy.plain_steps() > 1:  # a fallback burst: plain steps, pipelined
            def seen(cyc):
                policy.observe(cyc)
                stats.adaptive = policy.summary()
            token, new_feats = yield from _plain(target, pc, token, sp, emit, stats, gen_tic, capture,
                                                 policy.plain_steps(), new_feats, seen)
            if token is None:
                return
            continue
        ww = policy.width() if policy else w  # 1: a plain step that still feeds the drafter context
        ww = max(1, min(ww, remaining))  # never draft past max_tokens
        t0 = time.perf_counter()
        drafts, q, t_sel, conf = [], None, 0.0, None
        if ww > 1:
            prop = drafter.propose(target, token, new_feats, pc.drafter, ww, sp.temperature)
            drafts, q, t_sel, conf = prop.tokens, prop.q, prop.t_select, prop.conf
            new_feats = None
            if policy:  # verify only the drafts worth their cost
                n = policy.cut(prop)
                drafts, conf = drafts[:n], (conf[:n] if conf else conf)
                q = q[:n] if q is not None else None
        t_draft = time.perf_counter() - t0 - t_sel
        t2 = time.perf_counter()
        vin = mx.array([[token] + drafts])
        logits, f = target(vin, pc.target, capture)
        if sp.greedy:
            tgt = mx.argmax(logits[0], axis=-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == tgt[a]:
                a += 1
            bonus = tgt[a]
        else:
            a, bonus = accept_speculative(probs(logits[0], sp), drafts, q)
        t3 = time.perf_counter()
        # bookkeeping: roll back rejected rows; the anchor and accepted drafts
        # become drafter context, the bonus is the next anchor (no features yet)
        target.trim(pc.target, len(drafts) - a)
        pc.tokens += [token] + drafts[:a]
        if new_feats is None:
            new_feats = f[:, : a + 1]
        else:  # w == 1: nothing was drafted, keep accumulating context rows
            new_feats = mx.concatenate([new_feats, f[:, : a + 1]], axis=1)
        out = drafts[:a] + [bonus]
        token = bonus
        cyc = CycleStats(len(drafts) + 1, a, 0, t_draft, t_sel, t3 - t2, time.perf_counter() - t3)
        resps = []
        for i, tok in enumerate(out):
            cyc.emitted += 1
            resps.append(emit.push(tok, i < a, cyc))
            if emit.done:
                break
        stats.add(cyc)  # before yielding, so every token of the cycle sees it
        if policy:
            policy.observe(cyc, conf)
            stats.adaptive = policy.summary()
        stats.generation_time = time.perf_counter() - gen_tic
        yield from resps
        if emit.done:
            return


def _plain(target, pc, token, sp, emit, stats, gen_tic, capture=(), steps=None, feats=None, on_cycle=None):
    """Plain decoding, pipelined like mlx-lm: the step that consumes token n is
    queued on its lazy value before it is read back, so building the graph
    overlaps the compute (when a stop comes, the queued step is wasted, as in mlx-lm).

    `token` has been emitted; its KV row is not cached yet. With `steps`, stops
    after that many tokens (an adaptive fallback burst) and returns (the last
    token, emitted but not fed: the next anchor, or None when generation is over;
    the captured features of every row fed, appended to `feats`)."""
    def feed(tok):
        logits, f = target(tok.reshape(1, 1), pc.target, capture)
        nxt = _lazy_pick(logits[0, -1], sp)
        mx.async_eval(nxt, *([f] if f is not None else []))
        return nxt, f

    y, f = feed(mx.array(token))
    pc.tokens.append(token)
    feats = [feats, f] if feats is not None else [f]
    n = 0
    while True:
        t0 = time.perf_counter()
        nxt = None
        if len(emit.tokens) + 1 < emit.max_tokens and (steps is None or n + 1 < steps):
            nxt, f = feed(y)  # y may not be the last token: queue its step now
        tok = int(y.item())
        if nxt is not None:  # its KV row went in with the queued step: the cache and
            pc.tokens.append(tok)  # pc.tokens agree at every yield, even if the caller stops
            feats.append(f)
        n += 1
        cyc = CycleStats(1, 0, 1, t_verify=time.perf_counter() - t0)
        stats.add(cyc)
        if on_cycle:
            on_cycle(cyc)
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
