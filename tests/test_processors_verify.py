"""Logits processors inside DFlash's verify (mlx_dflash/engine/logits.py): each verify
row is processed after its own history, so DFlash and prompt-lookup drafts with
processors give token for token what plain decoding with the same processors
gives (greedy), which is mlx-lm's own generate_step(logits_processors=...), and
the same distribution (sampling). Processors: logit_bias, a repetition penalty,
a constrained JSON-schema format (app/server/structured.py's Constrained: its
matcher rolls back to each row's history) and a stateful toy that bans tokens
once a trigger token has been generated (the rollback rule of
DecodeConfig.logits_processors). The stats show DFlash ran (cycles with
drafts, some accepted): these tests cannot pass on plain decoding."""

import mlx.core as mx
import pytest
from drafters import FixedDrafter, OracleDrafter
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from batch_rows import MAXES, RowOracles, like_plain_sampling, model_of, prompts_for, run_engine, sampled_rows

from app.server.structured import Constrained, parse_format
from mlx_dflash import DecodeConfig, load
from mlx_dflash import generate
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.policy.fixed import FixedWidth

PROMPTS = ["def fibonacci(n):", "The answer is", "import os\nimport sys\nimport os\nimport"]
MAX = 20
KINDS = ["bias", "repetition", "json", "ban"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}
FORMAT = parse_format("json_schema", SCHEMA, "response_format")


class BanAfter:
    """A stateful processor: once `trigger` has been generated, the `banned`
    tokens get -inf. It keeps the ids it consumed and, for a history that is not
    an extension of them, rolls back to the common prefix first."""

    def __init__(self, n_prompt, trigger, banned):
        self.n_prompt, self.trigger, self.banned = n_prompt, trigger, mx.array(sorted(banned))
        self.seen, self.at = [], None  # ids consumed; where the trigger first is among them

    def __call__(self, tokens, logits):
        ids = tokens[self.n_prompt:].tolist()
        k = 0
        while k < min(len(ids), len(self.seen)) and ids[k] == self.seen[k]:
            k += 1
        del self.seen[k:]
        if self.at is not None and self.at >= k:
            self.at = None
        for t in ids[k:]:
            if t == self.trigger and self.at is None:
                self.at = len(self.seen)
            self.seen.append(t)
        if self.at is None:
            return logits
        return logits.at[:, self.banned].add(mx.array(-float("inf"), logits.dtype))


def processors(kind, tok, ids, model):
    """A fresh processor list (the stateful ones keep state per generation)."""
    if kind == "bias":
        return make_logits_processors({5: 3.0, 40: 1.5, 149: -2.0})
    if kind == "repetition":
        return make_logits_processors(None, 1.3, 6)
    if kind == "json":
        return [Constrained(FORMAT, tok, model.args.vocab_size, len(ids))]
    # the ban: a trigger early in the unprocessed output, banning tokens it makes later
    plain = mlx_lm_tokens(model, tok, ids, [], 8)
    return [BanAfter(len(ids), plain[1], plain[3:8])]


def mlx_lm_tokens(model, tok, ids, procs, max_tokens=MAX):
    """mlx-lm's generate_step with the processors: the independent reference (EOS excluded)."""
    out = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens, logits_processors=procs):
        if int(t) in tok.eos_token_ids:
            break
        out.append(int(t))
    return out


