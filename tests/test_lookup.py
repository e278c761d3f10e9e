"""Prompt lookup (verify mode `lookup`): the n-gram index against a brute-force
reference, and token-for-token equality with mlx-lm, with and without a drafter."""

import math
import random

import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import generate
from mlx_dflash import load
from mlx_dflash.drafting.lookup import NgramIndex

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = 1\ny = 2\nx = 1\n",
    "the cat sat on the mat. the cat", "for i in range(10):\n    print(i)\nfor i in",
    "Natalia sold clips to 48 of her friends", "import os\nimport sys\nimport os\n",
    "a b c d a b c", "class Stack:\n    def push(self, x):\n        self.items.append(x)\n    def push(",
    "while True:", "He bought 3 pens for $2 each. He bought",
]
WIDTHS = [2, 3, 5, 8]
MAX = 24


def _brute(tokens, k, max_n, min_n):
    """The longest n-gram (max_n..min_n) ending the sequence that also ends
    earlier; its latest earlier end; what followed it."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n:]
        for e in range(L - 2, n - 2, -1):  # e: end index of an earlier occurrence (not the suffix itself)
            if tokens[e - n + 1: e + 1] == suffix:
                return tokens[e + 1: e + 1 + k]
    return []


@pytest.mark.parametrize("max_n,min_n", [(4, 2), (3, 1), (1, 1)])
def test_index_matches_brute_force(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        idx = NgramIndex(max_n=max_n, min_n=min_n)
        toks = []
        for _ in range(rng.randrange(1, 60)):
            t = rng.randrange(vocab)
            toks.append(t)
            idx.append(t)
            k = rng.randrange(1, 8)
            assert idx.propose(k) == _brute(toks, k, max_n, min_n), (toks, k)


def test_index_basics():
    idx = NgramIndex([1, 2, 3, 4, 1, 2])
    assert idx.match() == (2, 2) and idx.propose(3) == [3, 4, 1]
    assert NgramIndex([1, 2, 3]).propose(4) == []  # the suffix never matches itself
    idx = NgramIndex([7, 8, 9, 7, 8, 5, 7, 8])
    assert idx.propose(2) == [5, 7]  # the latest occurrence wins
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)


def _check(model, tok, drafter_for, widths=WIDTHS, **kw):
    looked = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, prompt, MAX)
        for w in widths:
            r = generate(model, tok, prompt, drafter_for(i, prompt, ref, w), max_tokens=MAX, block_size=w,
                         verify_mode="lookup", **kw)
            assert r.token_ids == ref, (prompt, w)
            assert r.stats.mode == "lookup" and r.stats.policy.startswith("lookup")
            looked += r.stats.lookup_cycles
            accepted += r.stats.accepted
    return looked, accepted


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lookup_without_drafter_equals_mlx_lm(pairs, family):
    model, tok, _ = load(str(pairs(family, version=1) / "target"))
    looked, accepted = _check(model, tok, lambda *a: None)
    assert looked > 0 and accepted > 0  # lookup really drafted, and some drafts were right


@pytest.mark.slow
def test_lookup_with_drafter_equals_mlx_lm(pairs):
    """Lookup where it has a full-width match, the drafter elsewhere: a real
    DFlash 2 drafter, and a partly right oracle (every rollback path runs)."""
    d = pairs("qwen3", version=2)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    looked, _ = _check(model, tok, lambda *a: drafter, widths=[3, 5])
    assert looked > 0
    vocab = model.args.vocab_size
    oracle = lambda i, p, ref, w: OracleDrafter(len(tok.encode(p)), ref, vocab, noise=0.3, seed=i * 13 + w)  # noqa: E731
    looked, accepted = _check(model, tok, oracle, widths=[2, 5, 8])
    assert looked > 0 and accepted > 0


@pytest.mark.slow
def test_lookup_sampling_is_seeded_and_exact_at_tiny_temperature(pairs):
    """Sampling goes through the same lossless rule (test_sampling checks its law);
    here: a temperature that is greedy in effect gives the greedy tokens, and a
    seed gives the same sample twice."""
    model, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    prompt = PROMPTS[0]
    ref = reference_tokens(model, tok, prompt, MAX)
    r = generate(model, tok, prompt, None, max_tokens=MAX, verify_mode="lookup", temperature=1e-6)
    assert r.token_ids == ref
    a = generate(model, tok, prompt, None, max_tokens=MAX, verify_mode="lookup", temperature=0.8, seed=3)
    b = generate(model, tok, prompt, None, max_tokens=MAX, verify_mode="lookup", temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and a.stats.cycles > 0


# -- the default mode's guard verifies lookup drafts where they pay --------------------


def _curve(c5, d5=0.0):
    """Measured widths 1 and 5 only, as the guard calibrates; plain token = 1-token step."""
    from mlx_dflash.policy.costs import Costs

    return Costs(0.01, {1: 1.0, 5: c5}, {1: 0.0, 5: d5}, t_plain=0.01)


class _Row:
    """A guarded row whose context offers `offer` lookup drafts (policy.base.Row)."""

    def __init__(self, offer=4, lookup=True, match=4):
        from mlx_dflash.policy.base import Plan

        self.uid, self.context, self.left, self.offer, self.match = 1, 0, 10**6, offer, match
        self.unseen = 0
        self.plan = Plan("dflash", 5, False, True, lookup)

    def offers(self, source, n):
        return n if source == "dflash" else min(n, self.offer)

    def grade(self, source):
        return self.match if source == "lookup" and self.offer else 0


def _guard(curve, prior=None):
    from mlx_dflash.policy.costs import CostModel
    from mlx_dflash.policy.guard import Guard

    return Guard(CostModel(lambda at: curve, sorted(curve.c)), prior)


def test_guard_lookup_gate_prices_proposals_by_the_cost_curve():
    from mlx_dflash.policy.base import DFLASH, LOOKUP, CycleResult

    row = _Row()
    g = _guard(_curve(2.4))
    d = g.decide([_Row(lookup=False)])
    assert LOOKUP not in d.sources and g.rows[1].gate is None  # only when asked for
    g = _guard(_curve(2.4))
    g.decide([row])
    lk = g.rows[1].gate
    assert [round(g.kv[w], 6) for w in (2, 3, 4, 5)] == [1.35, 1.7, 2.05, 2.4]  # linear between measured widths
    assert not lk.pays(0, 4, g.kv) and not lk.take(0, 4, g.kv)
    # pays when 1 + alpha n >= 1.1 c(n + 1) + 0.5: not at the prior acceptance 0.5 (3.0 < 3.14)
    assert not lk.pays(1, 4, g.kv) and not lk.pays(4, 4, g.kv)
    g.observe([row], [CycleResult(5, 4, 5, source=LOOKUP)])  # every draft right: alpha 0.5 -> 0.6
    assert lk.rate(4) == pytest.approx(0.6) and lk.pays(4, 4, g.kv)  # 1 + 0.6 * 4 = 3.4 >= 3.14
    assert "lookup: 1 cycles, 100% accepted" in g.reason(row) and g.reason(row).startswith("dflash: probing")
    # but while drafting it replaces a DFlash cycle: the probe's prior predicts tau (2.4 + 5) / 2 = 3.7 at
    # width 5 for the same verify (no drafter cost here), so lookup's 3.4 loses; at alpha 0.68 (3.72) it wins
    assert g.decide([row]).sources == (DFLASH,)
    g.observe([row], [CycleResult(5, 4, 5, source=LOOKUP)])
    assert g.decide([row]).sources == (LOOKUP,) and g.decide([row]).widths == (5,)
    for _ in range(3):
        g.observe([row], [CycleResult(5, 0, 1, source=LOOKUP)])
    assert not lk.pays(4, 4, g.kv)
    # while it does not pay, every (GAP x c(5))-th match is verified anyway (a text may start repeating):
    # exploring costs about 1/GAP of the time whatever a verify costs
    lk.skipped = 0  # (the decisions above counted theirs)
    every = math.ceil(lk.GAP * g.kv[5])
    taken = [lk.take(4, 4, g.kv) for _ in range(2 * every)]
    assert taken.count(True) == 2 and taken[every - 1] and taken[-1]
    cheap = _guard(_curve(1.2))  # cheap verifies: lookup pays against plain at the prior (3.0 >= 1.82)...
    assert cheap.decide([row]).sources == (DFLASH,) and cheap.rows[1].gate.pays(4, 4, cheap.kv)
    assert cheap.rows[1].gate.pays(4, 4, cheap.kv, rate=2.45) and not cheap.rows[1].gate.pays(4, 4, cheap.kv, rate=2.55)
    # ...not against the probe's DFlash cycle (tau 3.1 for 1.2: 2.58 tokens per plain step to lookup's 2.5)


def test_guard_prices_lookup_by_the_length_of_its_match():
    """A 2-token n-gram match is mostly chance, a 4-token one mostly a copy: the
    gate keeps a share per match length, so chance matches that fail stop being
    verified while long ones still are, and the next request starts from both."""
    from mlx_dflash.policy.base import LOOKUP, CycleResult
    from mlx_dflash.policy.costs import Observed

    short, long_ = _Row(match=2), _Row(match=4)  # (one row: its context ends in a short match, then a long one)
    g = _guard(_curve(1.2))  # cheap verifies: at the prior 0.5 a proposal pays beside plain steps
    g.state, g.wait = "plain", 10**6  # the drafter does not pay here: lookup or plain
    taken = 0
    for _ in range(6):  # the short matches' drafts all rejected
        if g.decide([short]).sources == (LOOKUP,):
            g.observe([short], [CycleResult(5, 0, 1, source=LOOKUP)])
            taken += 1
    gate = g.rows[1].gate
    # 1 + 4 alpha >= 1.1 x 1.2 + 0.5 holds down to alpha 0.205: four tries, then no more
    assert taken == 4 and gate.rate(2) == pytest.approx(0.5 * 0.8 ** 4) and gate.rate(4) == 0.5
    gate.skipped = 0  # (the skips above count toward an explore)
    assert g.decide([short]).sources == ("",) and g.decide([long_]).sources == (LOOKUP,)
    o = g.leave(long_)
    nxt = _guard(_curve(1.2), Observed(lookup_alpha=o.lookup_alpha))
    nxt.state, nxt.wait = "plain", 10**6
    assert nxt.decide([short]).sources == ("",) and nxt.decide([long_]).sources == (LOOKUP,)


def test_lookup_gate_trusts_a_short_match_no_more_than_a_longer_one():
    from mlx_dflash.policy.lookup_gate import LookupGate

    gate = LookupGate({4: 0.1})  # even 4-token matches fail (random ids): shorter ones are not tried at 0.5
    assert gate.rate(4) == gate.rate(3) == gate.rate(2) == 0.1
    gate = LookupGate({2: 0.1, 3: 0.3})  # chance short matches say nothing of longer ones
    assert (gate.rate(2), gate.rate(3), gate.rate(4)) == (0.1, 0.3, LookupGate.ALPHA0)
    gate.observe(4, 4, 3)  # a grade learns from its base, the rate it was priced at
    assert gate.rate(3) == pytest.approx(0.3 + LookupGate.RATE * 0.7) and gate.rate(2) == 0.1
    assert gate.tally.cycles == 1 and gate.tail() == "; lookup: 1 cycles, 100% accepted"


def test_lookup_proposer_grades_by_the_match_length():
    from types import SimpleNamespace

    from mlx_dflash.drafting.lookup import NgramIndex
    from mlx_dflash.drafting.proposers import DFlashProposer, LookupProposer

    def seq(tokens):
        return SimpleNamespace(pc=SimpleNamespace(index=NgramIndex(tokens) if tokens is not None else None))

    lp = LookupProposer()
    assert lp.grade(seq([1, 2, 3, 9, 2, 3])) == 2 and lp.offers(seq([1, 2, 3, 9, 2, 3]), 4) == 3
    assert lp.grade(seq([5, 6, 7, 1, 5, 6, 7])) == 3
    assert lp.grade(seq([4, 5, 6, 7, 8, 5, 6, 7])) == 3 and lp.grade(seq([4, 5, 6, 7, 8, 4, 5, 6, 7])) == 4
    assert lp.grade(seq([1, 2, 3, 4])) == 0 and lp.grade(seq(None)) == 0  # no match; no index
    assert DFlashProposer(None).grade(seq([1, 2, 1, 2])) == 0


@pytest.mark.slow
def test_default_mode_takes_lookup_drafts_and_stays_exact(pairs):
    """The default mode (guard) with a drafter that never pays (plain steps) and
    one that mostly does: lookup cycles happen in both, the drafter's context
    stays in step (the oracle checks it), and every output is mlx-lm's."""
    from mlx_dflash.engine import calibrate

    model, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    vocab = model.args.vocab_size
    looked = {}
    for noise in (1.0, 0.2):
        looked[noise] = 0
        for i, prompt in enumerate(PROMPTS):
            ref = reference_tokens(model, tok, prompt, MAX)
            dr = OracleDrafter(len(tok.encode(prompt)), ref, vocab, noise=noise, seed=i)
            calibrate.remember(model, dr, _curve(1.6, 0.4))  # DFlash pays from tau 2, lookup from 1 + 0.5 n >= c
            r = generate(model, tok, prompt, dr, max_tokens=MAX)
            assert r.token_ids == ref, (prompt, noise)
            assert r.stats.mode == "dflash" and r.stats.max_width == dr.block_size
            looked[noise] += r.stats.lookup_cycles
            if noise == 1.0:  # DFlash does not pay: the guard's cycles are plain steps or lookups
                assert r.stats.drafted <= 3 * 4 + 4 * r.stats.lookup_cycles
    assert looked[1.0] > 0 and looked[0.2] > 0
    prompt = PROMPTS[0]
    ref = reference_tokens(model, tok, prompt, MAX)
    dr = OracleDrafter(len(tok.encode(prompt)), ref, vocab, noise=1.0)
    calibrate.remember(model, dr, _curve(1.6, 0.4))
    r = generate(model, tok, prompt, dr, max_tokens=MAX, lookup=False)  # the guard without its lookup drafts
    assert r.token_ids == ref and r.stats.lookup_cycles == 0 and "lookup" not in r.stats.policy


