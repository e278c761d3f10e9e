"""The batch engine (mlx_dflash/engine/batch.py): every stream in a batch is exactly
the same request run alone.

Greedy token ids of each row equal mlx-lm's own stream_generate of that
request alone (which the single-stream Decoder equals: test_lossless,
test_families), for rows of different prompt lengths and max_tokens, joining
while others run and leaving mid-way, at widths 1, 5 and 8, over KV and
sliding-window families; with drafts right for a random prefix of each block,
so every row accepts its own count and the ragged rollback runs at every
position. A cancelled row leaves the others identical; stop strings act per
row; seeded sampled rows do not depend on the batch around them; sampled rows
keep the target's distribution; targets the batch cannot run are refused with
one line."""

import random

import mlx.core as mx
import numpy as np
import pytest
from batch_rows import (PROMPTS, RowOracles, Unclocked, WrongDrafter, batch_guard, like_plain_sampling, model_of,
                        run_engine, sampled_rows)
from drafters import reference_tokens
from mlx_lm.models.cache import ArraysCache
from tiers import fast_first

from mlx_dflash import DecodeConfig, generate, load
from mlx_dflash.drafting.drafter import Proposal
from mlx_dflash.engine import batch_cache as bc
from mlx_dflash.engine import batch_costs
from mlx_dflash.engine.batch import BatchEngine, BatchError
from mlx_dflash.engine.batch_costs import AUTO_B, auto_max_batch, pick_max_batch
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash.policy.base import DFLASH, Decision, Policy
from mlx_dflash.policy.fixed import FixedWidth
from mlx_dflash.target.adapter import Target

FAMILIES = ["qwen3", "llama", "gemma3_text", "ministral3", "gpt_oss", "qwen3:bf16", "gemma3_text:bf16", "qwen3:q4"]
MAXES = [26, 14, 30, 9, 22, 18]  # rows leave at different cycles


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width", [1, 5, 8])
def test_greedy_rows_equal_each_request_alone(family, width, tok):
    model = model_of(family)
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS, refs)]
    oracle = RowOracles(plans, seed=width)
    eng = BatchEngine(model, tok, oracle, max_batch=3, policy=FixedWidth(width))
    reqs = [(p, DecodeConfig(max_tokens=m)) for p, m in zip(PROMPTS, MAXES)]
    out, last = run_engine(eng, reqs)
    for i, ref in enumerate(refs):
        assert out[i] == ref, (family, width, i)
        assert last[i].finish_reason == "length"
    if width > 1:  # drafts were verified, accepted in ragged counts
        assert oracle.tried > 0 and 0 < oracle.right
        assert any(0 < last[i].stats.accepted < last[i].stats.drafted for i in last)


@pytest.mark.slow
def test_real_dflash2_drafter_rows_equal_alone(pairs):
    """A real DFlash 2 drafter through the batched drafter forward (padded
    contexts of different lengths, per-row positions, a bounded context window):
    every row is mlx-lm's greedy output; the single-stream Decoder agrees."""
    d = pairs("qwen3", version=2, block_size=8)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    for w in (1, 5, 8):
        eng = BatchEngine(model, tok, drafter, max_batch=4, policy=FixedWidth(w))
        reqs = [(p, DecodeConfig(max_tokens=m, drafter_window=8, drafter_sink=2)) for p, m in zip(PROMPTS, MAXES)]
        out, last = run_engine(eng, reqs, join_after=2)
        for i, ref in enumerate(refs):
            assert out[i] == ref, (w, i)
        if w > 1:
            assert all(last[i].stats.drafted > 0 for i in last)
    alone = generate(model, tok, PROMPTS[0], drafter, max_tokens=MAXES[0], block_size=5, guard=False)
    assert alone.token_ids == refs[0]


@pytest.mark.slow
def test_cancelled_row_leaves_the_others_identical(tok):
    model = model_of("gemma3_text")
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS, refs)]
    eng = BatchEngine(model, tok, RowOracles(plans, seed=3), max_batch=4, policy=FixedWidth(5))
    reqs = [(p, DecodeConfig(max_tokens=m)) for p, m in zip(PROMPTS, MAXES)]
    out, last = run_engine(eng, reqs, cancel=(1, 4))
    assert out[1][:4] == refs[1][:4] and len(out[1]) < len(refs[1])  # it stopped at a cycle boundary
    for i, ref in enumerate(refs):
        if i != 1:
            assert out[i] == ref, i
    assert len(eng) == 0 and eng.cache is None


