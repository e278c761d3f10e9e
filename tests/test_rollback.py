"""Rollback after a verify, per cache kind (mlx_dflash/target/rollback.py): a cache
that ran L tokens and dropped the last n must behave like one that only ever
ran the L-n accepted tokens: same recurrent states, same next logits, across
many cycles so every sliding window wraps."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from tiny_families import build

from mlx_dflash.target.rollback import RollbackError, leaves
from mlx_dflash.target.adapter import Target
from tiers import fast_first

# one family per cache mix: KV, sliding + KV, recurrent + KV, short-conv + KV,
# Mamba2 + KV (and layers without a cache), CacheList(recurrent, KV), 4-bit hybrid
FAMILIES = ["qwen3", "gemma3_text", "gpt_oss", "muse_glimmer", "gemma4_text", "qwen3_next", "qwen3_5", "lfm2",
            "nemotron_h", "granitemoehybrid", "falcon_h1"]


def _states(cache):
    out = []
    for c in cache:
        for x in leaves(c):
            if hasattr(x, "cache") and isinstance(x.cache, list):  # recurrent state arrays
                out += [a for a in x.cache if a is not None]
    return out


def _close(a, b, tol=2e-4):
    return mx.allclose(a, b, atol=tol, rtol=tol).item()


def _run_cycles(model, t, make_a, make_b, seed, cycles=9, width=5, tol=2e-4):
    """A: prefill, then each cycle verifies `width` tokens and trims a random n.
    B: the same prefill, then only the accepted tokens. Next-step logits and
    recurrent states must agree after every cycle."""
    rng = random.Random(seed)
    a, b = make_a(), make_b()
    prompt = mx.array([[rng.randrange(4, 512) for _ in range(9)]])
    t(prompt, a)
    t(prompt, b)
    trimmed = 0
    for _ in range(cycles):
        block = [rng.randrange(4, 512) for _ in range(width)]
        t(mx.array([block]), a)
        n = rng.randrange(width + 1)  # 0..width: whole block kept .. whole block dropped
        assert t.can_trim(a, n)
        t.trim(a, n)
        trimmed += n
        if width - n:
            t(mx.array([block[: width - n]]), b)
        for x, y in zip(_states(a), _states(b)):
            assert _close(x, y, tol), "recurrent state differs after rollback"
        probe = mx.array([[rng.randrange(4, 512)]])
        la, _ = t(probe, a)
        lb, _ = t(probe, b)
        assert _close(la, lb, tol), "next logits differ after rollback"
        assert mx.argmax(la, -1).item() == mx.argmax(lb, -1).item()
    assert trimmed > 0


@pytest.mark.parametrize("family", fast_first(FAMILIES))
def test_trim_equals_never_having_run_the_rejected_tokens(family):
    model = build(family)
    t = Target(model)
    _run_cycles(model, t, t.make_cache, t.make_cache, seed=len(family))


def test_quantized_model_with_hybrid_cache():
    model = build("qwen3_next", bits=4, group_size=32)
    t = Target(model)
    _run_cycles(model, t, t.make_cache, t.make_cache, seed=3)


def test_quantized_kv_cache():
    model = build("qwen3")
    t = Target(model)

    def make():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    assert t.can_trim(make())
    # A's kept rows come from a 5-token forward, B's from shorter ones: a last-bit
    # difference can move an 8-bit quantized value one step (~1e-3 in the logits)
    _run_cycles(model, t, make, make, seed=5, tol=1e-2)


def test_mixed_kinds_per_layer():
    """A plain KV layer next to sliding-window layers of different sizes."""
    model = build("qwen3")
    t = Target(model)

    def make():
        return [KVCache(), RotatingKVCache(max_size=5), RotatingKVCache(max_size=7, keep=2), KVCache()]

    _run_cycles(model, t, make, make, seed=7)


def test_wrapped_window_after_a_one_token_step_is_refused():
    model = build("gemma3_text")
    t = Target(model)
    c = t.make_cache()
    t(mx.arange(4, 20)[None], c)  # 16 tokens: windows of 6 wrapped
    assert t.can_trim(c, 3)  # after a multi-token forward: rows kept in order
    t(mx.array([[7]]), c)  # in place: the oldest row is overwritten
    assert not t.can_trim(c, 1)
    with pytest.raises(RollbackError):
        t.trim(c, 1)
    assert t.can_trim(c)  # the kind itself rolls back after a verify


def test_recurrent_state_rolls_back_only_the_last_forward():
    model = build("qwen3_next")
    t = Target(model)
    c = t.make_cache()
    t(mx.arange(4, 14)[None], c)
    t(mx.arange(20, 25)[None], c)
    assert t.can_trim(c, 5) and not t.can_trim(c, 6)
    other = t.make_cache()
    assert not t.can_trim(other, 1)  # no forward recorded for this cache
    t.trim(c, 2)
    assert not t.can_trim(c, 1)  # the record is spent


def test_model_instance_is_left_as_it_was():
    """Capture and rollback swap recorders in only during a forward."""
    from mlx.utils import tree_flatten

    model = build("falcon_h1")
    before = [(k, id(v)) for k, v in tree_flatten(model.parameters())]
    layers = list(model.layers)
    t = Target(model)
    c = t.make_cache()
    t(mx.arange(4, 12)[None], c, [0, 2])
    t.trim(c, 3)
    assert [(k, id(v)) for k, v in tree_flatten(model.parameters())] == before
    assert all(x is y for x, y in zip(model.layers, layers))
    assert not any("mamba" in vars(l) for l in model.layers)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "falcon_h1"])
def test_checkpoint_restores_after_any_steps(family):
    """Timing probes (calibration) run 1-token steps and must leave the cache as it was."""
    model = build(family)
    t = Target(model)
    a, b = t.make_cache(), t.make_cache()
    for c in (a, b):
        t(mx.arange(4, 20)[None], c)  # windows wrapped
        for tok in (50, 51):  # a full window rotating in place
            t(mx.array([[tok]]), c)
    restore = t.checkpoint(a)
    for _ in range(2):  # restore() can be used again and again
        for tok in [5, 6, 7, 8, 9, 10, 11]:
            t(mx.array([[tok]]), a)
        t(mx.arange(30, 34)[None], a)
        restore()
    x = mx.array([[42, 43]])
    la, _ = t(x, a)
    lb, _ = t(x, b)
    assert mx.array_equal(la, lb)


def test_concatenate_cache_drops_its_rows():
    from mlx_lm.models.cache import ConcatenateKVCache

    model = build("qwen3")
    t = Target(model)

    def make():
        return [ConcatenateKVCache() for _ in model.layers]

    _run_cycles(model, t, make, make, seed=11)


def test_long_forward_keeps_no_replay_inputs():
    """A prefill chunk longer than a verify holds no activations for a rollback:
    it can only be undone whole."""
    from mlx_dflash.target.adapter import MAX_REPLAY

    t = Target(build("qwen3_next"))
    c = t.make_cache()
    t(mx.arange(4, 4 + MAX_REPLAY + 1)[None] % 512, c)
    assert not t._rec.calls
    assert t.can_trim(c, MAX_REPLAY + 1) and not t.can_trim(c, 1)


@pytest.mark.parametrize("family", ["gemma4_text", "falcon_h1", "gpt_oss"])
def test_features_are_the_captured_layer_outputs(family):
    """Target.features (training: no cache, stops after the last tap) gives the
    same rows as the decode-time capture."""
    t = Target(build(family))
    x = mx.arange(4, 20)[None]
    _, feats = t(x, t.make_cache(), [0, 2])
    assert _close(t.features(x, [0, 2]), feats, 1e-5)


RECURRENT = ["qwen3_next", "qwen3_5", "lfm2", "nemotron_h", "falcon_h1", "granitemoehybrid"]


@pytest.mark.parametrize("family", fast_first(RECURRENT))
def test_recurrent_rollback_is_a_selection_with_the_same_bits(family, monkeypatch):
    """Gated-delta, Mamba2 and short-conv layers: after a verify the state at any
    kept length is selected from what the verify kept (no mixer is run again)
    and is the state of a cache that only ever ran the kept rows (up to the last
    bits a 1-row and an L-row matmul may differ by), with the same next logits."""
    from mlx_dflash.target.rollback import Mixer

    def no_replay(*a, **k):
        raise AssertionError("a recurrent mixer was run again")

    monkeypatch.setattr(Mixer, "play", no_replay)
    t = Target(build(family))
    rng = random.Random(family)
    a, b = t.make_cache(), t.make_cache()  # first from empty states (a short prompt rolled back)
    t(mx.arange(4, 10)[None], a)
    t.trim(a, 2)
    t(mx.arange(4, 8)[None], b)
    assert all(_close(x, y, 1e-5) for x, y in zip(_states(a), _states(b)))
    a, b = t.make_cache(), t.make_cache()
    prompt = mx.array([[rng.randrange(4, 512) for _ in range(9)]])
    t(prompt, a)
    t(prompt, b)
    for width in (2, 5, 8, 16, 5, 8):
        block = [rng.randrange(4, 512) for _ in range(width)]
        keep = rng.randrange(1, width)
        t(mx.array([block]), a)
        assert t._rec.calls
        t.trim(a, width - keep)
        t(mx.array([block[:keep]]), b)
        sa, sb = _states(a), _states(b)
        assert sa and len(sa) == len(sb)
        assert all(_close(x, y, 1e-5) for x, y in zip(sa, sb)), (family, width, keep)
        nxt = mx.array([[rng.randrange(4, 512)]])
        la, lb = t(nxt, a)[0], t(nxt, b)[0]
        assert _close(la, lb, 1e-4) and mx.argmax(la, -1).item() == mx.argmax(lb, -1).item()


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "lfm2"])
def test_replay_where_no_selection_applies(family, monkeypatch):
    """Where a state cannot be selected (the fused Metal gated-delta kernel, padded
    batches) the mixer runs again on the kept rows, its projections and conv
    outputs handed back from the verify: the same states as never having run
    the rejected rows."""
    from mlx_dflash.target.rollback import Call

    monkeypatch.setattr(Call, "select", lambda self, keep: False)
    model = build(family)
    t = Target(model)
    _run_cycles(model, t, t.make_cache, t.make_cache, seed=13)
