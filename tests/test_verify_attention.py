"""The verify's split attention (target/verify_attention.py, Target.verify_forward):
1. its exp is mx.exp within an ulp; its attention is mx.fast's within float
   rounding for every mask kind, head grouping, dtype, sinks and chunking;
2. where it does not pay it is mlx-lm's own function, bit for bit;
3. on every tiny family, verify_forward's logits and features are __call__'s
   within float rounding at every width, with the split form forced on;
4. greedy speculative decoding whose verifies run verify_forward is token for
   token mlx-lm's generate_step at 8k, 16k and 32k tokens of context."""

import copy
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from tiny_families import FAMILIES, SPECIAL, VOCAB, build

from mlx_dflash.engine.batch_cache import join, to_batch
from mlx_dflash.target import verify_attention as va
from mlx_dflash.target.adapter import Target
from tiers import fast_first

WIDTHS = [2, 3, 5, 8, 16]


@pytest.fixture
def calls(monkeypatch):
    """Counts the split form's calls (the real function runs)."""
    n = [0]
    real = va.split_attention

    def counting(*args, **kwargs):
        n[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(va, "split_attention", counting)
    return n


@pytest.fixture
def everywhere(monkeypatch):
    """The split form wherever a verify has a prefix (short test contexts included)."""
    monkeypatch.setattr(va, "MIN_SCORES", 0)
    monkeypatch.setattr(va, "MIN_SCORES_HALF", 0)


def test_exp_is_mx_exp_within_an_ulp():
    x = mx.concatenate([-mx.linspace(0, 87, 200_001), -mx.abs(mx.random.normal((100_000,), key=mx.random.key(0)))])
    for m in (0.0, 3.5):  # exp(s - m)
        a, b = mx.exp((x + m) - m), va.exp_shifted(x + m, mx.array(m))
        assert mx.abs(a.view(mx.int32) - b.view(mx.int32)).max().item() <= 1
    tiny = va.exp_shifted(mx.array([-88.0, -1e30, -mx.inf]), mx.array(0.0))  # exp(-87): invisible in a sum >= 1
    assert mx.all(tiny == mx.exp(mx.array(-87.0))).item() and 1.0 + tiny[0].item() == 1.0
    assert va.exp_shifted(mx.array([2.0]), mx.array(2.0)).item() == 1.0


CASES = [  # B, H, G, L, K, D (, value head dim)
    (1, 4, 2, 8, 3000, 96), (2, 4, 4, 3, 1500, 32), (1, 16, 8, 16, 2100, 128), (1, 8, 1, 5, 900, 64),
    (3, 2, 1, 2, 40, 32), (1, 2, 2, 4, 4, 16),  # no prefix at all
    (1, 4, 2, 6, 700, 64, 48),  # values narrower than keys (MLA-style heads)
]


def _mask(kind, B, H, L, K, key):
    if kind == "shared":  # one boolean mask per batch row (padding, windows)
        return mx.random.uniform(shape=(B, 1, L, K), key=key) > 0.3
    if kind == "per-head":
        return mx.random.uniform(shape=(B, H, L, K), key=key) > 0.3
    if kind == "2d":
        return mx.random.uniform(shape=(L, K), key=key) > 0.2
    return kind


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mask", [None, "causal", "shared", "per-head", "2d"])
@pytest.mark.parametrize("sinks", [False, True])
def test_split_equals_mlx_attention(case, mask, sinks, monkeypatch):
    monkeypatch.setattr(va, "CHUNK_ELEMS", 1 << 12)  # many chunks, the last one partial
    B, H, G, L, K, D = case[:6]
    Dv = case[6] if len(case) > 6 else D
    ks = mx.random.split(mx.random.key(sum(case)), 5)
    q, k, v = (mx.random.normal(s, key=kk) for s, kk in zip([(B, H, L, D), (B, G, K, D), (B, G, K, Dv)], ks))
    m = _mask(mask, B, H, L, K, ks[3])
    s = mx.random.normal((H,), key=ks[4]) * 3 if sinks else None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=m, sinks=s)
    got = va.split_attention(q, k, v, D ** -0.5, m, s)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(got - ref).max().item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_split_in_half_types_is_float32_attention_rounded(dtype):
    """Half types are computed in float32 (mlx-cpu runs half products outside
    BLAS): the result is float32 attention on the same inputs, rounded once."""
    B, H, G, L, K, D = 1, 4, 2, 8, 3000, 96
    ks = mx.random.split(mx.random.key(7), 3)
    shapes = [(B, H, L, D), (B, G, K, D), (B, G, K, D)]
    q, k, v = (mx.random.normal(s, key=kk).astype(dtype) for s, kk in zip(shapes, ks))
    exact = mx.fast.scaled_dot_product_attention(*(x.astype(mx.float32) for x in (q, k, v)), scale=D ** -0.5,
                                                 mask="causal")
    got = va.split_attention(q, k, v, D ** -0.5, "causal")
    assert got.dtype == dtype
    assert mx.allclose(got.astype(mx.float32), exact, rtol=1e-2, atol=1e-3).item()
    today = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal")  # half products
    assert mx.abs(got.astype(mx.float32) - exact).max().item() <= mx.abs(today.astype(mx.float32) - exact).max().item()