@pytest.mark.slow
def test_stop_strings_and_limits_act_per_row(pairs):
    d = pairs("qwen3", version=1)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    texts = [generate(model, tok, p, None, max_tokens=20, verify_mode="off").text for p in PROMPTS[:4]]
    stops = [[t[5:8]] if len(t) > 10 else None for t in texts]  # a stop string inside each answer
    eng = BatchEngine(model, tok, drafter, max_batch=4, policy=FixedWidth(5))
    uids = [eng.submit(p, DecodeConfig(max_tokens=20, stop=s)) for p, s in zip(PROMPTS[:4], stops)]
    got = {u: "" for u in uids}
    fin = {}
    for u, r in eng.run():
        got[u] += r.text
        if r.finish_reason:
            fin[u] = r.finish_reason
    for u, p, s in zip(uids, PROMPTS[:4], stops):
        alone = generate(model, tok, p, None, max_tokens=20, stop=s, verify_mode="off")
        assert got[u] == alone.text and fin[u] == alone.finish_reason, (p, s)
    assert any(s is not None for s in stops)


@pytest.mark.slow
def test_seeded_sampled_row_does_not_depend_on_the_batch(tok):
    """A sampled row draws from its own PRNG key: the same seed gives the same
    tokens alone or beside other rows (greedy and sampled) of any length."""
    model = model_of("qwen3")
    refs = [reference_tokens(model, tok, p, 24) for p in PROMPTS[:4]]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS[:4], refs)]
    cfg = DecodeConfig(max_tokens=24, temperature=1.0, top_k=5, seed=7)

    class Own(RowOracles):
        """The greedy path while the row is on it, else the anchor repeated: a
        function of the row's own state only."""

        def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
            pos, cont = self.position(new_feats, cache)
            on = 0 <= pos < len(cont) and cont[pos] == anchor
            out = [cont[pos + j] if on and pos + j < len(cont) else anchor for j in range(1, width)]
            return Proposal(out, None, [1.0] * len(out))

    def sampled(with_others):
        eng = BatchEngine(model, tok, Own(list(plans) if with_others else [plans[0]]),
                          max_batch=4, policy=FixedWidth(4))
        reqs = [(PROMPTS[0], cfg)]
        if with_others:
            reqs += [(p, DecodeConfig(max_tokens=24, temperature=0.8, seed=i)) for i, p in enumerate(PROMPTS[1:4])]
        out, _ = run_engine(eng, reqs, join_after=0)
        return out[0]

    # the oracle drafts the greedy path: a sampled row leaves it, its drafts go wrong and
    # are rejected by the rule; what it emits depends only on its key and its logits
    assert sampled(False) == sampled(True)


