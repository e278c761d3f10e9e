"""The decode engine: one loop for one stream and many (ENGINE.md; vLLM v1's
shape: a single stream is a set of one).

    submit(prompt, config, prompt_cache) -> uid   queued; joins the set at a step boundary
    step() -> [(uid, GenerationResponse)]        prefill chunks of queued requests (interleaved,
                                                  up to prefill_step_size tokens), then one step
                                                  of the running set
    cancel(uid) / close(uid)                      leaves at the next boundary / now
    released()                                    the prompt caches of requests that left

A step of the running set is what the policy (policy/: one decision for the
set, `Decision`) asks for:
- a draft + verify cycle: each row's drafts from its source (drafting/
  proposers.py: the DFlash drafter's one forward for the rows that draft from
  it, prompt lookup for the others) -> one verify forward over [B, w] with
  feature capture -> each row's acceptance on the device (greedy: the longest
  prefix equal to the target's argmax; sampled: the lossless rule with the
  row's own PRNG key; logits processors applied to each verify row after its
  own history: logits.py) -> the one readback -> each row's rollback of its
  rejected rows (every cache kind) -> emission -> policy.observe;
- or one plain step of every row, pipelined like mlx-lm: the step that consumes
  token k is queued on its lazy value before it is read back, and the policy
  is asked between two tokens (a draft it asks for runs after the token in flight).

Caches: a set of one decodes in its own caches (any kind mlx-lm makes,
quantized KV included, exactly as mlx-lm's generate_step); a set of many in
one batch cache (batch_cache.py: rows prefilled alone, joined, ragged
rollback), back in its own caches when it is alone again. A request that must
run alone (policy.registry.runs_alone: verify mode adaptive, a quantized KV
cache) joins only an empty set, and nothing joins it.

Every path is lossless: greedy output is the target's argmax path token for
token, sampling keeps the target's distribution (sampling.py)."""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.prompt_cache import PromptCache, lookup_index, origin, reuse
from ..drafting.proposers import PROPOSERS
from ..policy.base import DFLASH, CycleResult, Decision, Policy
from ..policy.costs import CostModel
from ..policy.guard import Guard
from ..policy.registry import MODES, PolicyContext, plan, runs_alone
from ..target.adapter import Target
from . import batch_cache as bc
from .cost_source import CostSource
from .decode_config import DecodeConfig
from .emitter import Emitter
from .logits import process, process_rows
from .sampling import accept_greedy, accept_sampled, probs, sample
from .sequence import Sequence, cat_feats
from .stats import GenerationResponse, GenerationStats

Event = Tuple[int, GenerationResponse]


class BatchError(ValueError):
    """A model or request the engine cannot run in a set of several (the reason is in the message)."""


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