def test_attention_is_mlx_lms_where_the_split_does_not_pay(calls):
    D = 32
    q8, q1 = mx.random.normal((1, 2, 8, D)), mx.random.normal((1, 2, 1, D))
    long = (mx.random.normal((1, 1, 9000, D)), mx.random.normal((1, 1, 9000, D)))
    short = (long[0][:, :, :200], long[1][:, :, :200])
    additive = mx.where(mx.random.uniform(shape=(8, 9000)) > 0.5, 0.0, -1e9)
    for q, (k, v), mask in [(q1, long, None), (q8, short, "causal"), (q8, long, additive)]:
        got = va.attention(q, k, v, None, D ** -0.5, mask)
        assert mx.array_equal(got, mlx_lm_attention(q, k, v, cache=None, scale=D ** -0.5, mask=mask)).item()
    assert calls[0] == 0
    got = va.attention(q8, *long, None, D ** -0.5, "causal")  # a verify over a long prefix: split
    assert calls[0] == 1
    assert mx.allclose(got, mlx_lm_attention(q8, *long, cache=None, scale=D ** -0.5, mask="causal"), atol=1e-5).item()


def test_pays_by_rows_prefix_and_dtype():
    assert va.pays(8, 16384, 4, mx.float32)
    assert not va.pays(1, 16384, 4, mx.float32)  # a one-row step
    assert not va.pays(va.MAX_ROWS + 1, 16384, 4, mx.float32)  # a prefill chunk
    assert not va.pays(8, va.MIN_SCORES // 4 - 1, 4, mx.float32)
    assert va.pays(8, va.MIN_SCORES // 4, 4, mx.float32)
    assert va.pays(8, va.MIN_SCORES_HALF // 4, 4, mx.bfloat16)


# -- through the target --------------------------------------------------------------

QUANT = {"qwen3:q4": dict(bits=4, group_size=64), "qwen3_next:q4": dict(bits=4, group_size=32),
         "gpt_oss:q8": dict(bits=8, group_size=32)}
NO_SDPA = {"gemma2"}  # attention of its own (soft-capped scores): nothing to split
_models = {}


def model_of(family):
    if family not in _models:
        _models[family] = build(family.split(":")[0], **QUANT.get(family, {}))
    return _models[family]


@pytest.mark.parametrize("family", list(FAMILIES) + list(QUANT))
def test_verify_forward_is_call_on_every_family(family, everywhere, calls):
    model = model_of(family)
    t = Target(model)
    rng = random.Random(3)
    cache = t.make_cache()
    ids = [rng.randrange(SPECIAL, VOCAB) for _ in range(40)]  # past every sliding window
    mx.eval(t(mx.array(ids)[None], cache)[0])
    restore = t.checkpoint(cache)
    capture = [0, t.num_layers - 1]
    for w in WIDTHS:
        x = mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(w)])[None]
        ref, fr = t(x, cache, capture)
        mx.eval(ref, fr)
        restore()
        got, fg = t.verify_forward(x, cache, capture)
        mx.eval(got, fg)
        restore()
        assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item(), (family, w, mx.abs(got - ref).max().item())
        assert mx.allclose(fg, fr, rtol=1e-4, atol=1e-4).item(), (family, w)
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(ref, -1)).item(), (family, w)
    assert (calls[0] > 0) == (family.split(":")[0] not in NO_SDPA), family


def test_verify_forward_in_bfloat16(everywhere, calls):
    model = build("qwen3", dtype=mx.bfloat16)
    t = Target(model)
    cache = t.make_cache()
    rng = random.Random(5)
    mx.eval(t(mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(300)])[None], cache)[0])
    restore = t.checkpoint(cache)
    for w in WIDTHS:
        x = mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(w)])[None]
        ref = t(x, cache)[0].astype(mx.float32)
        restore()
        got = t.verify_forward(x, cache)[0].astype(mx.float32)
        restore()
        scale = mx.abs(ref).max().item()
        assert mx.abs(got - ref).max().item() <= 0.02 * scale, w
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(ref, -1)).item(), w
    assert calls[0] > 0


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_5"])
def test_verify_forward_is_call_on_a_batch(family, everywhere, calls):
    """Rows of different lengths joined as the batch engine joins them (left
    padding: boolean masks per row; sliding windows; recurrent layers)."""
    t = Target(model_of(family))
    rng = random.Random(11)
    batch = None
    for n in (30, 45, 61):
        c = t.make_cache()
        mx.eval(t(mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(n)])[None], c)[0])
        batch = join(batch, to_batch(c))
    restore = t.checkpoint(batch)
    for w in WIDTHS:
        x = mx.array([[rng.randrange(SPECIAL, VOCAB) for _ in range(w)] for _ in range(3)])
        ref = t(x, batch)[0]
        mx.eval(ref)
        restore()
        got = t.verify_forward(x, batch)[0]
        mx.eval(got)
        restore()
        assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item(), (family, w, mx.abs(got - ref).max().item())
    assert calls[0] > 0