@pytest.mark.slow
def test_sampled_rows_keep_the_target_distribution(pairs):
    """The joint law of 3 tokens, sampled by rows of a batch (a drafted fixed
    block, DFlash 2's sampled selector path not involved) vs plain sampling alone."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt = "def f(x):"
    greedy = generate(model, tok, prompt, None, max_tokens=3).token_ids
    got, tried, accepted = sampled_rows(model, tok, prompt, greedy, 320, 50_000)
    pvalue, outcomes = like_plain_sampling(model, tok, prompt, got)
    assert tried > 0 and accepted > 0 and outcomes > 3
    assert pvalue > 1e-3


@pytest.mark.slow
def test_guard_decodes_plain_where_drafts_do_not_pay(tok):
    """With drafts that are always wrong the guard's prediction falls below
    break-even and the batch decodes plainly (one token per row and cycle),
    output unchanged."""
    model = model_of("qwen3")
    refs = [reference_tokens(model, tok, p, 20) for p in PROMPTS[:3]]

    drafter = WrongDrafter([])
    guard = batch_guard({1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2})
    eng = BatchEngine(model, tok, drafter, max_batch=3, policy=guard, target=Unclocked(model))
    out, last = run_engine(eng, [(p, DecodeConfig(max_tokens=20)) for p in PROMPTS[:3]], join_after=0)
    assert [out[i] for i in range(3)] == refs
    assert drafter.tried > 0  # it probed, then stopped drafting
    for i in last:
        st = last[i].stats
        assert st.plain_cycles > 2 * (st.cycles - st.plain_cycles), (i, st.cycles, st.plain_cycles)


# recurrent hybrids: gated-delta (qwen3_next, qwen3_5), Mamba2 (nemotron_h, granitemoehybrid), short-conv (lfm2)
RECURRENT = ["qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid", "lfm2"]


@pytest.mark.slow
@pytest.mark.parametrize("family", RECURRENT)
@pytest.mark.parametrize("width", [1, 5, 8])
def test_recurrent_rows_equal_each_request_alone(family, width, tok):
    """Per-row selection of the recurrent states after a verify: each row keeps
    the state after its own accepted count (rows of different lengths joining
    and leaving mid-way), greedy ids equal to mlx-lm alone and to the
    single-stream Decoder."""
    test_greedy_rows_equal_each_request_alone(family, width, tok)
    if width == 5:
        model = model_of(family)
        p, m = PROMPTS[3], MAXES[3]
        alone = generate(model, tok, p, RowOracles([(len(tok.encode(p)), reference_tokens(model, tok, p, m))]),
                         max_tokens=m, block_size=5, guard=False)
        assert alone.token_ids == reference_tokens(model, tok, p, m)


@pytest.mark.parametrize("family", RECURRENT)
@pytest.mark.parametrize("width", [2, 5, 8])
def test_recurrent_states_after_a_ragged_rollback_equal_each_row_alone(family, width):
    """The recurrent states themselves (tiny models' outputs can hide a wrong
    conv window): after a [B, w] verify and a rollback of a different count per
    row, row b's states equal those of its prompt plus its kept tokens run alone."""
    model = model_of(family)
    target = Target(model)
    rng = random.Random(width)
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (7, 12, 3, 9)]
    cache = None
    for p in prompts:
        c = target.make_cache()
        target(mx.array(p)[None], c)
        cache = bc.join(cache, bc.to_batch(c))
    vin = [[rng.randrange(4, 512) for _ in range(width)] for _ in prompts]
    keeps = [1, width, 0, rng.randrange(width + 1)]
    target(mx.array(vin), cache)
    bc.rollback(target, cache, width, [width - k for k in keeps])
    for b, (p, k) in enumerate(zip(prompts, keeps)):
        alone = target.make_cache()
        target(mx.array(p + vin[b][:k])[None], alone)
        for layer, (got, want) in enumerate(zip(cache, alone)):
            if isinstance(want, ArraysCache):
                for g, x in zip(got.cache, want.cache):
                    assert np.allclose(np.array(g[b].astype(mx.float32)), np.array(x[0].astype(mx.float32)),
                                       atol=1e-4), (family, width, b, k, layer)


@pytest.mark.slow
@pytest.mark.parametrize("family", RECURRENT)
def test_recurrent_cancelled_row_leaves_the_others_identical(family, tok):
    model = model_of(family)
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS, refs)]
    eng = BatchEngine(model, tok, RowOracles(plans, seed=5), max_batch=4, policy=FixedWidth(8))
    reqs = [(p, DecodeConfig(max_tokens=m)) for p, m in zip(PROMPTS, MAXES)]
    out, _ = run_engine(eng, reqs, cancel=(2, 5))
    assert out[2][:5] == refs[2][:5] and len(out[2]) < len(refs[2])
    for i, ref in enumerate(refs):
        if i != 2:
            assert out[i] == ref, i
    assert len(eng) == 0 and eng.cache is None


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next:nostates"])
def test_unbatchable_targets_are_refused_in_one_line(family, tok, monkeypatch):
    """falcon_h1's CacheList layers; mixers that keep no per-row states (as the
    fused Metal gated-delta kernel: its verify records no per-row state)."""
    base, _, kind = family.partition(":")
    if kind == "nostates":
        monkeypatch.setattr(Target, "rows_selectable", lambda self, cache: False)
    with pytest.raises(BatchError) as e:
        BatchEngine(model_of(base), tok, None)
    assert "\n" not in str(e.value) and "batch" in str(e.value)


