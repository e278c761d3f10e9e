"""Prompt-lookup drafts per row in the batch engine (issue 24, item 3): each
row drafts either from the drafter or from prompt lookup over its own tokens,
by its own statistics, and is still exactly the request run alone.

Greedy token ids of every row equal mlx-lm's of that request alone, with
repetitive prompts (code, a repeated passage: lookup hits) beside ordinary
ones, rows of different lengths joining and leaving, widths 1, 5 and 8, KV,
sliding-window and recurrent families. The drafter doubles check the
drafter's context: after lookup cycles a row's next drafter forward takes all
the rows it has not seen (else they are out of sync and fail). Sampled rows
with lookup drafts (one-hot proposals) keep the target's distribution. Where
the drafter does not pay the guard verifies lookup rows without any drafter
forward."""


import math
import mlx.core as mx
import pytest
from drafters import reference_tokens
from batch_rows import (batch_guard, MAXES, PROMPTS, REPEATED, RowOracles, SeqOracles, Unclocked, WrongDrafter,
                        like_plain_sampling, model_of, prompts_for, run_engine, run_rows)

from mlx_dflash import DecodeConfig
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.policy.fixed import FixedWidth
from mlx_dflash.drafting.lookup import NgramIndex
from mlx_dflash.policy.base import DFLASH, LOOKUP
from mlx_dflash.policy.lookup_gate import LookupGate
from mlx_dflash.cache.prompt_cache import PromptCache

# KV; KV + sliding windows; recurrent: Mamba2, gated-delta, short-conv
FAMILIES = ["qwen3", "gemma3_text", "nemotron_h", "qwen3_next", "lfm2"]


def lookup_totals(last):
    """Lookup cycles over all rows (each row's own stats)."""
    return sum(r.stats.lookup_cycles for r in last.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width", [1, 5, 8])
def test_lookup_rows_equal_each_request_alone(family, width, tok):
    model, prompts = model_of(family), prompts_for(family, tok)
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(prompts, MAXES)]
    plans = [(len(p), r) for p, r in zip(prompts, refs)]
    oracle = RowOracles(plans, seed=width)
    eng = BatchEngine(model, tok, oracle, max_batch=3, policy=FixedWidth(width))
    out, last = run_engine(eng, [(p, DecodeConfig(max_tokens=m)) for p, m in zip(prompts, MAXES)])
    assert [out[i] for i in range(len(REPEATED))] == refs
    looked = lookup_totals(last)
    if width == 1:
        assert looked == 0  # a plain batch verifies no drafts
    else:
        # lookup drafted for some rows, the drafter for others (its context stayed in sync)
        assert looked > 0 and oracle.tried > 0
        for i, r in last.items():
            assert (r.stats.lookup_cycles > 0) == ("lookup:" in r.stats.policy)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "nemotron_h"])
def test_lookup_rows_cancelled_and_off_leave_the_others_identical(family, tok):
    """A row cancelled mid-way, a row with lookup off and one with verify mode
    off, beside lookup rows: every row is its request alone."""
    model, prompts = model_of(family), prompts_for(family, tok)
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(prompts, MAXES)]
    plans = [(len(p), r) for p, r in zip(prompts, refs)]
    cfgs = [DecodeConfig(max_tokens=m) for m in MAXES]
    cfgs[2] = DecodeConfig(max_tokens=MAXES[2], lookup=False)
    cfgs[3] = DecodeConfig(max_tokens=MAXES[3], verify_mode="off")
    oracle = RowOracles([pl for i, pl in enumerate(plans) if i != 3], seed=11)  # (a row without drafts has none)
    eng = BatchEngine(model, tok, oracle, max_batch=4, policy=FixedWidth(5))
    out, last = run_engine(eng, list(zip(prompts, cfgs)), join_after=2, cancel=(0, 10))
    assert out[0] == refs[0][: len(out[0])] and 10 <= len(out[0]) < len(refs[0])  # it stopped at a cycle boundary
    assert [out[i] for i in range(1, len(prompts))] == refs[1:]
    assert last[2].stats.lookup_cycles == 0 and last[3].stats.lookup_cycles == 0
    assert lookup_totals(last) > 0


def test_lookup_index_is_kept_with_the_prompt_cache(tok):
    """A row started from a prompt cache indexes its prompt and its answer in
    the cache's lookup index (as the single-stream Decoder does); the next turn,
    batched, extends it and is still exact."""
    model, prompts = model_of("qwen3"), prompts_for("qwen3", tok)
    ids, other = prompts[0], prompts[1]
    ref, ref_o = reference_tokens(model, tok, ids, 12), reference_tokens(model, tok, other, 9)
    oracle = SeqOracles([(0, ids + ref), (0, other + ref_o)], seed=1)
    eng = BatchEngine(model, tok, oracle, max_batch=2, policy=FixedWidth(5))
    pc = PromptCache()
    out, last, uids = run_rows(eng, [(ids, 12, pc), (other, 9, None)], [])
    assert [out[u] for u in uids] == [ref, ref_o] and last[uids[0]].stats.lookup_cycles > 0
    assert pc.index.tokens[: len(ids) + len(ref)] == ids + ref
    p2 = ids + ref + [40, 41, 42]
    ref2 = reference_tokens(model, tok, p2, 10)
    oracle.bind(pc, p2 + ref2)
    out, last, uids = run_rows(eng, [(p2, 10, pc)], [])
    assert out[uids[0]] == ref2 and pc.index.tokens[: len(p2) + len(ref2)] == p2 + ref2