def test_lookup_index_is_kept_with_the_prompt_cache(pairs):
    """A next turn that extends the last call's text indexes only its new tokens;
    a prompt that does not is indexed afresh. Outputs stay mlx-lm's."""
    from mlx_dflash.cache.prompt_cache import PromptCache

    model, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    pc = PromptCache()
    first = tok.encode(PROMPTS[0])
    r = generate(model, tok, first, None, max_tokens=8, verify_mode="lookup", prompt_cache=pc)
    idx = pc.index
    assert idx is not None and idx.tokens[: len(first)] == first
    assert idx.tokens[len(first):] == r.token_ids[: len(idx.tokens) - len(first)]
    nxt = idx.tokens + tok.encode(PROMPTS[2])
    r = generate(model, tok, nxt, None, max_tokens=MAX, verify_mode="lookup", prompt_cache=pc)
    assert pc.index is idx and r.token_ids == reference_tokens(model, tok, nxt, MAX)
    other = tok.encode(PROMPTS[3])
    generate(model, tok, other, None, max_tokens=4, verify_mode="lookup", prompt_cache=pc)
    assert pc.index is not idx and pc.index.tokens[: len(other)] == other


def test_guard_where_dflash_cannot_pay_runs_no_drafter_but_lookup(pairs):
    """A DFlash cycle costing 4.5 plain tokens at width 5 (w / k < 1.25): the drafter is
    never run (nor its features captured), lookup drafts still are; exact."""
    from mlx_dflash.engine import calibrate

    model, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    prompt = PROMPTS[0]
    ref = reference_tokens(model, tok, prompt, MAX)
    dr = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size)

    def never(*a, **k):
        raise AssertionError("the drafter ran where it cannot pay")

    dr.propose = never
    calibrate.remember(model, dr, _curve(2.0, 2.5))  # verifies are cheap, drafting is not
    r = generate(model, tok, prompt, dr, max_tokens=MAX)
    assert r.token_ids == ref and r.stats.mode == "dflash"
    assert r.stats.policy.startswith("plain: width 5 cannot pay here") and r.stats.lookup_cycles > 0