def test_requests_that_run_alone_wait_for_an_empty_set(tok):
    """A quantized KV cache (mlx-lm's batch caches are not quantized) runs alone:
    it joins only an empty set and nothing joins it; logprobs rows share the set.
    Every output is what the request gives alone; an empty prompt is refused."""
    model = model_of("qwen3")
    eng = BatchEngine(model, tok, None)
    reqs = [(PROMPTS[0], DecodeConfig(max_tokens=12)),
            (PROMPTS[1], DecodeConfig(max_tokens=12, kv_bits=8, kv_group_size=32, quantized_kv_start=4)),
            (PROMPTS[2], DecodeConfig(max_tokens=12, logprobs=True)), (PROMPTS[3], DecodeConfig(max_tokens=12))]
    uids = [eng.submit(p, c) for p, c in reqs]
    got, sizes = {u: [] for u in uids}, []
    while len(eng):
        for u, r in eng.step():
            got[u].append(r.token)
            if u == uids[2] and not r.finish_reason:
                assert r.logprobs is not None
        sizes.append((len(eng.rows), any(s.uid == uids[1] for s in eng.rows)))
    assert all(n == 1 for n, quantized in sizes if quantized)
    for u, (p, c) in zip(uids, reqs):
        alone = list(generate(model, tok, p, None, **{k: getattr(c, k) for k in
                                                       ("max_tokens", "kv_bits", "kv_group_size", "quantized_kv_start")}
                              ).token_ids)
        assert got[u][: len(alone)] == alone, p
    with pytest.raises(ValueError):
        eng.submit([], DecodeConfig())


@pytest.mark.slow
def test_guard_drafts_where_drafts_pay(tok):
    """Drafts that are always right: the guard, starting from a prior that
    predicts no gain, probes, learns each row's acceptance and drafts; output unchanged."""
    model = model_of("qwen3")
    refs = [reference_tokens(model, tok, p, 30) for p in PROMPTS[:3]]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS[:3], refs)]

    class Right(RowOracles):
        def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
            pos, cont = self.position(new_feats, cache)
            out = [cont[pos + j] if pos + j < len(cont) else 0 for j in range(1, width)]
            return Proposal(out, None, [1.0] * len(out))

    guard = batch_guard({1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2}, prior=[0.3] * 4)
    eng = BatchEngine(model, tok, Right(plans), max_batch=3, policy=guard, target=Unclocked(model))
    out, last = run_engine(eng, [(p, DecodeConfig(max_tokens=30)) for p in PROMPTS[:3]], join_after=0)
    assert [out[i] for i in range(3)] == refs
    for i in last:
        st = last[i].stats
        assert st.cycles - st.plain_cycles > st.plain_cycles and st.tau > 2.5, (i, st.cycles, st.plain_cycles)


def _asked(times):
    """A step-time lookup that records which batch sizes were asked for."""
    asked = []

    def step(B):
        asked.append(B)
        return times[B]
    return step, asked


def test_max_batch_auto_picks_the_largest_size_that_still_pays():
    """`max_batch auto`: the largest B in 1, 2, 4, ..., 16 whose plain batched
    step raises aggregate throughput >= 10% over B/2 at every doubling, within
    memory; sizes past the first that does not pay are not measured."""
    flat = {B: 1.0 + 0.01 * B for B in AUTO_B}  # a step costs about the same at any size: every doubling pays
    assert pick_max_batch(flat.__getitem__, 1, None)[0] == AUTO_B[-1]
    linear = {B: float(B) for B in AUTO_B}  # a step at B rows costs B single steps: batching never pays
    step, asked = _asked(linear)
    B, why = pick_max_batch(step, 1, None)
    assert B == 1 and asked == [1, 2] and "\n" not in why and "2 rows" in why
    knee = {1: 1.0, 2: 1.05, 4: 1.2, 8: 2.3, 16: 2.4}  # 4 -> 8 gains 4%: stop at 4, even if 16 looked good
    step, asked = _asked(knee)
    assert pick_max_batch(step, 1, None)[0] == 4 and 16 not in asked
    just = {1: 1.0, 2: 2 / 1.11, 4: 4 / 1.11 ** 2}  # +11% per doubling still pays
    assert pick_max_batch(lambda B: just.get(B, 1e9), 1, None)[0] == 4
    B, why = pick_max_batch(flat.__getitem__, 10, 79)  # 8 rows of 10 bytes do not fit in 79
    assert B == 4 and "memory" in why


