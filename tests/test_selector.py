import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash.drafting.selector import PathSelector, selector_param_count

V, H, R = 50, 32, 8


def setup(P, K, seed=0, scale=1.0):
    """A selector with a live (non-zero) successor side, a target embedding, drafter outputs."""
    mx.random.seed(seed)
    sel = PathSelector(H, rank=R, top_k=K)
    sel.successor_projection.weight = mx.random.normal((R, H)) * scale
    embed = nn.Embedding(V, H)
    logits = mx.random.normal((P, V))
    h = mx.random.normal((P, H))
    return sel, embed, logits, h


def np_score(sel, embed, prev, b, t, logits, h):
    """S_t(prev, b) from the weights, in numpy (float64)."""
    E = np.array(embed.weight, np.float64)
    Wa, Wb, Wh = (np.array(m.weight, np.float64) for m in
                  (sel.predecessor_projection, sel.successor_projection, sel.hidden_projection))
    return float(np.array(logits)[t, b] + ((E[prev] @ Wa.T) * (Wh @ np.array(h)[t]) * (E[b] @ Wb.T)).sum())


def top_k_ids(logits, K):
    return np.argsort(-np.array(logits), axis=-1)[:, :K]


@pytest.mark.parametrize("P,K", [(3, 3), (4, 4), (1, 3), (4, 3)])
def test_lattice_equals_pair_scores(P, K):
    sel, embed, logits, h = setup(P, K)
    anchor = 7
    ids, u = sel.candidates(logits)
    S = np.array(sel.lattice(anchor, ids, u, h, embed))
    assert S.shape == (P, K, K)
    idn = np.array(ids)
    # pair_scores with a leading batch axis over the predecessor's candidate index a.
    prev = np.stack([[anchor] + [int(idn[t - 1, a]) for t in range(1, P)] for a in range(K)])
    ps = sel.pair_scores(mx.array(prev), mx.broadcast_to(ids, (K, P, K)), mx.broadcast_to(u, (K, P, K)),
                         mx.broadcast_to(h, (K, P, H)), embed)
    np.testing.assert_allclose(S, np.array(ps).transpose(1, 0, 2), rtol=1e-5, atol=1e-5)
    for t, a, b in itertools.product(range(P), range(K), range(K)):
        p = anchor if t == 0 else int(idn[t - 1, a])
        assert S[t, a, b] == pytest.approx(np_score(sel, embed, p, int(idn[t, b]), t, logits, h), abs=1e-4)