def test_guard_carries_lookup_acceptance_to_the_next_request():
    from mlx_dflash.policy.base import LOOKUP, CycleResult
    from mlx_dflash.policy.costs import Observed

    row = _Row()
    g = _guard(_curve(2.0))
    g.decide([row])
    for _ in range(4):
        g.observe([row], [CycleResult(5, 0, 1, source=LOOKUP)])
    o = g.leave(row)
    assert o.lookup_alpha == pytest.approx({4: 0.5 * 0.8 ** 4})
    nxt = _guard(_curve(2.0), Observed(lookup_alpha=o.lookup_alpha))
    nxt.decide([row])
    assert nxt.rows[1].gate.rate(4) == pytest.approx(0.5 * 0.8 ** 4) and not nxt.rows[1].gate.pays(4, 4, nxt.kv)
    assert not nxt.rows[1].gate.pays(4, 3, nxt.kv)  # a shorter match than those that failed: no likelier
    fresh = _guard(_curve(2.0))
    fresh.decide([row])
    assert fresh.rows[1].gate.pays(4, 4, fresh.kv)  # a fresh start: the prior
    # a request without lookup between two with it hands the rate on as it came
    off = _guard(_curve(2.0), Observed(lookup_alpha=o.lookup_alpha))
    plain_row = _Row(lookup=False)
    off.decide([plain_row])
    assert off.leave(plain_row).lookup_alpha == pytest.approx(o.lookup_alpha)