def test_quantized_kv_cache_is_mlx_lms_own(everywhere, calls):
    """A quantized KV cache (kv_bits) keeps mlx-lm's quantized products: the same logits, bit for bit."""
    t = Target(model_of("qwen3"))
    cache = t.make_cache()
    mx.eval(t(mx.array(list(range(SPECIAL, SPECIAL + 80)))[None], cache)[0])
    cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
    restore = t.checkpoint(cache)
    x = mx.array([[9, 10, 11, 12, 13]])
    ref = t(x, cache)[0]
    mx.eval(ref)
    restore()
    assert mx.array_equal(t.verify_forward(x, cache)[0], ref).item()
    assert calls[0] == 0


def test_verify_forward_runs_a_subclass_call(everywhere, calls):
    """verify_forward is the target's own __call__ in verify mode, so a subclass
    that wraps __call__ (distributed.ShardedTarget: capture hand-over, counts) keeps its part."""
    class Counting(Target):
        n = 0

        def __call__(self, tokens, cache, capture=()):
            self.n += 1
            return super().__call__(tokens, cache, capture)

    t = Counting(model_of("qwen3"))
    cache = t.make_cache()
    t(mx.array([list(range(SPECIAL, SPECIAL + 50))]), cache)
    logits, feats = t.verify_forward(mx.array([[7, 8, 9]]), cache, [1])
    mx.eval(logits, feats)
    assert t.n == 2 and calls[0] > 0 and feats.shape == (1, 3, t.hidden_size)
    split = calls[0]
    mx.eval(t(mx.array([[10, 11]]), cache)[0])  # and after it, __call__ is mlx-lm's attention again
    assert calls[0] == split


def _copy_cache(cache):
    """An independent copy of a prompt cache (arrays are immutable; the lists holding them are not)."""
    out = []
    for c in cache:
        d = copy.copy(c)
        d.__dict__.update({k: list(v) for k, v in c.__dict__.items() if isinstance(v, list)})
        out.append(d)
    return out


def speculative_greedy(t: Target, cache, first: int, ref, seed: int):
    """Greedy speculative decoding whose verifies are `verify_forward`: each
    cycle's drafts are the reference's next tokens for a random-length prefix,
    then wrong (every acceptance length, rollback after each); what the target
    accepts and its bonus tokens are emitted. Each verify's logits are checked
    against today's verify (`__call__`) on the same cache: greedy equality alone
    would not see a small error over a long context.
    Returns the tokens emitted after `first`."""
    rng = random.Random(seed)
    out, anchor = [], first
    while len(out) < len(ref):
        w = WIDTHS[rng.randrange(len(WIDTHS))]
        right = rng.randrange(w)
        drafts = list(ref[len(out): len(out) + right])
        drafts += [(ref[len(out) + i] + 1 + rng.randrange(VOCAB - SPECIAL - 1)) % (VOCAB - SPECIAL) + SPECIAL
                   if len(out) + i < len(ref) else SPECIAL for i in range(len(drafts), w - 1)]
        x = mx.array([anchor] + drafts)[None]
        restore = t.checkpoint(cache)
        today = t(x, cache)[0]  # today's verify, on the same cache
        mx.eval(today)
        restore()
        logits, _ = t.verify_forward(x, cache)
        assert mx.allclose(logits, today, rtol=1e-4, atol=1e-4).item(), mx.abs(logits - today).max().item()
        tgt = mx.argmax(logits[0], axis=-1).tolist()
        a = 0
        while a < w - 1 and drafts[a] == tgt[a]:
            a += 1
        t.trim(cache, w - 1 - a)
        out += tgt[: a + 1]
        anchor = tgt[a]
    return out[: len(ref)]


LONG = [("qwen3", 8192), ("gemma3_text", 8192), ("qwen3_5", 8192),
        pytest.param("qwen3", 16384, marks=pytest.mark.slow), pytest.param("qwen3", 32768, marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,context", fast_first(LONG, unpack=True))
def test_greedy_equals_mlx_lm_at_long_context(family, context, calls):
    """At the shipped thresholds (no forcing): a real prompt of `context` tokens,
    prefilled once; mlx-lm's generate_step and the speculative loop continue
    from copies of that cache."""
    model = build(family, num_hidden_layers=2)  # one sliding / linear and one full attention layer where mixed
    t = Target(model)
    rng = random.Random(context)
    prompt = [rng.randrange(SPECIAL, VOCAB) for _ in range(context)]
    cache = t.make_cache()
    for a in range(0, context - 1, 2048):
        mx.eval(model(mx.array(prompt[a: min(a + 2048, context - 1)])[None], cache=cache))
    mine = _copy_cache(cache)
    n = 40
    ref = [int(tok) for tok, _ in generate_step(mx.array(prompt[-1:]), model, prompt_cache=cache, max_tokens=n)]
    first = mx.argmax(t(mx.array(prompt[-1:])[None], mine)[0][0, -1]).item()
    assert first == ref[0]
    got = speculative_greedy(t, mine, first, ref[1:], seed=context)
    assert [first] + got == ref
    assert calls[0] > 0  # the verifies ran the split form
