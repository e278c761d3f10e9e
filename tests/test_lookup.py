"""Prompt lookup (verify mode `lookup`): the n-gram index against a brute-force
reference, and token-for-token equality with mlx-lm, with and without a drafter."""

import random

import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import generate, load
from mlx_dflash.lookup import NgramIndex

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


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lookup_without_drafter_equals_mlx_lm(pairs, family):
    model, tok, _ = load(str(pairs(family, version=1) / "target"))
    looked, accepted = _check(model, tok, lambda *a: None)
    assert looked > 0 and accepted > 0  # lookup really drafted, and some drafts were right


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