def run(model, tok, ids, drafter, kind, **kw):
    return generate(model, tok, ids, drafter, max_tokens=MAX, logits_processors=processors(kind, tok, ids, model),
                    **kw)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_dflash_with_processors_equals_plain_and_mlx_lm(pairs, kind):
    """DFlash 1 and DFlash 2 drafters and an oracle right for most drafts (so
    drafts are accepted and rejected in every cycle), at widths 2, 4 and 8."""
    d1, d2 = pairs("qwen3", version=1), pairs("qwen3", version=2, block_size=8)
    model, tok, drafter1 = load(str(d1 / "target"), str(d1 / "drafter"))
    _, _, drafter2 = load(str(d2 / "target"), str(d2 / "drafter"))
    acc = [0, 0]
    changed = False
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        want = mlx_lm_tokens(model, tok, ids, processors(kind, tok, ids, model))
        changed |= want != mlx_lm_tokens(model, tok, ids, [])
        plain = run(model, tok, ids, drafter1, kind, verify_mode="off")
        assert plain.token_ids == want, (kind, prompt)
        for w in (2, 4, 8):
            for drafter in (drafter1, drafter2, OracleDrafter(len(ids), want, 512, noise=0.3, seed=i * 31 + w)):
                r = run(model, tok, ids, drafter, kind, block_size=w, guard=False)
                assert r.token_ids == want, (kind, prompt, w, drafter)
                assert r.stats.mode == "dflash" and r.stats.fallback is None and r.stats.drafted > 0
                if isinstance(drafter, OracleDrafter):
                    acc[0] += r.stats.accepted
                    acc[1] += r.stats.drafted
    assert changed  # the processors change the output
    assert 0 < acc[0] < acc[1]  # drafts accepted (rows past the anchor used) and rejected (rollbacks)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_lookup_drafts_with_processors_equal_plain(pairs, kind):
    """Verify mode lookup without a drafter: prompt-lookup cycles and plain
    steps in turn, each with the processors."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    drafted = 0
    for prompt in PROMPTS + ["a b a b a b a b a b", "x = 1\nx = 1\nx = 1\nx = 1\n"]:
        ids = tok.encode(prompt)
        want = mlx_lm_tokens(model, tok, ids, processors(kind, tok, ids, model))
        r = run(model, tok, ids, None, kind, verify_mode="lookup", block_size=4)
        assert r.token_ids == want, (kind, prompt)
        assert r.stats.mode == "lookup"
        drafted += r.stats.drafted
    assert drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_hybrid_families_with_processors_equal_mlx_lm(family, tok):
    """Recurrent layers (gated delta, Mamba2): their rollback and the processors' together."""
    model = model_of(family)
    acc = [0, 0]
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = tok.encode(prompt)
        for kind in KINDS:
            want = mlx_lm_tokens(model, tok, ids, processors(kind, tok, ids, model))
            for w in (2, 5):
                o = OracleDrafter(len(ids), want, 512, noise=0.3, seed=i * 31 + w, layer_ids=(0, 2))
                r = run(model, tok, ids, o, kind, block_size=w, guard=False)
                assert r.token_ids == want, (family, kind, prompt, w)
                assert r.stats.mode == "dflash"
                acc[0] += r.stats.accepted
                acc[1] += r.stats.drafted
    assert 0 < acc[0] < acc[1]


def test_constrained_rolls_back_and_never_errs(pairs):
    """The matcher follows histories that branch and ones with a forbidden
    token (a row past a rejected draft): it consumes their valid prefix, leaves
    the logits as they are, and masks exactly as a fresh matcher after a rollback."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    ids = tok.encode("x")
    good = tok.encode('{"a":12,"b":"', add_special_tokens=False)
    c = Constrained(FORMAT, tok, 512, len(ids))
    logits = mx.zeros((1, 512))

    def mask(proc, gen):
        return (proc(mx.array(ids + gen), logits) == 0).tolist()[0]

    fresh = [mask(Constrained(FORMAT, tok, 512, len(ids)), good[:k]) for k in range(len(good) + 1)]
    assert sum(fresh[0]) == 1  # '{' only
    bad = good[:3] + [tok.encode("]", add_special_tokens=False)[0]] + good[4:]
    for gen in (good, good[:2], bad, good[:5], bad[:6], good, good[:1], []):
        got = mask(c, gen)
        if gen == bad[: len(gen)] and gen != good[: len(gen)]:
            assert all(got)  # a forbidden history: unchanged
        else:
            assert got == fresh[len(gen)], gen
        assert not c.matcher.is_error()
    assert mask(c, good) == fresh[-1]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["fixed", "dflash2"])
def test_sampled_dflash_with_processors_keeps_the_distribution(pairs, drafter):
    """The joint law of 3 tokens sampled by DFlash with a logit_bias that moves
    the mass off the likeliest tokens vs plain sampling with the same bias: drafts
    on the biased greedy path (a one-hot proposal, often accepted), or a DFlash 2
    drafter's sampled proposal rows q (the residual max(p - q, 0) of processed p)."""
    d = pairs("qwen3", version=2, block_size=8)
    model, tok, dflash2 = load(str(d / "target"), str(d / "drafter"))
    prompt = "def f(x):"
    top = generate(model, tok, prompt, None, max_tokens=3).token_ids
    bias = {t: -1.5 for t in top}
    greedy = generate(model, tok, prompt, None, max_tokens=3, logits_processors=make_logits_processors(bias)).token_ids
    fixed = FixedDrafter(greedy[1:])
    n, streams, accepted, drafted = 320, [], 0, 0
    for s in range(n):
        r = generate(model, tok, prompt, fixed if drafter == "fixed" else dflash2, seed=90_000 + s, block_size=3,
                     guard=False, max_tokens=3, temperature=1.5, top_k=3,
                     logits_processors=make_logits_processors(bias))
        streams.append(r.token_ids)
        accepted, drafted = accepted + r.stats.accepted, drafted + r.stats.drafted
    pvalue, outcomes = like_plain_sampling(model, tok, prompt, streams, logits_processors=make_logits_processors(bias))
    assert drafted > 0 and outcomes > 3
    if drafter == "fixed":
        assert 0 < accepted < drafted
    assert pvalue > 1e-3