@pytest.mark.slow
def test_lookup_alone_runs_no_drafter_forward_where_the_drafter_does_not_pay(tok):
    """Drafts always wrong: the guard stops drafting from the drafter, yet the
    rows whose context repeats still verify lookup drafts, in cycles with no
    drafter forward (priced as the verify alone); output unchanged."""
    model = model_of("qwen3")
    prompts = [REPEATED[0], REPEATED[2], REPEATED[5]]
    refs = [reference_tokens(model, tok, p, 40) for p in prompts]

    drafter = WrongDrafter([])
    costs = {1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2}
    guard = batch_guard(costs, verify={w: 1.0 + 0.1 * (w - 1) for w in costs})
    eng = BatchEngine(model, tok, drafter, max_batch=3, policy=guard, target=Unclocked(model))
    out, last = run_engine(eng, [(p, DecodeConfig(max_tokens=40)) for p in prompts], join_after=0)
    assert [out[i] for i in range(3)] == refs
    looked = lookup_totals(last)
    drafted = sum(r.stats.cycles - r.stats.plain_cycles - r.stats.lookup_cycles for r in last.values())
    assert looked > 0 and drafter.tried == drafted  # one drafter call per drafted row cycle, none for lookup
    assert looked > drafted, (looked, drafted)
    assert eng.drafter_forwards <= drafted and eng.drafter_forwards < eng.cycles  # lookup cycles ran none


def test_the_guard_prices_lookup_rows_with_their_own_acceptance():
    """The policy alone: a row whose context repeats verifies its lookup drafts
    where they pay for the set (the verify costs every row), beside a row whose
    drafter does not pay; each row's gate follows its own acceptance, and while
    lookup does not pay a match is verified anyway every GAP x rows x c steps."""
    from mlx_dflash.policy.base import CycleResult, Plan

    class R:
        def __init__(self, uid, offer):
            self.uid, self.offer, self.context, self.left, self.unseen = uid, offer, 0, 10**6, 0
            self.plan = Plan("dflash", 5, False, True, True)

        def offers(self, source, n):
            return n if source == DFLASH else min(n, self.offer)

        def grade(self, source):
            return 4 if source == LOOKUP and self.offer else 0

    rows = [R(1, 4), R(2, 0)]
    costs = {1: 1.0, 2: 1.5, 3: 2.0, 5: 3.0}  # DFlash at the prior (0.1 per position) never pays
    g = batch_guard(costs, prior=[0.1] * 4, verify={w: 1.0 + 0.05 * w for w in costs})
    d = g.decide(rows)  # row 1's context repeats: lookup pays (verify ~1.25 plain steps); row 2 probes
    assert d.sources == (LOOKUP, DFLASH) and "probing" in g.reason(rows[1])
    g.state, g.wait = "plain", 100  # the drafter does not pay: lookup rows alone
    d = g.decide(rows)
    assert d.sources == (LOOKUP, "") and d.widths == (5, 1)
    for _ in range(30):  # row 1's lookup drafts all rejected: its alpha falls, and lookup stops paying
        g.observe(rows, [CycleResult(5, 0, 1, source=LOOKUP), CycleResult(1, 0, 1)])
    assert g.rows[1].gate.rate(4) < 0.01 and g.rows[2].gate.tally.cycles == 0
    g.rows[1].gate.skipped = 0
    every = math.ceil(LookupGate.GAP * len(rows) * g.kv[5])  # (the verify's price: exploring costs ~1/GAP)
    taken = [g.decide(rows).sources[0] == LOOKUP for _ in range(every)]
    assert taken.count(True) == 1 and taken[-1]  # one row's exploring costs both: at half the pace
    g.rows[1].gate.alpha[4] = 0.3  # 1 + 0.3 x 4 tokens would pay alone (2.2 >= 1.1 x 1.25 + 0.5), not for two rows
    assert LookupGate.cycle_pays(1 + 0.3 * 4, 1, 1.25) and g.decide(rows).widths == (1, 1)


@pytest.mark.slow
def test_sampled_lookup_rows_keep_the_target_distribution(tok):
    """The joint law of 3 tokens sampled by unseeded rows whose drafts come from
    prompt lookup (one-hot proposals, the lossless rule) vs plain sampling alone."""
    model = model_of("qwen3")
    ids = tok.encode(PROMPTS[0])
    prompt = ids + reference_tokens(model, tok, ids, 12)  # it ends in the model's own loop: lookup proposes
    assert NgramIndex(prompt + reference_tokens(model, tok, prompt, 1)).propose(2)
    n = 320

    mx.random.seed(7)
    f = FixedWidth(3)  # lookup wherever it matches a full block
    eng = BatchEngine(model, tok, WrongDrafter([]), max_batch=8, policy=f)
    uids = [eng.submit(prompt, DecodeConfig(max_tokens=3, temperature=1.5, top_k=3)) for _ in range(n)]
    got = {u: [] for u in uids}
    looked = accepted = 0
    for u, r in eng.run():
        got[u].append(r.token)
        if r.finish_reason:
            looked += r.stats.lookup_cycles
            accepted += r.stats.accepted
    pvalue, outcomes = like_plain_sampling(model, tok, prompt, got.values())
    assert looked > 0 and accepted > 0 and outcomes > 3
    assert pvalue > 1e-3