@pytest.mark.parametrize("P,K", [(3, 3), (4, 4), (3, 4), (4, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_walk_equals_brute_force(P, K, seed):
    sel, embed, logits, h = setup(P, K, seed, scale=3.0)
    anchor = 3
    cand = top_k_ids(logits, K)
    paths = list(itertools.product(*[cand[t] for t in range(P)]))  # all K^P token paths
    score = lambda t, path: np_score(sel, embed, anchor if t == 0 else path[t - 1], path[t], t, logits, h)
    for t in range(P):  # keep the paths that take the best successor at step t
        best = max(score(t, p) for p in paths)
        paths = [p for p in paths if score(t, p) > best - 1e-4]
    assert len(paths) == 1
    tokens, q = sel.propose(logits, h, anchor, embed)
    assert q is None and tokens == list(paths[0])


@pytest.mark.parametrize("T", [0.0, 0.8])
def test_conf_is_the_path_score_of_each_pick(T):
    """conf_t = softmax over the candidates of S_t(previous pick, .), at the pick."""
    sel, embed, logits, h = setup(4, 4, 5, scale=3.0)
    tokens, q, conf = sel.propose(logits, h, 3, embed, temperature=T, key=mx.random.key(1), with_conf=True)
    want = []
    for t, tok in enumerate(tokens):
        cand = np.array(top_k_ids(logits, 4))[t]
        prev = 3 if t == 0 else tokens[t - 1]
        s = np.array([np_score(sel, embed, prev, b, t, logits, h) for b in cand], np.float64)
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        want.append(p[list(cand).index(tok)])
    assert conf == pytest.approx(want, rel=1e-4)
    plain = sel.propose(logits, h, 3, embed, temperature=T, key=mx.random.key(1))
    assert plain[0] == tokens  # asking for conf changes nothing else


def test_walk_is_not_just_top1():
    """Guard for the test above: with a live successor side the path differs from top-1 somewhere."""
    differs = 0
    for seed in range(10):
        sel, embed, logits, h = setup(4, 4, seed, scale=3.0)
        differs += sel.propose(logits, h, 3, embed)[0] != np.argmax(np.array(logits), -1).tolist()
    assert differs > 0


def test_fresh_selector_picks_top1():
    mx.random.seed(0)
    sel, embed = PathSelector(H, rank=R, top_k=16), nn.Embedding(200, H)
    for P in (1, 4, 15):
        logits, h = mx.random.normal((P, 200)), mx.random.normal((P, H))
        tokens, _ = sel.propose(logits, h, 5, embed)
        assert tokens == np.argmax(np.array(logits), -1).tolist()


@pytest.mark.slow
def test_sampling_walk_distribution_and_q():
    P, K, T, n = 3, 3, 1.5, 3000
    sel, embed, logits, h = setup(P, K, seed=4, scale=0.5)
    anchor = 11
    cand = top_k_ids(logits, K)

    def path_prob(path):  # product over steps of softmax(S_t(prev, .) / T) over the K candidates
        p = 1.0
        for t in range(P):
            prev = anchor if t == 0 else path[t - 1]
            s = np.array([np_score(sel, embed, prev, int(b), t, logits, h) for b in cand[t]]) / T
            e = np.exp(s - s.max())
            p *= e[list(cand[t]).index(path[t])] / e.sum()
        return p

    paths = list(itertools.product(*[cand[t].tolist() for t in range(P)]))
    expect = np.array([path_prob(p) for p in paths])
    assert expect.sum() == pytest.approx(1.0)
    counts = dict.fromkeys(paths, 0)
    keys = mx.random.split(mx.random.key(123), n)
    for i in range(n):
        tokens, q = sel.propose(logits, h, anchor, embed, temperature=T, key=keys[i])
        counts[tuple(tokens)] += 1
        if i < 20:
            qn = np.array(q)
            assert qn.shape == (P, V) and qn.dtype == np.float32
            np.testing.assert_allclose(qn.sum(-1), 1.0, rtol=1e-5)
            for t in range(P):
                assert set(np.nonzero(qn[t])[0]) <= set(cand[t].tolist())
            # q holds the conditionals actually sampled from: their product is the path probability.
            assert np.prod(qn[np.arange(P), tokens]) == pytest.approx(path_prob(tuple(tokens)), rel=1e-4)
    obs = np.array([counts[p] for p in paths])
    chi2 = ((obs - n * expect) ** 2 / (n * expect)).sum()
    assert chi2 < 54.05  # df = 26, p = 0.001
    # ...and the test has power: against the product of per-position marginals (no pair term) it fails.
    u = np.array(logits)[np.arange(P)[:, None], cand] / T
    marg = np.exp(u - u.max(-1, keepdims=True))
    marg /= marg.sum(-1, keepdims=True)
    wrong = np.array([np.prod([marg[t, list(cand[t]).index(p[t])] for t in range(P)]) for p in paths])
    assert ((obs - n * wrong) ** 2 / (n * wrong)).sum() > 54.05


def test_codebook_form_equals_factorised():
    P, K = 4, 4
    sel, embed, logits, h = setup(P, K, seed=5, scale=2.0)
    cb = PathSelector(H, rank=R, top_k=K, codebook_vocab=V)
    keys = {k for k, _ in tree_flatten(cb.parameters())}
    assert keys == {"hidden_projection.weight", "predecessor_codebook", "successor_codebook"}
    cb.load_weights([
        ("hidden_projection.weight", sel.hidden_projection.weight),
        ("predecessor_codebook", sel.predecessor_projection(embed.weight)),  # E @ W_A^T, [V, r]
        ("successor_codebook", sel.successor_projection(embed.weight)),
    ])
    ids, u = sel.candidates(logits)
    np.testing.assert_allclose(np.array(cb.lattice(9, ids, u, h, embed)),
                               np.array(sel.lattice(9, ids, u, h, embed)), rtol=1e-5, atol=1e-5)
    assert cb.propose(logits, h, 9, embed)[0] == sel.propose(logits, h, 9, embed)[0]
    # A fresh codebook selector also keeps top-1.
    fresh = PathSelector(H, rank=R, top_k=K, codebook_vocab=V)
    assert fresh.propose(logits, h, 9, embed)[0] == np.argmax(np.array(logits), -1).tolist()


def test_pair_scores_trainable():
    P, K = 5, 4
    sel, embed, logits, h = setup(P, K, seed=6)
    sel.successor_projection.weight = mx.zeros((R, H))  # fresh init must still get a gradient
    ids, u = sel.candidates(logits)
    prev = mx.array(np.random.default_rng(0).integers(0, V, (2, P)))
    label = mx.array(np.random.default_rng(1).integers(0, K, (2, P)))

    def loss(m):
        s = m.pair_scores(prev, mx.broadcast_to(ids, (2, P, K)), mx.broadcast_to(u, (2, P, K)),
                          mx.broadcast_to(h, (2, P, H)), embed)
        return nn.losses.cross_entropy(s, label).mean()

    _, g = nn.value_and_grad(sel, loss)(sel)
    assert mx.abs(g["successor_projection"]["weight"]).max().item() > 0


def test_param_count():
    n = selector_param_count(2560, 256)
    assert n == 3 * 2560 * 256 and abs(n - 2.0e6) <= 0.1e6
    sel = PathSelector(2560, rank=256)
    assert sum(v.size for _, v in tree_flatten(sel.parameters())) == n
    assert sel.hidden_projection.weight.shape == (256, 2560)


@pytest.mark.parametrize("P,V,k", [(3, 50, 4), (4, 8192, 16), (2, 5000, 16), (15, 40000, 16), (1, 2048, 8)])
def test_top_k_ids(P, V, k):
    from mlx_dflash.drafting.selector import top_k_ids

    logits = mx.random.normal((P, V), key=mx.random.key(V))
    got = np.sort(np.array(top_k_ids(logits, k)), -1)
    want = np.sort(np.argsort(-np.array(logits), -1)[:, :k], -1)
    assert (got == want).all()