class Engine:
    """Decodes a set of sequences over an mlx-lm `model` (+ a DFlash `drafter`).

    `max_batch`: sequences decoding together (more wait, prefilled as rows
    leave). `calibration` (calibrate.Calibration): the measured costs and the
    guard's carried-over state (None: only fixed widths and plain decoding,
    which need no costs). `target`: the target adapter (default Target(model);
    a split target's on every rank). `prefill_together`: requests that arrive
    together with short prompts, on a target with only KV layers, are prefilled
    in one left-padded forward. `policy`: the set's policy (default: the guard,
    built when a row first needs it). `defer_costs`: a curve the guard needs
    that is not measured yet is not measured inside the request: the guard
    decodes plain until the caller measures it (`costs.measure_next`, see
    cost_source.py; a server does, while idle)."""

    def __init__(self, model, tokenizer, drafter=None, *, max_batch: int = 1, calibration=None,
                 prefill_step_size: int = 2048, prefill_together: bool = False, target: Optional[Target] = None,
                 policy: Optional[Policy] = None, defer_costs: bool = False):
        self.tokenizer = tokenizer if tokenizer is None or isinstance(tokenizer, TokenizerWrapper) \
            else TokenizerWrapper(tokenizer)
        self.model, self.drafter, self.calibration = model, drafter, calibration
        self.defer_costs, self._source = defer_costs, None
        self.target = target or Target(model)
        if max_batch < 1:
            raise BatchError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > 1:
            why = bc.unsupported(self.target)
            if why:
                raise BatchError(f"this model cannot decode in a batch: {why}")
        self.max_batch, self.prefill_step_size = max_batch, prefill_step_size
        self.together = prefill_together and max_batch > 1 and bc.paddable(self.target)
        self.proposers = {name: cls(drafter) for name, cls in PROPOSERS.items()}
        self.guard: Optional[Policy] = policy
        self.capture_layers = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.rows: List[Sequence] = []  # decoding, in batch order
        self.waiting: Deque[Sequence] = deque()  # queued or prefilling (the first one)
        self.cache: Optional[list] = None  # the batch cache of several rows (None: the row's own)
        self._uid = 0
        self._flight = None  # a plain step queued: (next tokens [B], their log-probs, their features)
        self._due: Optional[tuple] = None  # (rows' uids, a draft decided for them between two plain tokens)
        self._accounted: Optional[float] = None  # when the last step was accounted (CycleResult.t_step)
        self._released: List[Tuple[int, PromptCache]] = []
        self._evaluate = True  # leaving rows' caches are evaluated (close(evaluate=False): not)
        self.cycles = self.drafter_forwards = self.occupancy = self.prefilled_together = 0

    # -- requests ---------------------------------------------------------------------------
    def submit(self, prompt, config: Optional[DecodeConfig] = None, prompt_cache: Optional[PromptCache] = None,
               keep: bool = False) -> int:
        """Queue a request; returns its uid. ValueError (one line) for a prompt
        that cannot run (empty; a block size the drafter cannot take). With a
        `prompt_cache`, its reusable prefix is not prefilled again, and the cache
        comes back filled when the request leaves (`released()`; `keep`: a later
        call continues it, so its drafter context is grown even where this call's
        policy would not draft)."""
        cfg = config or DecodeConfig()
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        pc = prompt_cache if prompt_cache is not None else PromptCache()
        if pc.target is None or not self._fits(pc.target, cfg):
            pc.target, pc.tokens = self.target.make_cache(), []
        p = plan(cfg, self.drafter, len(ids), self.target.can_trim(pc.target), shared=self.max_batch > 1)
        self._uid += 1
        sp = cfg.sampling()
        st = GenerationStats(mode=p.mode, fallback=p.fallback, max_width=p.cap, guard=p.guarded,
                             prompt_tokens=len(ids))
        seq = Sequence(self._uid, cfg, p, sp, Emitter(self.tokenizer, cfg.stop, cfg.max_tokens), st, pc, [],
                       capture=False, returned=prompt_cache is not None)
        if p.mode == "off" and p.fallback and p.fallback.startswith("target KV"):
            print("mlx-dflash: this target's KV cache cannot be trimmed; using plain decoding", file=sys.stderr)
        seq.policy = self._policy_for(seq, len(ids))
        seq.capture = p.drafter and (keep or seq.policy.uses_drafter(p, len(ids)))
        if not sp.greedy:
            seed = cfg.seed if cfg.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
            seq.key = mx.random.key(seed)
        common = reuse(self.target, pc, ids, self.drafter if seq.capture else None, cfg.drafter_layout)
        seq.rest, st.reused_tokens, st.prompt_cache = list(ids[common:]), common, origin(pc, common)
        pc.index = None if not p.lookup else lookup_index(pc, ids)
        if seq.capture:
            pc.drafter_id, pc.drafter_layout = id(self.drafter), tuple(cfg.drafter_layout)
            if pc.pending is not None:
                seq.pending.append(pc.pending)
            pc.pending = None
        if cfg.logits_processors:
            seq.hist = mx.array(ids, mx.int32)
        seq.sources = {name: pr for name, pr in self.proposers.items() if name != DFLASH or seq.capture}
        self.waiting.append(seq)
        return seq.uid

    def _fits(self, cache: list, cfg: DecodeConfig) -> bool:
        """Whether a kept cache can go on: its quantized layers are this call's
        kv_bits and group size (another KV quantization starts over, as mlx-lm's
        server does; a cache quantized by an earlier call cannot join a batch)."""
        return all((c.bits, c.group_size) == (cfg.kv_bits, cfg.kv_group_size)
                   for c in cache if isinstance(c, QuantizedKVCache))

    def _policy_for(self, seq: Sequence, context: int) -> Policy:
        own = MODES[seq.plan.mode].policy
        if own is not None:  # it runs alone (runs_alone): a policy of its own
            return own(PolicyContext(seq.plan, context, self._costs))
        if self.guard is None:
            self.guard = Guard(lambda: self._cost_model(), self.calibration.prior(self.model, self.drafter)
                               if self.calibration is not None else None)
        return self.guard

    def _costs(self, **kw):
        if self.calibration is None:
            raise ValueError("the guard and verify mode 'adaptive' need measured costs: pass "
                             "calibration=mlx_dflash.engine.calibrate.DEFAULT")
        return self.calibration.costs(self.model, self.drafter, **kw)

    @property
    def costs(self) -> Optional[CostSource]:
        """Where the guard's prices come from (None: nothing to price: no drafter or no calibration)."""
        if self._source is None and self.calibration is not None and self.drafter is not None:
            self._source = CostSource(self.model, self.drafter, self.calibration, self.max_batch > 1,
                                      self.defer_costs)
        return self._source

    def _cost_model(self) -> CostModel:
        if self.costs is None:
            self._costs()  # (its one-line error)
        return self.costs.cost_model()

    def cancel(self, uid: int) -> None:
        """The request leaves at the next step boundary; the others go on as if it had never been there."""
        for s in list(self.rows) + list(self.waiting):
            if s.uid == uid:
                s.cancelled = True

    def close(self, uid: int, evaluate: bool = True) -> None:
        """The request leaves now (its caller has stopped reading): its prompt
        cache is filled. `evaluate` False: after a failure (a lost rank's
        collective would never finish), its caches are handed back as they are."""
        self.cancel(uid)
        self._evaluate = evaluate
        try:
            self._drop_cancelled()
        finally:
            self._evaluate = True

    def released(self) -> List[Tuple[int, PromptCache]]:
        """(uid, prompt cache) of each request submitted with one that left since
        the last call, its caches holding the tokens it says, ready for a store."""
        out, self._released = self._released, []
        return out

    def __len__(self) -> int:
        return len(self.rows) + len(self.waiting)

    def summary(self) -> Dict[str, int]:
        """What /metrics shows: rows decoding, requests waiting, the batch's slots per row."""
        return {"rows": len(self.rows), "waiting": len(self.waiting), "max_batch": self.max_batch,
                "slots": bc.size(self.cache), "cycles": self.cycles, "drafter_forwards": self.drafter_forwards,
                "prefilled_together": self.prefilled_together}

    # -- the loop ---------------------------------------------------------------------------
    def run(self):
        """Step until every request is done, yielding (uid, response) events."""
        while len(self):
            yield from self.step()

    def step(self, emit: Optional[Callable[[int, GenerationResponse], None]] = None) -> List[Event]:
        """Prefill chunks of queued requests (while rows are free, up to
        prefill_step_size tokens: short prompts all join at once, a long one is
        interleaved with the steps), then one step of the running set. Returns
        the tokens it produced, in order; `emit(uid, response)` gets each one as
        soon as it exists (a first token before the next prefill)."""
        events: List[Event] = []

        def out(evs):
            events.extend(evs)
            if emit is not None:
                for ev in evs:
                    emit(*ev)

        self._drop_cancelled()
        started = False  # a request's first token came this step: its caller sees it before its first cycle
        if self._flight is None:  # (a plain run in flight ends first: nothing joins mid-run)
            budget = self.prefill_step_size
            group = self._group(budget)
            if group:
                budget -= sum(len(s.rest) for s in group)
                out(self._prefill_together(group))
                started = True
            while self._admits() and budget > 0:
                s = self.waiting[0]
                before = len(s.rest)
                ev = self._prefill(s)
                budget -= max(1, before - len(s.rest))
                if ev is not None:
                    out([ev])
                    started = True
        if self.rows and not started:
            out(self._step())
        self._retire()
        return events

    def _admits(self) -> bool:
        """Whether the first waiting request may start now (free rows; one that runs alone waits for an empty set)."""
        if not self.waiting or len(self.rows) >= self.max_batch:
            return False
        alone = lambda s: runs_alone(s.config) is not None  # noqa: E731
        return not self.rows or not (alone(self.waiting[0]) or any(alone(s) for s in self.rows))

    def _step(self) -> List[Event]:
        self._alone_again()
        rows = self.rows
        if self._flight is not None:
            return self._plain()
        due, self._due = self._due, None  # (a set changed since, by a join or a leave, is decided anew)
        d = due[1] if due is not None and due[0] == [s.uid for s in rows] else rows[0].policy.decide(rows)
        if d.width == 1:
            return self._plain()
        return self._cycle(d)

    # -- prefill ----------------------------------------------------------------------------
    def _prefill(self, s: Sequence) -> Optional[Event]:
        """One chunk of `s`'s prompt (its own caches, chunked as mlx-lm chunks it,
        so the first logits match it bit for bit); after the last one, its first
        token, and it joins the set. `prefill_progress(done, total)` after each
        chunk; an exception it raises cancels the request (its prompt cache keeps
        the chunks done, their features pending) and propagates."""
        cfg, pc, rest = s.config, s.pc, s.rest
        layers = self.capture_layers if s.capture else []
        try:
            if len(rest) > 1:
                n = min(cfg.prefill_step_size, len(rest) - 1)
                _, f = self.target(mx.array(rest[:n])[None], pc.target, layers)
                self._quantize(s)
                mx.eval(f if f is not None else [c.state for c in pc.target])
                if f is not None:
                    s.pending.append(f)
                pc.tokens += rest[:n]
                s.rest = rest[n:]
                self._progress(s)
                return None
            logits, f = self.target(mx.array(rest)[None], pc.target, layers)
            self._quantize(s)
            if f is not None:
                s.pending.append(f)
            pc.tokens += rest
            s.rest = []
            tok, lp = self._pick(s, logits[0, -1])
            tok = int(tok.item())
            self._progress(s)
        except BaseException:
            self.waiting.remove(s)
            s.cancelled = True
            self._release(s, pc.target)
            raise
        self.waiting.popleft()
        s.stats.prompt_time = time.perf_counter() - s.t_start
        return self._start(s, tok, lp)

    def _progress(self, s: Sequence) -> None:
        report = s.config.prefill_progress
        if report is not None:
            total = s.stats.prompt_tokens - s.stats.reused_tokens
            report(total - len(s.rest), total)

    def _start(self, s: Sequence, tok: int, lp=None) -> Event:
        """After its prefill: the first token, and the sequence joins the set."""
        s.t_gen = time.perf_counter()
        if s.capture and s.pc.drafter is None:
            s.pc.drafter = self.drafter.make_cache(*s.config.drafter_layout)
        s.anchor = tok
        ev = (s.uid, self._emit(s, tok, False, None, lp))
        if s.done:
            self._release(s, s.pc.target)
            return ev
        if self.rows:
            mx.eval([c.state for c in s.pc.target])
            if self.cache is None:  # the set's first row leaves its own caches for the batch's
                self.cache, self.rows[0].pc.target = bc.to_batch(self.rows[0].pc.target), None
            self.cache, s.pc.target = bc.join(self.cache, bc.to_batch(s.pc.target)), None
        self.rows.append(s)
        return ev

    def _group(self, budget: int) -> List[Sequence]:
        """The queued requests prefilled together now: the first ones in the queue
        not started yet, each prompt one chunk, within the token budget and the
        free rows; at least two (else one at a time)."""
        if not self.together:
            return []
        group, total = [], 0
        for s in self.waiting:
            n = len(s.rest)
            if (len(self.rows) + len(group) >= self.max_batch or s.stats.reused_tokens or s.pc.tokens
                    or runs_alone(s.config) or not 2 <= n <= s.config.prefill_step_size + 1 or total + n > budget):
                break
            group.append(s)
            total += n
        return group if len(group) > 1 else []

    def _prefill_together(self, group: List[Sequence]) -> List[Event]:
        """The prompts of `group` in the two forwards each would take alone (all
        but its last token, then its last token), batched with left padding;
        each row's first token, then the rows join the set."""
        self.prefilled_together += len(group)
        heads = [s.rest[:-1] for s in group]
        m = max(len(h) for h in heads)
        pad = [m - len(h) for h in heads]
        cache = bc.padded(self.target, pad)
        layers = self.capture_layers if any(s.capture for s in group) else []
        _, f = self.target(mx.array([[0] * p + h for p, h in zip(pad, heads)], mx.int32), cache, layers)
        logits, f2 = self.target(mx.array([[s.rest[-1]] for s in group], mx.int32), cache, layers)
        mx.eval(logits, [c.state for c in cache], *([f, f2] if f is not None else []))
        if self.rows and self.cache is None:
            self.cache, self.rows[0].pc.target = bc.to_batch(self.rows[0].pc.target), None
        events, keep = [], []
        for i, s in enumerate(group):
            self.waiting.popleft()
            s.pc.tokens += s.rest
            s.rest = []
            s.stats.prompt_time = time.perf_counter() - s.t_start
            if s.capture:
                s.pending.append(cat_feats([f[i: i + 1, pad[i]:], f2[i: i + 1]]))
            tok, lp = self._pick(s, logits[i, -1])
            s.anchor, s.t_gen = int(tok.item()), time.perf_counter()
            if s.capture and s.pc.drafter is None:
                s.pc.drafter = self.drafter.make_cache(*s.config.drafter_layout)
            events.append((s.uid, self._emit(s, s.anchor, False, None, lp)))
            if s.done:
                self._release(s, [c.extract(i) for c in cache])
            else:
                keep.append(i)
                self.rows.append(s)
                s.pc.target = None
        if keep:
            self.cache = bc.join(self.cache, bc.keep(cache, keep))
        return events

    # -- the caches of the running set ---------------------------------------------------------
    def _forward(self, tokens: mx.array, layers, verify: bool = False):
        """The target over tokens [B, w] with the set's caches (a set of one:
        its KV quantized after the forward, as mlx-lm's generate_step does; after
        a verify, only once its rejected rows are dropped: `_rollback`). A
        verify's attention takes the form whose cost does not grow with the
        context where that is faster (Target.verify_forward)."""
        run = self.target.verify_forward if verify else self.target
        if self.cache is None:
            s = self.rows[0]
            out = run(tokens, s.pc.target, layers)
            if not verify:
                self._quantize(s)
            return out
        return run(tokens, self.cache, layers)

    def _rollback(self, width: int, drop: List[int]) -> None:
        """Row b drops its last drop[b] rows of a forward of `width` tokens."""
        if self.cache is None:
            s = self.rows[0]
            self.target.trim(s.pc.target, drop[0])
            self._quantize(s)  # on the kept rows, as mlx-lm's token-by-token loop would have
        else:
            bc.rollback(self.target, self.cache, width, drop)

    def _quantize(self, s: Sequence) -> None:
        """After each target forward, as mlx-lm's generate_step: a layer whose
        cache holds quantized_kv_start rows becomes a QuantizedKVCache (lazy;
        sliding-window layers, which mlx-lm cannot quantize, stay)."""
        cfg = s.config
        if cfg.kv_bits is None:
            return
        cache = s.pc.target
        for i, c in enumerate(cache):
            if hasattr(c, "to_quantized") and not isinstance(c, RotatingKVCache) and \
                    c.offset >= cfg.quantized_kv_start:
                cache[i] = c.to_quantized(group_size=cfg.kv_group_size, bits=cfg.kv_bits)

    def _kv_room(self, s: Sequence) -> int:
        """The widest verify that ends before the cache is quantized: mlx-lm,
        token by token, quantizes once quantized_kv_start rows are in, so the rows
        after that see quantized keys; a verify must not straddle that point."""
        cfg = s.config
        if cfg.kv_bits is not None and s.pc.target is not None:
            for c in s.pc.target:
                if hasattr(c, "to_quantized") and not isinstance(c, RotatingKVCache):
                    return max(1, cfg.quantized_kv_start - c.offset)
        return sys.maxsize

    # -- picking tokens ------------------------------------------------------------------------
    def _pick(self, s: Sequence, logits: mx.array, fed=None):
        """The next token (lazy) from one row of logits, after the row's logits
        processors (which see its ids so far, `fed` appended); with processors or
        logprobs also the log-probabilities, which are then what is sampled, as
        mlx-lm's generate_step does."""
        cfg = s.config
        if cfg.logits_processors:
            if fed is not None:
                s.hist = mx.concatenate([s.hist, fed.reshape(1).astype(mx.int32)])
            logits = process(cfg.logits_processors, s.hist, logits)  # (log-probabilities)
        elif cfg.logprobs:
            logits = logits - mx.logsumexp(logits, keepdims=True)
        tok = mx.argmax(logits, axis=-1) if s.sp.greedy else sample(probs(logits, s.sp), s.next_key())
        return tok, (logits if cfg.logprobs else None)

    # -- plain steps, pipelined ------------------------------------------------------------------
    def _feed(self, toks: mx.array):
        """Queue the plain step that consumes `toks` [B] (lazy), so building the
        next graph overlaps this compute. Returns (next tokens [B], their
        log-probs per row or None, the captured features)."""
        rows = self.rows
        layers = self.capture_layers if any(s.capture for s in rows) else []
        logits, f = self._forward(toks.reshape(-1, 1), layers)
        last = logits[:, -1]
        if all(s.sp.greedy and not s.config.logits_processors and not s.config.logprobs for s in rows):
            nxt, lps = mx.argmax(last, axis=-1), None
        else:
            picks = [self._pick(s, last[b], toks[b]) for b, s in enumerate(rows)]
            nxt = mx.stack([t.reshape(()) for t, _ in picks])
            lps = [lp for _, lp in picks]
        mx.async_eval(nxt, *([f] if f is not None else []), *[x for x in lps or () if x is not None])
        return nxt, lps, f

    def _plain(self, t_draft: float = 0.0) -> List[Event]:
        """One plain token of every row. The step consuming the anchors is queued
        first (their K/V go in with it); while the policy keeps deciding plain,
        the step consuming this token is queued before this one is read back.
        When it is not, the token read is the next anchor (not cached yet).
        `t_draft`: what a cycle that ended up verifying no draft paid for drafting."""
        rows, t0 = self.rows, time.perf_counter()
        self.occupancy = len(rows)
        if self._flight is None:
            self._flight = self._feed(mx.array([s.anchor for s in rows], mx.int32))
            self._book_fed(rows, [s.anchor for s in rows], self._flight[2])
        y, lps, _ = self._flight
        go = self._due is None and not self._admits_soon() and all(s.emit.left > 1 for s in rows)
        nxt = self._feed(y) if go else None  # y may not be the last token: queue its step now
        t_wait = time.perf_counter()
        toks = y.tolist()
        t_wait = time.perf_counter() - t_wait
        if nxt is not None:  # its K/V went in with the queued step: caches and tokens agree at every yield
            self._book_fed(rows, toks, nxt[2])
        events, results = [], []
        for b, s in enumerate(rows):
            cyc = CycleResult(1, 0, 1, t_draft=t_draft, t_verify=time.perf_counter() - t0, t_wait=t_wait)
            events.append((s.uid, self._emit(s, toks[b], False, cyc, lps[b] if lps else None)))
            results.append(cyc)
        self._flight = nxt
        if nxt is None:
            for s, t in zip(rows, toks):
                s.anchor = t
        self._account(rows, results)
        if nxt is not None and not any(s.done for s in rows):  # asked between two tokens
            d = rows[0].policy.decide(rows)
            if d.width > 1:
                self._due = ([s.uid for s in rows], d)  # after the token in flight
        return events

    def _admits_soon(self) -> bool:
        return bool(self.waiting) and len(self.rows) < self.max_batch

    def _book_fed(self, rows: List[Sequence], toks: List[int], f) -> None:
        """The fed tokens' K/V are in the caches now: their ids and features with each row."""
        for b, s in enumerate(rows):
            s.pc.tokens.append(toks[b])
            if s.capture and f is not None:
                s.pending.append(f[b: b + 1])

    # -- a draft + verify cycle ----------------------------------------------------------------
    def _cycle(self, d: Decision) -> List[Event]:
        rows, t0 = self.rows, time.perf_counter()
        B = len(rows)
        # each row's width: the decision's, within its last block and the KV room
        widths = [min(w, s.emit.left + 1, self._kv_room(s)) if src else 1
                  for s, w, src in zip(rows, d.widths, d.sources)]
        n, drafts, qs, confs = self.propose(rows, widths, d.sources)
        if max(n) == 0:  # (a lookup decided a token ago: the context moved on, or the cut took
            return self._plain(time.perf_counter() - t0)  # no draft) plain, unpipelined; the draft is paid
        t_draft = time.perf_counter()
        res, f = self.verify(drafts, n, qs)
        t_wait = time.perf_counter()
        A, outs = self.readback(res, n)
        t3 = time.perf_counter()
        W = max(n) + 1
        self._rollback(W, [W - 1 - a for a in A])
        events, results = [], []
        for b, s in enumerate(rows):
            a, out = A[b], outs[b]
            if s.capture and f is not None:  # the anchor and the accepted drafts become drafter context
                s.pending.append(f[b: b + 1, : a + 1])
            s.pc.tokens.append(s.anchor)
            s.pc.tokens += out[:a]
            if s.hist is not None:  # the ids before the next anchor (the bonus), as plain decoding's
                s.hist = mx.concatenate([s.hist, mx.array([s.anchor] + out[:a], mx.int32)])
            cyc = CycleResult(n[b] + 1, a, 0, t_draft=t_draft - t0, t_verify=t3 - t_draft,
                              source=d.sources[b] if n[b] else "", t_wait=t3 - t_wait, conf=confs[b])
            for i, tok in enumerate(out):
                cyc.emitted += 1
                events.append((s.uid, self._emit(s, tok, i < a, cyc)))
                if s.done:
                    break
            cyc.t_book = time.perf_counter() - t3
            s.anchor = out[-1]
            results.append(cyc)
        self._account(rows, results)
        self.cycles += 1
        self.occupancy = B
        return events

    def propose(self, rows: List[Sequence], widths: List[int], sources) -> tuple:
        """The cycle's drafts [B, W - 1] from each row's source (filler past a
        row's count, never accepted): (counts, drafts, q per row, confidences per
        row). A source drafts only for its rows (the drafter: no forward when no
        row drafts from it). A method, so that a benchmark can replace what is
        proposed and still pay the forward (the realistic bench's replayed acceptance)."""
        B = len(rows)
        n, parts, qs, confs = [0] * B, [None] * B, [None] * B, [None] * B
        whole = None  # one source's drafts for every row, in row order
        for name in {src for src, w in zip(sources, widths) if src and w > 1}:
            idx = [b for b in range(B) if sources[b] == name and widths[b] > 1]
            got = self.proposers[name].propose(self.target, [rows[b] for b in idx], [widths[b] for b in idx])
            if name == DFLASH:
                self.drafter_forwards += 1
            if len(idx) == B:
                whole = got.tokens
            for i, b in enumerate(idx):
                parts[b], n[b], qs[b], confs[b] = got.tokens[i], got.counts[i], got.q[i], got.conf[i]
        if B == 1 and sources[0] == DFLASH and rows[0].policy.reads_confidence:  # the policy's cut (adaptive)
            s = rows[0]
            mx.eval(parts[0], confs[0])
            conf = confs[0].tolist() if isinstance(confs[0], mx.array) else list(confs[0])
            n[0] = s.policy.trim(s, parts[0].tolist(), conf)
            confs[0] = conf[: n[0]]
        W = max(n) + 1
        if whole is not None and whole.shape[1] == W - 1:  # already [B, W - 1]: no per-row slices and stack
            return n, whole.astype(mx.int32), qs, confs

        def fit(p):  # a row's drafts as W - 1 columns (cut, or filler that is never accepted)
            p = p if p is not None else mx.zeros((0,), mx.int32)
            k = p.shape[0]
            return p[: W - 1] if k >= W - 1 else mx.pad(p, [(0, W - 1 - k)])

        drafts = [fit(p) for p in parts]
        return n, mx.stack(drafts).astype(mx.int32), qs, confs

    def verify(self, drafts: mx.array, n: List[int], qs: list):
        """[anchors, drafts] through the target in one forward, each row accepted
        on the device, lazily. Returns (the results for `readback`: per row, or one
        block when every row is greedy without processors; the captured features). Greedy rows are accepted together; rows with logits
        processors are processed row by row after their own history (the drafts
        read to the host first: their one extra sync)."""
        rows = self.rows
        W = drafts.shape[1] + 1
        vin = mx.concatenate([mx.array([s.anchor for s in rows], mx.int32)[:, None], drafts], axis=1)
        layers = self.capture_layers if any(s.capture for s in rows) else []
        logits, f = self._forward(vin, layers, verify=True)
        res: list = [None] * len(rows)
        plain = [b for b, s in enumerate(rows) if s.sp.greedy and s.hist is None]
        if plain:  # the longest prefix of each row's drafts equal to the target's argmax
            ix = mx.array(plain, mx.int32) if len(plain) < len(rows) else None
            lg, dr = (logits, drafts) if ix is None else (logits[ix], drafts[ix])
            tgt = mx.argmax(lg, axis=-1).astype(mx.int32)
            ok = dr == tgt[:, :-1]
            counts = [n[b] for b in plain]
            if min(counts) < W - 1:  # columns past a row's own drafts are filler, never accepted
                ok = ok & (mx.arange(W - 1)[None] < mx.array(counts)[:, None])
            a = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
            block = mx.concatenate([a[:, None].astype(mx.int32), tgt], axis=1)  # emitted = tgt[:a+1]
            if len(plain) == len(rows):  # read back whole (readback takes a [B, W + 1] array)
                return block, f
            for i, b in enumerate(plain):
                res[b] = block[i]
        host = drafts.tolist() if any(s.hist is not None for s in rows) else None
        for b, s in enumerate(rows):
            if res[b] is not None:
                continue
            rl, db = logits[b, : n[b] + 1], drafts[b, : n[b]]
            if s.hist is not None:
                rl = process_rows(s.config.logits_processors, s.hist, [s.anchor] + host[b][: n[b]], rl)
            if s.sp.greedy:
                a, tgt = accept_greedy(rl, db)
                res[b] = mx.concatenate([a[None], tgt])
            else:
                q = qs[b][: n[b]] if qs[b] is not None else None
                a, nxt = accept_sampled(probs(rl, s.sp), db, q, s.next_key())
                res[b] = mx.concatenate([a[None], db.astype(mx.int32), nxt.astype(mx.int32)[None]])
        return res, f

    def readback(self, res, n: List[int]) -> tuple:
        """The cycle's ONE host sync: drafts, verify and acceptance evaluated
        together. `res`: `verify`'s per-row results, or its [B, W + 1] block when
        every row was accepted greedily together. Returns (accepted counts, each
        row's emitted tokens)."""
        if isinstance(res, mx.array):
            A, outs = [], []
            for row in res.tolist():
                A.append(row[0])
                outs.append(row[1: row[0] + 2])
            return A, outs
        flat = mx.concatenate(res).tolist() if len(res) > 1 else res[0].tolist()
        A, outs, i = [], [], 0
        for s, r in zip(self.rows, res):
            k = r.shape[0]
            row = flat[i: i + k]
            i += k
            a = row[0]
            A.append(a)
            outs.append(row[1: a + 2] if s.sp.greedy else row[1: a + 1] + [row[-1]])
        return A, outs

    # -- emission, accounting, leaving ---------------------------------------------------------
    def _emit(self, s: Sequence, token: int, from_draft: bool, cycle: Optional[CycleResult], logprobs=None):
        text, reason = s.emit.push(token)
        if s.pc.index is not None:
            s.pc.index.append(token)
        st = s.stats
        st.generation_tokens = len(s.emit.tokens)
        if reason:
            st.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(text, token, from_draft, reason, st, cycle, logprobs)

    def _account(self, rows: List[Sequence], results: List[CycleResult]) -> None:
        """After a cycle or plain step, before its tokens are handed out (every
        token of the cycle sees the stats): the stats, then the policy."""
        now = time.perf_counter()
        step = now - self._accounted if self._accounted is not None and self.target.clocked else 0.0
        self._accounted = now
        for cyc in results:
            cyc.t_step = step
        rows[0].policy.observe(rows, results)
        for s, cyc in zip(rows, results):
            st = s.stats
            st.add(cyc)
            st.policy, st.adaptive = s.policy.reason(s), s.policy.summary(s)
            st.generation_time = now - s.t_gen

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            self._release(s, s.pc.target)  # (mid-prefill: its cache holds the chunks done)
        self._retire()

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if not s.done]
        if len(keep) == len(self.rows):
            return
        if self._flight is not None:  # the step in flight goes on for the rows that stay
            y, lps, f = self._flight
            ix = mx.array(keep, mx.int32)
            self._flight = (y[ix], [lps[i] for i in keep] if lps else None, f[ix] if f is not None else None) \
                if keep else None
        if self.cache is None:
            s = self.rows[0]
            self._release(s, s.pc.target)
        else:
            for i, s in enumerate(self.rows):
                if i not in keep:
                    self._release(s, [c.extract(i) for c in self.cache])
            self.cache = bc.keep(self.cache, keep)
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self._flight, self._due = None, None, None
        self._alone_again()

    def _alone_again(self) -> None:
        """A set of several back to one row: it decodes in its own caches again."""
        if len(self.rows) == 1 and self.cache is not None and self._flight is None:
            self.rows[0].pc.target, self.cache = [c.extract(0) for c in self.cache], None

    def _release(self, s: Sequence, cache: Optional[list]) -> None:
        """`s` leaves: its prompt cache holds its caches (its own, extracted from
        the batch), its tokens, its drafter context and unseen features; the
        guard's state for it carries over."""
        pc = s.pc
        pc.target = cache
        if s.capture:  # (else its drafter context, if any, covers a prefix: prompt_cache.reusable)
            pc.pending = cat_feats(s.pending)
        s.pending = []
        if cache is not None and self._evaluate:
            mx.eval([c.state for c in cache], pc.pending if pc.pending is not None else [])
        obs = s.policy.leave(s) if s.policy is not None else None
        if obs is not None and self.calibration is not None:
            self.calibration.keep(self.model, self.drafter, obs)
        if s.returned:
            self._released.append((s.uid, pc))
