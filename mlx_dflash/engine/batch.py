"""Continuous batching with DFlash: many generations share one target forward
per cycle (ENGINE.md: "a batch engine is many rows behind the same methods").

    submit(prompt, config) -> uid          queued; joins at a cycle boundary
    step() -> [(uid, GenerationResponse)]  one prefill chunk of the next queued
                                            request (interleaved), then one cycle
    cancel(uid)                            leaves at the next boundary

A cycle: the width policy (batch_policy.py) picks one width w for the batch
(1: plain batched decoding) and each row's draft source: prompt lookup over
the row's own tokens (lookup.py: its context repeats itself) or the drafter;
one batched drafter forward proposes w - 1 tokens for the rows that draft
from it (batch_draft.py; none when no row does: their features wait in the
row's pending rows, as the single-stream Decoder keeps them after a lookup
cycle); one batched verify over [B, w]; each row accepts its
own count (greedy: the longest prefix equal to the target's argmax; sampled:
the lossless rule, with the row's own PRNG key; a lookup draft is a one-hot
proposal); the ragged rollback drops
each row's rejected tokens (batch_cache.py); each row emits through its own
Emitter (EOS, stop strings, max tokens) and keeps its own stats. A request is
prefilled alone, chunk by chunk exactly as the single-stream Decoder does
(so its first token is that of a request run alone), then joins the batch;
optionally (`prefill_together`) requests that arrive together, with short
prompts, on a target with only KV layers, are prefilled together in the same
two forwards, left-padded.

A request may start from a `prompt_cache` (prompt_cache.PromptCache, as the
single-stream Decoder takes one: a prompt store's entry): only the prompt past
its longest reusable prefix is prefilled. When the row leaves (finished or
cancelled), that PromptCache holds the row's own caches (extracted from the
batch, its padding removed: the single-stream cache kinds), its drafter
context and pending features, as the Decoder leaves it; `released()` hands
those back for the caller to store.

Rows may differ in sampling parameters, seed, stop strings, max tokens, block
size, verify mode (a row with verify mode off verifies no drafts) and logits
processors (applied to the row's slice of each verify, row by row, after its
own history: logits.py; the cycle then reads the drafts to the host). What a
batch cannot do is refused with a one-line reason (`batchable`, `BatchError`):
the caller runs that request alone (decoder.Decoder), never differently."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.prompt_cache import PromptCache, lookup_index, origin, reuse
from ..drafting.batch_draft import propose_batch
from ..drafting.drafter import Drafter
from ..drafting.lookup import NgramIndex
from ..policy.base import DFLASH, LOOKUP
from ..policy.batch import BatchGuard, BatchPolicy, FixedBatchWidth
from ..policy.costs import Observed
from ..target.adapter import Target
from . import batch_cache as bc
from .batch_costs import BatchCosts
from .calibrate import Calibration
from .decode_config import DecodeConfig
from .decoder import cat_feats, encode
from .emitter import Emitter
from .logits import process, process_rows
from .sampling import SamplingParams, accept_greedy, accept_sampled, probs, sample
from .stats import CycleResult, GenerationResponse, GenerationStats


class BatchError(ValueError):
    """A model or request the batch engine cannot run (the reason is in the message)."""


def batchable(config: DecodeConfig) -> Optional[str]:
    """Why a request with this config must run alone (None: it can join a batch)."""
    if config.logprobs or config.plain_reason:
        return "logprobs or plain decoding run alone"
    if config.kv_bits is not None:
        return "a quantized KV cache runs alone (mlx-lm's batch caches are not quantized)"
    return None


@dataclass
class Row:
    """One generation in the batch: everything that is per request."""

    uid: int
    config: DecodeConfig
    sp: SamplingParams
    emit: Emitter
    stats: GenerationStats
    key: Optional[mx.array]  # its own PRNG key (sampled rows): its draws do not depend on the others
    drafts: bool  # it verifies drafts (else one token per cycle)
    cap: int  # its widest verify (its block size)
    fixed: bool  # it drafts at `cap` in every cycle: an explicit width, or a seeded sampled row (whose
    # tokens must not depend on the widths the rows around it make the batch choose)
    rest: List[int]  # prompt tokens not prefilled yet
    cache: Optional[list] = None  # its own cache while it prefills
    dcache: Optional[list] = None  # its drafter context
    pending: List[mx.array] = field(default_factory=list)  # features of its rows the drafter has not seen
    anchor: int = -1  # the last token emitted (not in the cache yet)
    done_prompt: int = 0
    pc: Optional[PromptCache] = None  # the caller's prompt cache: filled with this row's caches when it leaves
    tokens: List[int] = field(default_factory=list)  # the tokens in its target cache (with a prompt cache)
    index: Optional[NgramIndex] = None  # its tokens' n-gram index, when it may verify prompt-lookup drafts
    hist: Optional[mx.array] = None  # with logits processors: the prompt + the ids emitted before its anchor
    cancelled: bool = False
    t_start: float = 0.0
    t_gen: float = 0.0

    def next_key(self):
        if self.key is None:
            return None
        self.key, k = mx.random.split(self.key)
        return k


class BatchEngine:
    """Continuous batching over an mlx-lm `model` (+ a DFlash `drafter`).

    `max_batch`: rows decoding together (more requests wait, prefilled one at
    a time as rows leave). `policy`: chooses each cycle's width (default with a
    DFlash drafter: batch_policy.BatchGuard, from the batched cycle costs
    measured once per batch size (batch_costs.py, cached through
    `calibration`) and the rows' live acceptance; a drafter double: its
    default width). Raises BatchError for a target whose cache kinds cannot
    be batched. `prefill_together`: requests that arrive together, with
    short prompts, on a target with only KV layers, are prefilled in one
    left-padded batched forward (off by default: on mlx-cpu it was slower than
    one after another, bench/batch_ttft.md)."""

    def __init__(self, model, tokenizer, drafter=None, *, max_batch: int = 8,
                 policy: Optional[BatchPolicy] = None, prefill_step_size: int = 2048,
                 calibration: Optional[Calibration] = None, prefill_together: bool = False):
        self.tokenizer = tokenizer if tokenizer is None or isinstance(tokenizer, TokenizerWrapper) \
            else TokenizerWrapper(tokenizer)
        self.target = Target(model)
        why = bc.unsupported(self.target)
        if why:
            raise BatchError(f"this model cannot decode in a batch: {why}")
        if max_batch < 1:
            raise BatchError(f"max_batch must be >= 1, got {max_batch}")
        self.drafter = drafter
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        if policy is None:
            if isinstance(drafter, Drafter):
                cal = calibration or Calibration()
                obs = cal.prior(model, drafter) or Observed()  # the single-stream guard's acceptance, if it ran
                costs = BatchCosts(model, drafter, cal, drafter.block_size)
                policy = BatchGuard(costs.curve, drafter.block_size, prior=obs.p, verify=costs.verify_curve,
                                    lookup_alpha=obs.lookup_alpha)
            else:
                policy = FixedBatchWidth(min(5, drafter.block_size) if drafter is not None else 1)
        self.policy = policy
        self.capture = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.together = prefill_together and bc.paddable(self.target)
        self.prefilled_together = 0  # requests prefilled that way so far
        self.rows: List[Row] = []  # decoding, in batch order
        self.waiting: Deque[Row] = deque()  # queued or prefilling (the first one)
        self.cache: Optional[list] = None  # the batch's target cache
        self._uid = 0
        self.cycles = 0
        self.drafter_forwards = 0  # cycles that ran the drafter (the others: plain, or lookup rows alone)
        self.occupancy = 0  # rows in the last cycle
        self._released: List[Tuple[int, PromptCache]] = []  # prompt caches of rows that left

    # -- requests -----------------------------------------------------------------------
    def submit(self, prompt, config: Optional[DecodeConfig] = None,
               prompt_cache: Optional[PromptCache] = None) -> int:
        """Queue a request; returns its uid. ValueError (one line) for a request
        that cannot run here (an empty prompt, or `batchable`'s reason). With a
        `prompt_cache`, its reusable prefix is not prefilled again, and the
        cache (the caller hands it over) comes back through `released()`."""
        cfg = config or DecodeConfig()
        why = batchable(cfg)
        if why:
            raise BatchError(why)
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        sp = cfg.sampling()
        drafts = cfg.keeps_drafter_context(self.drafter, len(ids))
        cap, fixed = 1, False
        if drafts:
            explicit = bool(cfg.block_size) and not cfg.default_width and cfg.guard is not True
            fixed = explicit or (not sp.greedy and cfg.seed is not None)
            cap = cfg.block_size if explicit else (cfg.width(self.drafter.block_size, "the drafter's block size")
                                                   if fixed else self.drafter.block_size)
            cap = min(cap, self.drafter.block_size)
            drafts = cap > 1
        key = None
        if not sp.greedy:
            seed = cfg.seed if cfg.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
            key = mx.random.key(seed)
        st = GenerationStats(mode="dflash" if drafts else "off", block_size=cap, prompt_tokens=len(ids))
        if not drafts:
            st.fallback = None if cfg.verify_mode == "off" else (
                "no drafter" if self.drafter is None else "prompt longer than max_context")
        self._uid += 1
        row = Row(self._uid, cfg, sp, Emitter(self.tokenizer, cfg.stop, cfg.max_tokens), st, key, drafts, cap,
                  drafts and fixed, list(ids), t_start=time.perf_counter())
        if cfg.logits_processors:
            row.hist = mx.array(ids, mx.int32)
        if prompt_cache is not None:
            self._start_from(row, prompt_cache, ids)
        # prompt lookup where the single-stream guard verifies it (a guarded width, lookup on)
        if row.drafts and not row.fixed and cfg.lookup and cfg.guard is not False and \
                cfg.verify_mode in ("dflash", "lookup"):
            row.index = lookup_index(prompt_cache, ids) if prompt_cache is not None else NgramIndex(ids)
        self.waiting.append(row)
        return row.uid

    def _start_from(self, row: Row, pc: PromptCache, ids: List[int]) -> None:
        """The row continues `pc`'s longest reusable prefix of `ids`, as the
        Decoder does (prompt_cache.reuse: the drafter's context must cover it)."""
        if pc.target is None or [type(c) for c in pc.target] != [type(c) for c in self.target.make_cache()]:
            pc.target, pc.tokens = self.target.make_cache(), []  # (e.g. a quantized cache from a lone request)
        common = reuse(self.target, pc, ids, self.drafter if row.drafts else None, row.config.drafter_layout)
        row.pc, row.cache, row.tokens, row.rest = pc, pc.target, list(ids[:common]), list(ids[common:])
        row.stats.reused_tokens = common
        row.stats.prompt_cache = origin(pc, common)
        if row.drafts:
            row.dcache = pc.drafter
            row.pending = [pc.pending] if pc.pending is not None else []
            pc.pending = None

    def released(self) -> List[Tuple[int, PromptCache]]:
        """(uid, prompt cache) of each row submitted with one that left since the
        last call: each holds the tokens its row's caches hold, ready for a store."""
        out, self._released = self._released, []
        return out

    def _release(self, row: Row, cache: Optional[list]) -> None:
        """Fill `row.pc` with `cache` (the row's own per-layer caches) and its drafter context."""
        pc = row.pc
        if pc is None:
            return
        row.pc = None
        pc.target, pc.tokens = cache, row.tokens
        if row.drafts and row.dcache is not None:
            pc.drafter, pc.pending = row.dcache, cat_feats(row.pending)
            pc.drafter_id, pc.drafter_layout = id(self.drafter), tuple(row.config.drafter_layout)
        else:  # no drafter context for these tokens: it serves calls without one only
            pc.drafter = pc.pending = pc.drafter_id = None
        if cache is not None:
            mx.eval([c.state for c in cache], pc.pending if pc.pending is not None else [])
        self._released.append((row.uid, pc))

    def cancel(self, uid: int) -> None:
        """The row leaves at the next cycle boundary; the others go on as if it had never been there."""
        for r in list(self.rows) + list(self.waiting):
            if r.uid == uid:
                r.cancelled = True

    def __len__(self) -> int:
        return len(self.rows) + len(self.waiting)

    # -- the loop ----------------------------------------------------------------------------
    def step(self, emit: Optional[Callable[[int, GenerationResponse], None]] = None
             ) -> List[Tuple[int, GenerationResponse]]:
        """Prefill chunks of queued requests (while rows are free, up to
        prefill_step_size tokens: short prompts all join at once, a long one is
        interleaved with the cycles), then one cycle of the running batch.
        Returns the tokens it produced, in order; `emit(uid, response)` gets
        each one as soon as it exists (a first token before the next prefill)."""
        events: List[Tuple[int, GenerationResponse]] = []
        self._drop_cancelled()
        budget = self.prefill_step_size
        group = self._group(budget)
        if group:
            budget -= sum(len(r.rest) for r in group)
            for ev in self._prefill_together(group):
                events.append(ev)
                if emit is not None:
                    emit(*ev)
        while self.waiting and len(self.rows) < self.max_batch and budget > 0:
            before = len(self.waiting[0].rest)
            ev = self._prefill(self.waiting[0])
            budget -= max(1, before - (len(self.waiting[0].rest) if ev is None else 0))
            if ev is not None:
                events.append(ev)
                if emit is not None:
                    emit(*ev)
        if self.rows:
            done = self._cycle()
            events += done
            if emit is not None:
                for ev in done:
                    emit(*ev)
        self._retire()
        return events

    def run(self):
        """Step until every request is done, yielding (uid, response) events."""
        while len(self):
            yield from self.step()

    def _drop_cancelled(self) -> None:
        for r in self.waiting:
            if r.cancelled:  # (mid-prefill: its cache holds the chunks done)
                self._release(r, r.cache)
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self._retire()

    def _retire(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not (r.cancelled or r.emit.done)]
        if len(keep) < len(self.rows):
            for i, r in enumerate(self.rows):
                if r.pc is not None and i not in keep:
                    self._release(r, [c.extract(i) for c in self.cache])
            self.cache = bc.keep(self.cache, keep)
            self.rows = [self.rows[i] for i in keep]

    # -- prefill: alone, chunked as decoder.Decoder.prefill ----------------------------------
    def _prefill(self, row: Row) -> Optional[Tuple[int, GenerationResponse]]:
        """One chunk of `row`'s prompt; after the last one, its first token, and
        the row joins the batch."""
        if row.cache is None:
            row.cache = self.target.make_cache()
        cap = self.capture if row.drafts else []
        rest = row.rest
        if len(rest) > 1:
            n = min(row.config.prefill_step_size, len(rest) - 1)  # its own chunks: its logits are its own
            _, f = self.target(mx.array(rest[:n])[None], row.cache, cap)
            mx.eval(f if f is not None else [c.state for c in row.cache])
            if f is not None:
                row.pending.append(f)
            row.rest = rest[n:]
            if row.pc is not None:
                row.tokens += rest[:n]
            return None
        logits, f = self.target(mx.array(rest)[None], row.cache, cap)
        if f is not None:
            row.pending.append(f)
        row.rest = []
        if row.pc is not None:
            row.tokens += rest
        tok = self._first(row, logits[0, -1])
        row.stats.prompt_time = time.perf_counter() - row.t_start
        row.t_gen = time.perf_counter()
        self.waiting.popleft()
        if row.drafts:
            if row.dcache is None:
                row.dcache = self.drafter.make_cache(*row.config.drafter_layout)
            row.pending = [cat_feats(row.pending)]
        else:
            row.pending = []
        row.anchor = tok
        mx.eval([c.state for c in row.cache])
        ev = (row.uid, self._emit(row, tok, False, None))
        if not row.emit.done:
            self.cache = bc.join(self.cache, bc.to_batch(row.cache))
            self.rows.append(row)
        else:
            self._release(row, row.cache)
        row.cache = None
        return ev

    # -- prefill: several new prompts together ---------------------------------------------
    def _group(self, budget: int) -> List[Row]:
        """The queued requests prefilled together now: the first ones in the queue
        not started yet, each prompt one chunk alone, within the token budget and
        the free rows; at least two (else the prefill above, alone)."""
        if not self.together:
            return []
        group, total = [], 0
        for r in self.waiting:
            n = len(r.rest)
            if (len(self.rows) + len(group) >= self.max_batch or r.cache is not None
                    or not 2 <= n <= r.config.prefill_step_size + 1 or total + n > budget):
                break
            group.append(r)
            total += n
        return group if len(group) > 1 else []

    def _prefill_together(self, group: List[Row]) -> List[Tuple[int, GenerationResponse]]:
        """The prompts of `group` in the two forwards each would take alone (all
        but its last token, then its last token), batched with left padding;
        each row's first token, then the rows join the batch."""
        self.prefilled_together += len(group)
        heads = [r.rest[:-1] for r in group]
        m = max(len(h) for h in heads)
        pad = [m - len(h) for h in heads]
        cache = bc.padded(self.target, pad)
        cap = self.capture if any(r.drafts for r in group) else []
        _, f = self.target(mx.array([[0] * p + h for p, h in zip(pad, heads)], mx.int32), cache, cap)
        logits, f2 = self.target(mx.array([[r.rest[-1]] for r in group], mx.int32), cache, cap)
        mx.eval(logits, [c.state for c in cache], *([f, f2] if f is not None else []))
        events, keep = [], []
        for i, row in enumerate(group):
            self.waiting.popleft()
            row.rest = []
            tok = self._first(row, logits[i, -1])
            row.stats.prompt_time = time.perf_counter() - row.t_start
            row.t_gen = time.perf_counter()
            if row.drafts:
                row.dcache = self.drafter.make_cache(*row.config.drafter_layout)
                row.pending = [cat_feats([f[i: i + 1, pad[i]:], f2[i: i + 1]])]
            row.anchor = tok
            events.append((row.uid, self._emit(row, tok, False, None)))
            if not row.emit.done:
                keep.append(i)
                self.rows.append(row)
        if keep:
            self.cache = bc.join(self.cache, bc.keep(cache, keep))
        return events

    def _first(self, row: Row, logits: mx.array) -> int:
        """The first token, from the prompt's last logits (after the row's processors, as Decoder._pick)."""
        if row.hist is not None:
            logits = process(row.config.logits_processors, row.hist, logits)
        if row.sp.greedy:
            return int(mx.argmax(logits, axis=-1).item())
        return int(sample(probs(logits, row.sp), row.next_key()).item())

    # -- one cycle ---------------------------------------------------------------------------
    def _cycle(self) -> List[Tuple[int, GenerationResponse]]:
        rows, t0 = self.rows, time.perf_counter()
        B = len(rows)
        # what each row's context offers to prompt lookup, up to its widest verify
        offers = [len(r.index.propose(min(r.cap - 1, r.emit.left))) if r.index is not None else 0 for r in rows]
        w = max([self.policy.next(rows, offers)] + [r.cap for r in rows if r.fixed])
        src = self.policy.sources(rows, w, offers)
        looks = [r.index.propose(min(w - 1, r.cap - 1, r.emit.left)) if s == LOOKUP else []
                 for r, s in zip(rows, src)]
        n = [len(lk) if s == LOOKUP else min(w - 1, r.cap - 1, r.emit.left) if s == DFLASH else 0
             for r, s, lk in zip(rows, src, looks)]  # drafts verified per row
        w = max(n) + 1
        anchors = [r.anchor for r in rows]
        qs = [None] * B
        toks = mx.zeros((B, 0), mx.int32)
        if w > 1:
            toks = self._drafts(rows, src, looks, n, w, qs)
        t_draft = time.perf_counter() - t0
        vin = mx.concatenate([mx.array(anchors, mx.int32)[:, None], toks], axis=1)
        capture = self.capture if any(r.drafts for r in rows) else []  # (lookup rows: for a later draft)
        logits, f = self.target(vin, self.cache, capture)
        tgt = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, w]
        if w > 1:
            ok = (toks == tgt[:, :-1]) & (mx.arange(w - 1)[None] < mx.array(n)[:, None])
            a = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
        else:
            a = mx.zeros((B,), mx.int32)
        # rows with logits processors: their slice of the verify, processed row by row
        # after their own history (the drafts read to the host: the one extra sync)
        procd = {}
        if any(r.hist is not None for r in rows):
            D = toks.tolist()
            for b, r in enumerate(rows):
                if r.hist is not None:
                    procd[b] = process_rows(r.config.logits_processors, r.hist, [anchors[b]] + D[b][: n[b]],
                                            logits[b, : n[b] + 1])
        sampled = {}
        for b, r in enumerate(rows):
            rl = procd[b] if b in procd else logits[b, : n[b] + 1]
            if not r.sp.greedy:
                q = qs[b][: n[b]] if qs[b] is not None else None
                sampled[b] = accept_sampled(probs(rl, r.sp), toks[b, : n[b]], q, r.next_key())
            elif b in procd:  # (a (count, next token) pair, read back as a sampled row's)
                ab, tb = accept_greedy(rl, toks[b, : n[b]])
                sampled[b] = (ab, tb[ab])
        mx.eval(a, tgt, toks, [x for s in sampled.values() for x in s])
        t_wait = time.perf_counter()
        A, T, D = a.tolist(), tgt.tolist(), toks.tolist()
        outs = []
        for b in range(B):
            if b in sampled:
                ab, nxt = sampled[b][0].item(), sampled[b][1].item()
                A[b] = ab
                outs.append(D[b][:ab] + [nxt])
            else:
                outs.append(T[b][: A[b] + 1])
        bc.rollback(self.target, self.cache, w, [w - 1 - x for x in A])
        t3 = time.perf_counter()
        self.policy.observe(rows, n, A, src)
        events = []
        for b, r in enumerate(rows):
            if f is not None and r.drafts:
                r.pending.append(f[b: b + 1, : A[b] + 1])
            cyc = CycleResult(n[b] + 1, A[b], 0, t_draft=t_draft, t_verify=t3 - t0 - t_draft,
                              source=src[b] if n[b] else "", t_wait=t3 - t_wait)
            resps = []
            for i, tok in enumerate(outs[b]):
                cyc.emitted += 1
                resps.append(self._emit(r, tok, i < A[b], cyc))
                if r.emit.done:
                    break
            r.stats.add(cyc)
            r.stats.policy = self.policy.row_reason(r)
            r.stats.generation_time = time.perf_counter() - r.t_gen
            if r.pc is not None:  # in its cache now: the anchor and the accepted drafts
                r.tokens += [r.anchor] + outs[b][: A[b]]
            if r.hist is not None:  # the ids before its next anchor, as the Decoder's
                r.hist = mx.concatenate([r.hist, mx.array([r.anchor] + outs[b][: A[b]], mx.int32)])
            r.anchor = outs[b][-1]
            events += [(r.uid, x) for x in resps]
        self.cycles += 1
        self.occupancy = B
        return events

    def _drafts(self, rows: List[Row], src: List[str], looks: List[List[int]], n: List[int], w: int,
                qs: list) -> mx.array:
        """The cycle's drafts [B, w - 1] (past a row's n: filler, never accepted):
        lookup rows' from their index, the others' from one drafter forward over
        the rows that draft from it (none: no forward). Fills `qs` (per row its
        proposal distribution, or None: one-hot). The drafter takes a row's
        pending features only when it drafts for that row."""
        out = [mx.array(lk + [0] * (w - 1 - len(lk)), mx.int32) for lk in looks]
        ds = [b for b, s in enumerate(src) if s == DFLASH]
        if ds:
            self.drafter_forwards += 1
            wd = max(n[b] for b in ds) + 1
            sub = [rows[b] for b in ds]
            toks, dq = self.propose(sub, wd)
            if wd < w:
                toks = mx.pad(toks, [(0, 0), (0, w - wd)])
            for i, (b, r) in enumerate(zip(ds, sub)):
                out[b], qs[b] = toks[i], dq[i]
                r.pending.clear()
        return mx.stack(out)

    def propose(self, rows: List[Row], w: int) -> Tuple[mx.array, list]:
        """One batched drafter forward for `rows` (those drafting from the drafter
        this cycle): `w - 1` tokens after each row's anchor (tokens [len(rows),
        w - 1], per row its q or None). A method so that a benchmark can replace
        what is proposed and still pay the forward (the realistic bench's
        replayed acceptance: scripts/bench_batch_realistic.py)."""
        return propose_batch(self.drafter, self.target, [r.anchor for r in rows],
                             [cat_feats(r.pending) for r in rows], [r.dcache for r in rows], w,
                             [r.sp.temperature for r in rows], [r.next_key() for r in rows])

    def _emit(self, row: Row, token: int, from_draft: bool, cycle: Optional[CycleResult]) -> GenerationResponse:
        text, reason = row.emit.push(token)
        if row.index is not None:
            row.index.append(token)
        st = row.stats
        st.generation_tokens = len(row.emit.tokens)
        if reason:
            st.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(text, token, from_draft, reason, st, cycle)

    def summary(self) -> Dict[str, int]:
        """What /metrics shows: rows decoding, requests waiting, the batch's slots per row."""
        return {"rows": len(self.rows), "waiting": len(self.waiting), "max_batch": self.max_batch,
                "slots": bc.size(self.cache), "cycles": self.cycles, "drafter_forwards": self.drafter_forwards,
                "prefilled_together": self.prefilled_together}