@pytest.mark.slow
def test_max_batch_auto_measures_once_per_model_and_refuses_what_cannot_batch(tok, monkeypatch):
    model = model_of("qwen3")
    cal = Calibration()
    B, why = auto_max_batch(model, None, cal.book)
    assert B in AUTO_B and why and "\n" not in why
    monkeypatch.setattr(batch_costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert auto_max_batch(model, None, Calibration().book) == (B, why)  # a new process: the curves on disk
    B, why = auto_max_batch(model_of("falcon_h1"), None, cal.book)
    assert B == 1 and "batch" in why and "\n" not in why


@pytest.mark.slow
def test_new_prompts_prefilled_together_equal_each_alone(tok):
    """With prefill_together, requests that arrive at once are prefilled in one
    left-padded batched forward: each row's first token, its whole stream and the target features
    its drafter first sees equal those of the request prefilled alone."""
    model = model_of("qwen3")
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    plans = [(len(tok.encode(p)), r) for p, r in zip(PROMPTS, refs)]

    class Seen(RowOracles):
        def make_cache(self, window=None, sink=0):
            c = super().make_cache(window, sink)
            self.first[id(c[0])] = None
            self.order.append(id(c[0]))
            return c

        def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
            if self.first[id(cache[0])] is None:
                self.first[id(cache[0])] = np.array(new_feats)
            return super().propose(target, anchor, new_feats, cache, width, temperature)

    def run(together):
        oracle = Seen(list(plans), seed=1)
        oracle.first, oracle.order = {}, []
        eng = BatchEngine(model, tok, oracle, max_batch=len(PROMPTS), policy=FixedWidth(5),
                          prefill_together=together)
        out, _ = run_engine(eng, [(p, DecodeConfig(max_tokens=m)) for p, m in zip(PROMPTS, MAXES)], join_after=0)
        return out, [oracle.first[k] for k in oracle.order], eng.prefilled_together

    out, feats, n = run(True)
    alone_out, alone_feats, n_alone = run(False)
    assert n == len(PROMPTS) and n_alone == 0
    for i, ref in enumerate(refs):
        assert out[i] == ref == alone_out[i], i
    for a, b in zip(feats, alone_feats):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-4)


class PlainPlainDraft(Policy):
    """For the set: two plain tokens, then one DFlash cycle at width 3 for every row,
    so a draft is decided between two plain tokens (while the next is in flight)."""

    def __init__(self):
        self.calls = 0

    def decide(self, rows):
        self.calls += 1
        if self.calls % 3:
            return Decision.plain(rows)
        return Decision((3,) * len(rows), (DFLASH,) * len(rows))

    def observe(self, rows, results):
        pass

    def reason(self, row):
        return "plain, plain, draft"


@pytest.mark.parametrize("join_after", fast_first(range(1, 7)))
def test_a_row_that_joins_after_a_draft_was_decided_between_two_tokens(tok, join_after):
    """A draft decided for the set between two plain tokens is dropped when the set
    changes before it runs (a row joins): the new set is decided anew, every row exact."""
    model = model_of("qwen3")
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(PROMPTS, MAXES)]
    oracle = RowOracles([(len(tok.encode(p)), r) for p, r in zip(PROMPTS, refs)], seed=1)
    eng = BatchEngine(model, tok, oracle, max_batch=len(PROMPTS), policy=PlainPlainDraft())
    out, _ = run_engine(eng, [(p, DecodeConfig(max_tokens=m)) for p, m in zip(PROMPTS, MAXES)],
                        join_after=join_after)
    assert [out[i] for i in range(len(refs))] == refs


def test_a_target_without_a_clock_gives_the_policy_no_step_times(tok):
    """A split target's ranks must decide alike (distributed.ShardedTarget): its
    steps report no wall-clock time, so no rank's clock raises a price (the
    guard's prices as paid); a local target's steps report theirs."""
    model = model_of("qwen3")
    ref = reference_tokens(model, tok, PROMPTS[0], 12)

    class Recording(FixedWidth):
        def __init__(self):
            super().__init__(5)
            self.times = []

        def observe(self, rows, results):
            self.times += [r.t_step for r in results]
            super().observe(rows, results)

    for target, clocked in ((Target(model), True), (Unclocked(model), False)):
        pol = Recording()
        oracle = RowOracles([(len(tok.encode(PROMPTS[0])), ref)], seed=1)
        eng = BatchEngine(model, tok, oracle, max_batch=1, policy=pol, target=target)
        out, _ = run_engine(eng, [(PROMPTS[0], DecodeConfig(max_tokens=12))], join_after=0)
        assert out[0] == ref and len(pol.times) > 2
        assert all(t > 0 for t in pol.times[1:]) if clocked else not any(pol.times)
