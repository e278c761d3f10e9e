"""Speculative sampling draws from the target's distribution (DFLASH2.md section 5)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.engine.sampling import SamplingParams, accept_speculative, probs

V = 5


def _p_row(prev):
    """A target whose next-token distribution depends on the previous token."""
    base = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
    return np.roll(base, prev)


def _broken_accept(p, drafts, q):
    """Accepts every draft whose target prob is non-zero: a classic bug."""
    p_np = np.array(p)
    for i, x in enumerate(drafts):
        if p_np[i, x] > 0:
            continue
        return i, int(np.argmax(p_np[i]))
    return len(drafts), int(mx.random.categorical(mx.log(p[len(drafts)])).item())


def _run(rule, q_rows, n=6000, seed=0):
    """Emit 2 tokens after token 0: a 2-draft block. Returns joint counts [V, V]."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        d1 = int(rng.choice(V, p=q_rows[0]))
        d2 = int(rng.choice(V, p=q_rows[1]))
        # rows: p(.|anchor), p(.|d1), p(.|d2): what a verify over [anchor, d1, d2] scores
        p = mx.array(np.stack([_p_row(0), _p_row(d1), _p_row(d2)]).astype(np.float32))
        q = None if q_rows.max(axis=1).min() == 1.0 else mx.array(q_rows.astype(np.float32))
        a, nxt = rule(p, [d1, d2], q)
        out = [d1, d2][:a] + [nxt]
        if len(out) < 2:  # rejected at 0: the second token comes from p(.|out[0])
            out.append(int(rng.choice(V, p=_p_row(out[0]))))
        counts[out[0], out[1]] += 1
    return counts


def _chi2_pvalue(counts):
    from scipy.stats import chisquare

    exp = np.outer(_p_row(0), np.ones(V)) * np.stack([_p_row(i) for i in range(V)])
    return chisquare(counts.ravel(), exp.ravel() * counts.sum()).pvalue


Q_SAMPLED = np.array([[0.1, 0.5, 0.2, 0.1, 0.1], [0.3, 0.1, 0.1, 0.4, 0.1]])
Q_ONEHOT = np.array([[0, 1.0, 0, 0, 0], [0, 0, 0, 1.0, 0]])


@pytest.mark.slow
@pytest.mark.parametrize("q", [Q_SAMPLED, Q_ONEHOT], ids=["sampled-q", "one-hot-q"])
def test_speculative_sampling_matches_target_distribution(q):
    assert _chi2_pvalue(_run(accept_speculative, q)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("q", [Q_SAMPLED, Q_ONEHOT], ids=["sampled-q", "one-hot-q"])
def test_broken_acceptance_rule_fails_the_same_test(q):
    assert _chi2_pvalue(_run(_broken_accept, q)) < 1e-6


def test_filters_apply_to_target_side():
    logits = mx.array([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = np.array(probs(logits, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert (p[2:] == 0).all() and abs(p.sum() - 1) < 1e-6 and p[0] > p[1] > 0
    p = np.array(probs(logits, SamplingParams(temperature=1.0, top_p=0.7)))[0]
    full = np.exp([3.0, 2.0, 1.0, 0.0, -1.0]); full /= full.sum()
    assert p[0] > 0 and p[1] > 0 and (p[2:] == 0).all()  # 0.665 < 0.7 needs the second token
    p = np.array(probs(logits, SamplingParams(temperature=1.0, min_p=0.2)))[0]
    assert ((full >= 0.2 * full.max()) == (p > 0)).all()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


@pytest.mark.slow
def test_end_to_end_sampling_distribution(pairs):
    """The whole loop, speculative vs plain sampling: the joint law of 3 tokens."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from drafters import FixedDrafter
    from mlx_dflash import generate
    from mlx_dflash import load

    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt = "def f(x):"
    kw = dict(max_tokens=3, temperature=1.5, top_k=3)
    greedy = generate(model, tok, prompt, None, max_tokens=3).token_ids
    fixed = FixedDrafter(greedy[1:])  # a draft the target often, not always, accepts
    accepted = 0

    def draw(spec, seed):
        nonlocal accepted
        if spec:
            r = generate(model, tok, prompt, fixed, seed=seed, block_size=3, **kw)
            accepted += r.stats.accepted
            return tuple(r.token_ids)
        return tuple(generate(model, tok, prompt, None, seed=seed, verify_mode="off", **kw).token_ids)

    n = 500
    plain = Counter(draw(False, s) for s in range(n))
    spec = Counter(draw(True, 10_000 + s) for s in range(n))
    keys = sorted(set(plain) | set(spec))
    table = np.array([[plain[k] + 0.5 for k in keys], [spec[k] + 0.5 for k in keys]])
    # drafts were really verified (every call drafts, at the published width: a rejection
    # before the last token drafts again)
    assert fixed.proposed >= n and 0 < accepted < fixed.proposed
    assert len(keys) > 3  # a real distribution, not one path
    assert chi2_contingency(table).pvalue > 1e-3


@pytest.mark.slow
def test_end_to_end_sampling_distribution_dflash2(pairs):
    """DFlash 2 at T > 0: the selector samples its walk on the device and hands
    its dense proposal rows q to the rejection rule; the joint law of 3 tokens
    matches plain sampling. (A random drafter's drafts are nearly always
    rejected here, so this exercises the residual max(p - q, 0) draw; the
    accept branch with a sampled q is checked rule by rule above, and the walk's
    q against its own draws in test_selector.)"""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from mlx_dflash import generate
    from mlx_dflash import load

    d = pairs("qwen3", version=2)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    prompt = "def f(x):"
    kw = dict(max_tokens=3, temperature=1.5, top_k=3)
    n, drafted = 400, 0

    def draw(spec, seed):
        nonlocal drafted
        if spec:
            r = generate(model, tok, prompt, drafter, seed=seed, block_size=3, **kw)
            drafted += r.stats.drafted
            return tuple(r.token_ids)
        return tuple(generate(model, tok, prompt, None, seed=seed, verify_mode="off", **kw).token_ids)

    plain = Counter(draw(False, s) for s in range(n))
    spec = Counter(draw(True, 20_000 + s) for s in range(n))
    keys = sorted(set(plain) | set(spec))
    table = np.array([[plain[k] + 0.5 for k in keys], [spec[k] + 0.5 for k in keys]])
    assert drafted > 0 and len(keys) > 3
    assert chi2_contingency(table).pvalue > 1e-3