@pytest.mark.slow
def test_batch_rows_with_processors_equal_each_alone(pairs):
    """Rows with processors beside rows without, joining a running batch and
    leaving at different cycles, at widths 1, 4 and 8 (oracle drafts right for a
    random prefix of each block), and a real DFlash 2 drafter; each row is
    mlx-lm's output with its own processors."""
    d = pairs("qwen3", version=2, block_size=8)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    kinds = ["bias", None, "json", "repetition", "ban", None]
    maxes = [20, 12, 18, 9, 16, 14]
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(len(kinds))]
    ids = [tok.encode(p) for p in prompts]

    def procs(i):
        return processors(kinds[i], tok, ids[i], model) if kinds[i] else []

    refs = [mlx_lm_tokens(model, tok, x, procs(i), m) for i, (x, m) in enumerate(zip(ids, maxes))]

    def requests():
        return [(x, DecodeConfig(max_tokens=m, logits_processors=procs(i))) for i, (x, m) in enumerate(zip(ids, maxes))]

    for w, together in ((1, False), (4, True), (8, False)):
        oracle = RowOracles([(len(x), r) for x, r in zip(ids, refs)], seed=w)
        eng = BatchEngine(model, tok, oracle, max_batch=3, policy=FixedWidth(w), prefill_together=together)
        out, last = run_engine(eng, requests(), join_after=2)
        for i, ref in enumerate(refs):
            assert out[i] == ref, (w, i, kinds[i])
        if w > 1:
            assert any(0 < last[i].stats.accepted < last[i].stats.drafted for i in last if kinds[i])
    eng = BatchEngine(model, tok, drafter, max_batch=4, policy=FixedWidth(5))
    out, last = run_engine(eng, requests(), join_after=2)
    for i, ref in enumerate(refs):
        assert out[i] == ref, ("dflash2", i, kinds[i])
        assert last[i].stats.mode == "dflash" and last[i].stats.drafted > 0


@pytest.mark.slow
def test_batch_sampled_rows_with_processors_keep_the_distribution(pairs):
    """The joint law of 3 tokens sampled by batch rows with a logit_bias that
    moves the mass off the likeliest tokens, drafts on the biased greedy path,
    vs plain sampling alone with the same processors."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt = "def f(x):"
    top = generate(model, tok, prompt, None, max_tokens=3).token_ids
    bias = {t: -1.5 for t in top}
    greedy = generate(model, tok, prompt, None, max_tokens=3, logits_processors=make_logits_processors(bias)).token_ids
    got, tried, accepted = sampled_rows(model, tok, prompt, greedy, 320, 70_000,
                                        logits_processors=make_logits_processors(bias))
    pvalue, outcomes = like_plain_sampling(model, tok, prompt, got, logits_processors=make_logits_processors(bias))
    assert tried > 0 and accepted > 0 and outcomes > 3
    assert pvalue > 1e-3


@pytest.mark.slow
def test_batch_lookup_rows_with_processors_equal_each_alone(tok):
    """Rows whose context repeats verify prompt-lookup drafts (the others the
    oracle's), with and without processors: each row is mlx-lm's output with its
    own processors."""
    model, prompts = model_of("qwen3"), prompts_for("qwen3", tok)
    kinds = ["bias", "ban", None, "repetition", "json", "bias"]

    def procs(i):
        return processors(kinds[i], tok, prompts[i], model) if kinds[i] else []

    refs = [mlx_lm_tokens(model, tok, p, procs(i), m) for i, (p, m) in enumerate(zip(prompts, MAXES))]
    oracle = RowOracles([(len(p), r) for p, r in zip(prompts, refs)], seed=5)
    eng = BatchEngine(model, tok, oracle, max_batch=3, policy=FixedWidth(5))
    out, last = run_engine(eng, [(p, DecodeConfig(max_tokens=m, logits_processors=procs(i)))
                                 for i, (p, m) in enumerate(zip(prompts, MAXES))])
    for i, ref in enumerate(refs):
        assert out[i] == ref, (i, kinds[i])
    assert sum(last[i].stats.lookup_cycles for i in last if kinds[i]) > 0
