"""RoPE tables shared within a forward (target/rope_tables.py):
1. a rope module's shared forward is its own forward bit for bit, for every rope
   class mlx-lm builds (default, traditional, partial dims, yarn, llama3, linear,
   dynamic), in float32 and bfloat16, at scalar and per-row offsets, including a
   second call at the same positions (the one that reads the table);
2. a verify (Target.verify_forward) builds one table per distinct rope of the
   model and equals __call__ bit for bit where the split attention is not used;
3. the drafter's forward with shared tables is the same as without, bit for bit."""

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope
from tiny_families import FAMILIES, SPECIAL, VOCAB, build

from mlx_dflash.target import rope_tables as rt
from mlx_dflash.target.adapter import Target

ROPES = {
    "default": lambda: nn.RoPE(64, base=10000.0),
    "traditional": lambda: nn.RoPE(64, traditional=True, base=10000.0),
    "partial": lambda: nn.RoPE(48, base=10000.0),
    "partial_traditional": lambda: nn.RoPE(48, traditional=True, base=500000.0),
    "scaled": lambda: nn.RoPE(64, base=10000.0, scale=0.25),
    "yarn": lambda: initialize_rope(64, 1e6, False, {"rope_type": "yarn", "factor": 16.0,
                                                   "original_max_position_embeddings": 2048}, 32768),
    "llama3": lambda: initialize_rope(64, 5e5, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}, 131072),
    "linear": lambda: initialize_rope(64, 10000.0, False, {"type": "linear", "factor": 2.0}, 4096),
    "dynamic": lambda: initialize_rope(64, 10000.0, False, {"type": "dynamic", "factor": 2.0}, 16),
}


@pytest.fixture
def tables_built(monkeypatch):
    """Counts the tables computed (the real function runs)."""
    n = [0]
    real = rt._table

    def counting(*args):
        n[0] += 1
        return real(*args)

    monkeypatch.setattr(rt, "_table", counting)
    return n


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("kind", list(ROPES))
def test_shared_rope_is_the_modules_own_bit_for_bit(kind, dtype, tables_built):
    rope = ROPES[kind]()
    shared = rt.shared(rope)
    assert shared is not None
    mx.random.seed(1)
    cases = [(1, 0), (1, 37), (2, 1500), (2, mx.array([3, 11]))]
    for B, offset in cases[:3] if kind == "dynamic" else cases:  # (mlx-lm's dynamic rope takes int offsets)
        q = mx.random.normal((B, 4, 5, 64)).astype(dtype)
        k = mx.random.normal((B, 2, 5, 64)).astype(dtype)
        want = [rope(q, offset=offset), rope(k, offset=offset)]
        before = tables_built[0]
        with rt.Tables():
            got = [shared(q, offset=offset), shared(k, offset=offset)]
            mx.eval(got)
        assert tables_built[0] - before == 1  # the second call (the keys) read the queries' table
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert mx.array_equal(g, w).item(), (kind, dtype, offset, mx.abs(g - w).max().item())
    # outside a forward's Tables it is the module's forward as it is
    assert mx.array_equal(shared(q, offset=5), rope(q, offset=5)).item()


def test_layers_with_equal_frequencies_share_a_table(tables_built):
    """Each layer's rope module holds its own frequency array; equal contents share one table."""
    spec = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    a, b = (rt.shared(initialize_rope(64, 1e6, False, spec, 8192)) for _ in range(2))
    c = rt.shared(initialize_rope(64, 1e4, False, spec, 8192))  # other frequencies
    x = mx.random.normal((1, 2, 4, 64))
    with rt.Tables():
        mx.eval(a(x, offset=9), b(x, offset=9), c(x, offset=9), a(x, offset=10))
    assert tables_built[0] == 3


NO_SDPA = {"gemma2"}  # attention of its own: the verify runs its modules as they are


@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_shares_tables_and_equals_call(family, tables_built):
    """At a short context (no split attention) the verify is __call__ bit for bit,
    with a table per distinct rope of the model instead of one per call."""
    model = build(family)
    t = Target(model)
    rng = random.Random(2)
    cache = t.make_cache()
    mx.eval(t(mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(20)])[None], cache)[0])
    restore = t.checkpoint(cache)
    ropes = {id(m) for _, m in model.named_modules() if rt.shared(m) is not None}
    for w in (2, 5, 8):
        x = mx.array([rng.randrange(SPECIAL, VOCAB) for _ in range(w)])[None]
        ref, fr = t(x, cache, [0])
        mx.eval(ref, fr)
        restore()
        before = tables_built[0]
        got, fg = t.verify_forward(x, cache, [0])
        mx.eval(got, fg)
        restore()
        assert mx.array_equal(got, ref).item(), (family, w, mx.abs(got - ref).max().item())
        assert mx.array_equal(fg, fr).item(), (family, w)
        if ropes and family not in NO_SDPA:
            n = tables_built[0] - before  # (fewer than one per layer: layers share)
            assert (n == 1) if len(ropes) == 1 else (1 <= n < len(ropes)), (family, w, n, len(ropes))


@pytest.mark.parametrize("variant", ["plain", "rope_yarn", "rope_dynamic", "sliding_default_causal",
                                     "published_dflash2_style"])
def test_drafter_forward_is_the_same_with_shared_tables(variant, monkeypatch, tables_built):
    from reference_configs import VARIANTS, base_config

    from mlx_dflash.drafting.drafter import Drafter
    from mlx_dflash.drafting.drafter_config import DrafterConfig

    cfg = DrafterConfig.from_dict(base_config(2, **VARIANTS[variant]))
    mx.random.seed(0)
    d = Drafter(cfg)
    mx.eval(d.parameters())
    H, taps = cfg.hidden_size, len(cfg.target_layer_ids)
    emb = mx.random.normal((1, 4, H))
    outs = []
    for on in (True, False):
        monkeypatch.setattr(rt, "on_cpu", lambda on=on: on)
        cache = d.make_cache()
        h1 = d(emb, mx.random.normal((1, 9, taps * H), key=mx.random.key(3)), cache)
        h2 = d(emb, mx.random.normal((1, 3, taps * H), key=mx.random.key(4)), cache)
        outs.append((h1, h2))
        mx.eval(outs[-1])
        if on:  # the context rows' table and the block's, each shared by the layers
            assert 2 <= tables_built[0] <= 4, tables_built[0]
    for a, b in zip(*outs):
        assert mx.array_equal(a, b).item(), variant
