"""The decode session (DFLASH2.md section 4): one object per generation that
owns the target adapter, the prompt cache, the sampler, the emitter, the
policy and the stats (their only writer), with the steps as methods:

    run: plan -> reuse the prompt cache -> prefill -> loop
    loop: policy.next(state) -> a plain run (pipelined like mlx-lm), or a cycle:
          draft -> verify + accept (lazy) -> readback (the one host sync) ->
          rollback -> emit -> policy.observe(result)

Every mode is lossless: greedy output is the target's argmax path token for
token, sampling keeps the target's distribution (sampling.py)."""

from __future__ import annotations

import sys
import time
from typing import Iterator, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.prompt_cache import PromptCache, lookup_index, origin, reuse
from ..policy.base import DFLASH, LOOKUP, Draft, LoopState, Plain, Policy
from ..policy.registry import POLICIES, PolicyContext
from ..target.adapter import Target
from .decode_config import DecodeConfig
from .emitter import Emitter
from .logits import process, process_rows
from .sampling import accept_greedy, accept_sampled, probs, sample
from .stats import CycleResult, GenerationResponse, GenerationStats


def encode(tokenizer: Optional[TokenizerWrapper], prompt) -> List[int]:
    """A prompt (text, token ids or an mx.array) as token ids; text that already
    starts with the BOS token (a rendered chat template) gets no second one."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    return list(prompt)


def cat_feats(feats):
    """Concatenate captured feature blocks [1, n_i, F] (None entries skipped)."""
    feats = [x for x in feats if x is not None]
    return mx.concatenate(feats, axis=1) if len(feats) > 1 else (feats[0] if feats else None)


class Decoder:
    """One generation over an mlx-lm `model` (+ a DFlash `drafter`).

    `run(prompt)` yields one GenerationResponse per token; the last has
    `finish_reason`. With a `prompt_cache` (chat turns, server requests) the
    target's KV cache, the drafter's context and the lookup index carry over.
    `calibration` (calibrate.Calibration: what stream_generate passes) supplies
    measured costs and the guard's carried-over state to the policies that use
    them. Without a tokenizer a session works on token ids (no text, no EOS)."""

    def __init__(self, model, tokenizer, drafter=None, config: Optional[DecodeConfig] = None,
                 prompt_cache: Optional[PromptCache] = None, calibration=None):
        self.config = config or DecodeConfig()
        self.tokenizer = tokenizer if tokenizer is None or isinstance(tokenizer, TokenizerWrapper) \
            else TokenizerWrapper(tokenizer)
        self.calibration = calibration
        self.target = Target(model)
        self.drafter = drafter
        self.keep = prompt_cache is not None  # a later call continues from this one's cache
        self.pc = prompt_cache if prompt_cache is not None else PromptCache()
        self.sp = self.config.sampling()
        self.stats = GenerationStats()
        self.policy: Optional[Policy] = None
        self.use = None  # the drafter this call drafts with (None: none)
        self.capture: list = []  # the target layers the drafter reads
        self.index = None  # the n-gram index, for policies that verify prompt-lookup drafts
        self.sources: dict = {}  # draft source -> how many of n drafts it can offer now
        self.rows: list = []  # feature blocks of fed rows the drafter has not seen yet, in order
        self.emit: Optional[Emitter] = None
        self.hist = None  # prompt + the ids emitted before the anchor (mx.array), for logits processors
        self._due = None  # a decision taken between two plain tokens, run after the one in flight
        self._gen_tic = 0.0

    # -- plan -------------------------------------------------------------------------------
    def _plan(self, ids: List[int]) -> None:
        cfg, st, drafter = self.config, self.stats, self.drafter
        mode = cfg.verify_mode
        if mode != "off" and cfg.needs_plain:
            mode, st.fallback = "off", cfg.needs_plain
        if mode in ("dflash", "adaptive") and drafter is None:
            mode, st.fallback = "off", "no drafter"
        if mode != "off" and cfg.max_context is not None and len(ids) > cfg.max_context:
            mode, st.fallback = "off", f"prompt longer than max_context ({len(ids)} > {cfg.max_context})"
        use = drafter if mode != "off" else None
        w = 1
        if mode != "off":
            w = cfg.width(*((drafter.block_size, "the drafter's trained block size") if use is not None
                            else (64, "the lookup limit")))
        if mode != "off" and not self.target.can_trim(self.pc.target):
            mode, use, st.fallback = "off", None, "target KV cache cannot be trimmed"
            print("mlx-dflash: this target's KV cache cannot be trimmed; using plain decoding", file=sys.stderr)
        st.mode, st.block_size = mode, w
        carry = cfg.seed is None  # a seeded call does not inherit the last call's state: same seed, same sample
        ctx = PolicyContext(w, drafter.block_size if use is not None else w, len(ids), use is not None, cfg.guard,
                            cfg.default_width, cfg.lookup, costs=self._costs,
                            prior=lambda: self.calibration.prior(self.target.model, drafter)
                            if carry and self.calibration is not None else None,
                            plain_reason=st.fallback or "verify mode off")
        self.policy = POLICIES[mode](ctx)
        st.block_size = self.policy.widest or w  # the guard may choose up to the drafter's block size
        # a policy that never drafts from the drafter (the guard where DFlash cannot pay)
        # needs no features, unless a later call may draft from this cache
        if use is not None and not self.policy.uses_drafter and not self.keep:
            use = None
        self.use = use
        self.capture = list(use.config.target_layer_ids) if use is not None else []
        self.index = lookup_index(self.pc, ids) if self.policy.uses_lookup else None
        st.policy = self.policy.reason

    def _costs(self, **kw):
        if self.calibration is None:
            raise ValueError(f"verify mode '{self.config.verify_mode}' needs measured costs: "
                             "pass calibration=mlx_dflash.engine.calibrate.DEFAULT to the Decoder")
        return self.calibration.costs(self.target.model, self.drafter, **kw)

    def _sources(self) -> dict:
        out = {}
        if self.use is not None:
            out[DFLASH] = lambda n: n
        if self.index is not None:
            out[LOOKUP] = lambda n: len(self.index.propose(n))
        return out

    # -- run --------------------------------------------------------------------------------
    def run(self, prompt) -> Iterator[GenerationResponse]:
        cfg = self.config
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if cfg.seed is not None:
            mx.random.seed(cfg.seed)
        self.stats = GenerationStats(prompt_tokens=len(ids))
        if self.pc.target is None or not self._kv_fits():
            self.pc.target, self.pc.tokens = self.target.make_cache(), []
        self._plan(ids)
        common = reuse(self.target, self.pc, ids, self.use, cfg.drafter_layout)
        self.stats.reused_tokens = common
        self.stats.prompt_cache = origin(self.pc, common)
        self.emit = Emitter(self.tokenizer, cfg.stop, cfg.max_tokens)
        if cfg.logits_processors:
            self.hist = mx.array(ids, mx.int32)
        self.sources = self._sources()

        tic = time.perf_counter()
        pending = None
        if self.use is not None:  # (a call without the drafter leaves them for a later one)
            pending, self.pc.pending = self.pc.pending, None
        token, lp, feats = self.prefill(ids[common:], pending)
        self.rows = [feats]  # the next draft takes them
        self.stats.prompt_time = time.perf_counter() - tic
        self._gen_tic = time.perf_counter()
        if self.index is not None:
            self.index.append(token)
        try:
            yield self._emit(token, False, None, lp)
            if not self.emit.done:
                yield from self._loop(token)
        finally:
            if self.use is not None:  # they stay with the cache: the next call's first draft takes them
                self.pc.pending = cat_feats(self.rows)
            obs = self.policy.observed()  # the guard's acceptance and state carry over to the next request
            if obs is not None and self.calibration is not None:
                self.calibration.keep(self.target.model, self.drafter, obs)

    def _loop(self, token: int):
        while True:
            d = self._due or self.policy.next(LoopState(self.emit.left, self.sources, context=len(self.pc.tokens)))
            self._due = None
            if isinstance(d, Plain):
                token = yield from self.plain(token, d.n)
            else:
                token = yield from self.cycle(token, d)
            if token is None:
                return

    # -- the steps --------------------------------------------------------------------------
    def _pick(self, logits: mx.array, fed=None):
        """The next token (lazy) from one row of logits, after the logits
        processors (which see the ids so far, `fed` appended); with processors or
        logprobs also the log-probabilities, which are then what is sampled, as
        mlx-lm's generate_step does."""
        cfg = self.config
        if cfg.logits_processors:
            if fed is not None:
                self.hist = mx.concatenate([self.hist, fed.reshape(1).astype(mx.int32)])
            logits = process(cfg.logits_processors, self.hist, logits)  # (log-probabilities)
        elif cfg.logprobs:
            logits = logits - mx.logsumexp(logits, keepdims=True)
        tok = mx.argmax(logits, axis=-1) if self.sp.greedy else sample(probs(logits, self.sp))
        return tok, (logits if cfg.logprobs else None)

    def prefill(self, rest: List[int], pending=None):
        """The prompt's uncached tokens, chunked like mlx-lm so the first logits
        match it bit for bit (its KV quantization at the same points). Returns (the
        first token, its log-probabilities or None, the captured features of
        every prompt row, after the `pending` ones of the cached rows). After
        each chunk, `prefill_progress(done, total)`; an exception it raises
        cancels the call, leaving the prompt cache consistent: its tokens are
        the chunks done, their features pending."""
        step, pc, feats = self.config.prefill_step_size, self.pc, [pending]
        report, total, done = self.config.prefill_progress, len(rest), 0
        try:
            while len(rest) > 1:
                n = min(step, len(rest) - 1)
                _, f = self.target(mx.array(rest[:n])[None], pc.target, self.capture)
                self._quantize()
                mx.eval(f if f is not None else [c.state for c in pc.target])
                if f is not None:
                    feats.append(f)
                pc.tokens += rest[:n]
                rest, done = rest[n:], done + n
                if report is not None:
                    report(done, total)
            logits, f = self.target(mx.array(rest)[None], pc.target, self.capture)
            self._quantize()
            if f is not None:
                feats.append(f)
            pc.tokens += rest
            tok, lp = self._pick(logits[0, -1])
            tok = int(tok.item())
        except BaseException:
            if self.use is not None:  # the next call's first draft takes them
                pc.pending = cat_feats(feats)
            raise
        if report is not None and done < total:  # (the last token: its cache row is in)
            report(total, total)
        return tok, lp, cat_feats(feats)

    def draft(self, token: int, width: int):
        """The DFlash drafter's proposal for this cycle (lazy), from the features
        of the rows it has not seen yet (which it takes into its context)."""
        prop = self.use.propose(self.target, token, cat_feats(self.rows), self.pc.drafter, width,
                                self.sp.temperature)
        self.rows.clear()
        if not isinstance(prop.tokens, mx.array):  # a drafter may hand over a list
            prop.tokens = mx.array(list(prop.tokens), mx.int32)
        return prop

    def verify(self, token: int, drafts: mx.array, q):
        """[anchor, drafts] through the target in one forward, accepted on the
        device, lazily. Returns (the result row for `readback`, the captured features).
        With logits processors the drafts are read to the host first (their one
        extra sync) and each row is processed after its own history (logits.py),
        as plain decoding processes that position: `self.hist` is the ids before
        the anchor."""
        vin = mx.concatenate([mx.array([token], mx.int32), drafts.astype(mx.int32)])[None]
        logits, f = self.target(vin, self.pc.target, self.capture)
        rows = logits[0]
        if self.config.logits_processors:
            rows = process_rows(self.config.logits_processors, self.hist, [token] + drafts.tolist(), rows)
        if self.sp.greedy:
            a, tgt = accept_greedy(rows, drafts)
            return mx.concatenate([a[None], tgt]), f  # emitted = tgt[:a+1]
        a, nxt = accept_sampled(probs(rows, self.sp), drafts, q)
        return mx.concatenate([a[None], drafts.astype(mx.int32), nxt.astype(mx.int32)[None]]), f

    def readback(self, res: mx.array):
        """The cycle's ONE host sync: the drafts, the verify and the acceptance are
        evaluated together. Returns (accepted count a, emitted tokens)."""
        r = res.tolist()
        a = r[0]
        return a, (r[1: a + 2] if self.sp.greedy else r[1: a + 1] + [r[-1]])

    def rollback(self, token: int, out: List[int], a: int, n: int, f):
        """Drop the rejected rows from the target's caches; the anchor and the
        accepted drafts become drafter context (their features are returned),
        the bonus is the next anchor."""
        self.target.trim(self.pc.target, n - a)
        self._quantize()  # on the kept rows, as mlx-lm's token-by-token loop would have
        self.pc.tokens.append(token)
        self.pc.tokens += out[:a]
        return None if f is None else f[:, : a + 1]

    def _trim(self, prop):
        """The policy's cut (verify mode adaptive): reads the drafts' confidences
        back, the one extra sync of that mode. Returns (drafts, q, conf, seconds waited)."""
        t = time.perf_counter()
        mx.eval(prop.tokens, prop.conf)
        t = time.perf_counter() - t
        conf = prop.conf.tolist() if isinstance(prop.conf, mx.array) else list(prop.conf)
        k = self.policy.trim(prop.tokens.tolist(), conf)
        return prop.tokens[:k], (prop.q[:k] if prop.q is not None else None), conf[:k], t

    def cycle(self, token: int, d: Draft):
        """One draft + verify cycle. Returns the next anchor, or None when generation is over."""
        t0 = time.perf_counter()
        # the published loops' last block: one row past max_tokens, its bonus token dropped
        w = min(d.width, self.emit.left + 1, self._kv_room())
        q, conf, t_cut = None, None, 0.0
        if w < 2:
            drafts = mx.zeros((0,), mx.int32)
        elif d.source == LOOKUP:
            look = self.index.propose(w - 1)
            if not look:  # (a decision taken a token ago: the context moved on)
                return token
            drafts = mx.array(look, mx.int32)
        elif d.source == DFLASH and self.use is not None:
            prop = self.draft(token, w)
            drafts, q = prop.tokens, prop.q
            if self.policy.reads_confidence:
                drafts, q, conf, t_cut = self._trim(prop)
        else:
            raise RuntimeError(f"the policy asked for drafts from '{d.source}', which this call does not have")
        n = drafts.shape[0]
        t2 = time.perf_counter()
        res, f = self.verify(token, drafts, q)
        t_wait = time.perf_counter()
        a, out = self.readback(res)
        t3 = time.perf_counter()
        self.rows.append(self.rollback(token, out, a, n, f))
        if self.config.logits_processors:  # the ids before the next anchor (the bonus), as plain's
            self.hist = mx.concatenate([self.hist, mx.array([token] + out[:a], mx.int32)])
        if self.index is not None:
            self.index.extend(out)
        cyc = CycleResult(n + 1, a, 0, t_draft=t2 - t0, t_verify=t3 - t2, t_book=time.perf_counter() - t3,
                          source=d.source if n else "", t_wait=t3 - t_wait + t_cut, conf=conf)
        resps = []
        for i, tok in enumerate(out):
            cyc.emitted += 1
            resps.append(self._emit(tok, i < a, cyc))
            if self.emit.done:
                break
        self._account(cyc)  # before yielding, so every token of the cycle sees it
        yield from resps
        return None if self.emit.done else out[-1]

    def _feed(self, tok: mx.array):
        """Queue the plain step that consumes `tok` (lazy), so building the next
        graph overlaps this compute. Returns (next token, its log-probs, features)."""
        logits, f = self.target(tok.reshape(1, 1), self.pc.target, self.capture)
        self._quantize()
        nxt, lp = self._pick(logits[0, -1], tok)
        mx.async_eval(nxt, *([f] if f is not None else []), *([lp] if lp is not None else []))
        return nxt, lp, f

    def plain(self, token: int, n: Optional[int]):
        """Plain decoding, pipelined like mlx-lm: the step that consumes token k is
        queued on its lazy value before it is read back (when a stop comes, the
        queued step is wasted, as in mlx-lm). `token` has been emitted; its KV row
        is not cached yet. Runs at most `n` tokens (None: no bound); between two
        tokens the policy is asked again, and a draft it asks for runs after the
        token in flight. Returns the next anchor, or None when generation is over."""
        budget = n
        t = time.perf_counter()
        y, ylp, f = self._feed(mx.array(token))
        queued = time.perf_counter() - t  # on mlx-cpu, async_eval can block on the step before
        self.pc.tokens.append(token)
        self.rows.append(f)
        while True:
            t0 = time.perf_counter()
            nxt = None
            if (budget is None or budget > 1) and self._due is None and self.emit.left > 1:
                nxt, nlp, f = self._feed(y)  # y may not be the last token: queue its step now
            t_wait = time.perf_counter()
            tok = int(y.item())
            t_wait, queued = time.perf_counter() - t_wait + queued, 0.0
            if nxt is not None:  # its KV row went in with the queued step: the cache and
                self.pc.tokens.append(tok)  # pc.tokens agree at every yield, even if the caller stops
                self.rows.append(f)
            if self.index is not None:
                self.index.append(tok)
            cyc = CycleResult(1, 0, 1, t_verify=time.perf_counter() - t0, t_wait=t_wait)
            resp = self._emit(tok, False, cyc, ylp)
            self._account(cyc)
            if nxt is not None and not self.emit.done:  # ask again between two tokens
                d = self.policy.next(LoopState(self.emit.left, self.sources, True, len(self.pc.tokens)))
                if isinstance(d, Plain):
                    budget = d.n
                else:
                    self._due = d  # after the token in flight
            yield resp
            if self.emit.done:
                return None
            if nxt is None:
                return tok
            y, ylp = nxt, nlp

    # -- KV cache quantization (mlx-lm's kv_bits) --------------------------------------------
    def _quantizable(self):
        """(index, cache) of the target layers mlx-lm's maybe_quantize_kv_cache would
        convert (sliding-window layers, which mlx-lm cannot quantize, stay)."""
        for i, c in enumerate(self.pc.target):
            if hasattr(c, "to_quantized") and not isinstance(c, RotatingKVCache):
                yield i, c

    def _kv_fits(self) -> bool:
        """Whether the kept cache's quantized layers are this call's kv_bits and
        group size (another KV quantization starts over, as mlx-lm's server does)."""
        cfg = self.config
        return all(c.bits == cfg.kv_bits and c.group_size == cfg.kv_group_size
                   for c in self.pc.target if isinstance(c, QuantizedKVCache))

    def _quantize(self) -> None:
        """After each target forward, as mlx-lm's generate_step: a layer whose cache
        holds quantized_kv_start rows becomes a QuantizedKVCache (lazy)."""
        cfg = self.config
        if cfg.kv_bits is None:
            return
        for i, c in list(self._quantizable()):
            if c.offset >= cfg.quantized_kv_start:
                self.pc.target[i] = c.to_quantized(group_size=cfg.kv_group_size, bits=cfg.kv_bits)

    def _kv_room(self) -> int:
        """The widest verify that ends before the cache is quantized: mlx-lm,
        token by token, quantizes once quantized_kv_start rows are in, so the rows
        after that see quantized keys; a verify must not straddle that point."""
        cfg = self.config
        if cfg.kv_bits is not None:
            for _, c in self._quantizable():
                return max(1, cfg.quantized_kv_start - c.offset)
        return sys.maxsize

    # -- emission and accounting ------------------------------------------------------------
    def _emit(self, token: int, from_draft: bool, cycle: Optional[CycleResult], logprobs=None):
        text, reason = self.emit.push(token)
        st = self.stats
        st.generation_tokens = len(self.emit.tokens)
        if reason:
            st.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(text, token, from_draft, reason, st, cycle, logprobs)

    def _account(self, cyc: CycleResult) -> None:
        st, pol = self.stats, self.policy
        st.add(cyc)
        pol.observe(cyc)
        st.policy, st.adaptive = pol.reason, pol.summary()
        st.generation_time = time.perf_counter() - self._gen_tic