def test_guard_where_dflash_cannot_pay_keeps_the_prompt_cache_reusable(pairs):
    """With a prompt cache (chat, server) the drafter still never runs, but the
    features are kept, so a later call reuses the whole cached prefix."""
    from mlx_dflash.engine import calibrate
    from mlx_dflash.cache.prompt_cache import PromptCache, reusable

    model, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    prompt = PROMPTS[0]
    ref = reference_tokens(model, tok, prompt, MAX)
    dr = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size)
    dr.propose = lambda *a, **k: pytest.fail("the drafter ran where it cannot pay")
    calibrate.remember(model, dr, _curve(2.0, 2.5))
    pc = PromptCache()
    r = generate(model, tok, prompt, dr, max_tokens=MAX, prompt_cache=pc)
    assert r.token_ids == ref and r.stats.policy.startswith("plain: width 5 cannot pay here")
    assert reusable(pc, dr) == len(pc.tokens) > len(tok.encode(prompt))
    nxt = pc.tokens + tok.encode(PROMPTS[1])
    r = generate(model, tok, nxt, dr, max_tokens=8, prompt_cache=pc)
    assert r.stats.reused_tokens == len(nxt) - len(tok.encode(PROMPTS[1])) and r.token_ids == reference_tokens(model, tok, nxt, 8)
