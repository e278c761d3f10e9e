"""Model manager, loading: load_model's drafter choice stays lossless, block
sizes fitted to the drafter, drafter quantization, the activation-dtype guard and
the compute-dtype setting (the `world` of models: tests/model_world.py)."""

import json

import mlx.core as mx
import pytest
from model_world import by_id

from mlx_dflash import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.drafter_precision import safe_activation_dtype, set_activation_dtype
from mlx_dflash.models.drafter_precision import param_bytes
from mlx_dflash.settings.schema import SettingsError
from mlx_dflash.target.adapter import Target


def _greedy(lm, prompt, **kw):
    args = {**lm.generation_kwargs(), "max_tokens": 24, **kw}
    return generate(lm.model, lm.tokenizer, prompt, lm.drafter, **args)


@pytest.mark.slow
def test_load_model_picks_drafter_and_stays_lossless(world):
    store = world["store"]
    lm = load_model(None, store)
    assert lm.id == "embedded/target" and lm.drafter_id == "embedded/dflash2" and lm.drafter.version == 2
    assert lm.settings.block_size == 5 and lm.notices == []
    plain = _greedy(lm, "def main():", verify_mode="off")
    assert _greedy(lm, "def main():").token_ids == plain.token_ids
    store.set_model("embedded/target", drafter="org/v1-drafter", block_size=7, guard=False)
    lm1 = load_model("embedded/target", store)
    assert lm1.drafter_id == "org/v1-drafter" and lm1.drafter.version == 1
    r = _greedy(lm1, "def main():")
    assert r.token_ids == plain.token_ids and r.stats.max_width == 7
    store.set_model("embedded/target", **{"dflash.enabled": False})
    off = load_model("embedded/target", store)
    assert off.drafter is None and off.generation_kwargs()["verify_mode"] == "off"
    with pytest.raises(SettingsError, match="'embedded/dflash2' is a DFlash 2 drafter, not a chat model"):
        load_model("embedded/dflash2", store)


def test_load_model_fits_block_size_from_a_hand_edited_file(world):
    store = world["store"]
    raw = json.loads(store.path.read_text())
    raw["models"]["embedded/target"] = {"block_size": 12}
    store.path.write_text(json.dumps(raw))
    lm = load_model("embedded/target", store)
    assert lm.settings.block_size == 8 and "above the drafter's trained block size 8" in lm.notices[0]
    assert _greedy(lm, "x = 1").stats.max_width == 8


def _draft_hidden(lm, feats):
    """The drafter's output on a fixed block and fixed context features."""
    t = Target(lm.model)
    d = lm.drafter
    block = mx.array([[5] + [d.config.mask_token_id] * 4])
    out = d(t.embed(block), feats, d.make_cache())
    mx.eval(out)
    return out.astype(mx.float32)


def _feats(lm, scale=1.0):
    c = lm.drafter.config
    return mx.random.normal((1, 6, len(c.target_layer_ids) * c.hidden_size), key=mx.random.key(0)) * scale


def _cos(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return (a @ b / (mx.linalg.norm(a) * mx.linalg.norm(b))).item()


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_quantized_drafter(world, bits, group):
    store = world["store"]
    ref = load_model("embedded/target", store)
    store.set_model("embedded/target", **{"drafter.quant_bits": bits, "drafter.quant_group_size": group})
    q = load_model("embedded/target", store)
    from mlx.nn import QuantizedLinear

    assert isinstance(q.drafter.layers[0].mlp.up_proj, QuantizedLinear)
    assert q.drafter.layers[0].mlp.up_proj.bits == bits
    # weights shrink at least as the bit width does against float32 (scales included)
    assert param_bytes(q.drafter) < param_bytes(ref.drafter) * (bits + 8) / 32
    f = _feats(ref)
    assert _cos(_draft_hidden(q, f), _draft_hidden(ref, f)) > (0.9 if bits == 4 else 0.99)
    plain = _greedy(ref, "import os", verify_mode="off")
    assert _greedy(q, "import os").token_ids == plain.token_ids  # still lossless


def test_activation_dtype_guard_rule():
    cpu = mx.default_device() == mx.cpu or not mx.metal.is_available()
    for target in (mx.bfloat16, mx.float32):
        dt, why = safe_activation_dtype("float16", target)
        assert dt == target and "overflow" in why and "\n" not in why
    assert safe_activation_dtype("auto", mx.bfloat16) == (mx.bfloat16, None)
    assert safe_activation_dtype("float32", mx.bfloat16) == (mx.float32, None)
    assert safe_activation_dtype("bfloat16", mx.float32) == (mx.bfloat16, None)
    dt, why = safe_activation_dtype("float16", mx.float16)
    assert (dt, why is None) == (mx.float16, not cpu)


@pytest.mark.slow
def test_activation_dtype_guard_keeps_drafts_alive(world):
    """Target features beyond float16's range (bf16 targets produce them) turn a
    float16 drafter's output into inf/NaN: no draft is ever accepted. The guard
    keeps the target's precision instead."""
    store = world["store"]
    ref = load_model("embedded/target", store)
    big = _feats(ref, scale=1e5)
    want = _draft_hidden(ref, big)
    assert mx.isfinite(want).all().item()

    unsafe = load_model("embedded/target", store)
    set_activation_dtype(unsafe.drafter, mx.float16)  # bypasses the guard
    assert not mx.isfinite(_draft_hidden(unsafe, big)).all().item()  # the failure being guarded against

    store.set_model("embedded/target", **{"drafter.activation_dtype": "float16", "drafter.quant_bits": 4})
    guarded = load_model("embedded/target", store)
    assert any("float16" in n and "overflow" in n for n in guarded.notices)
    got = _draft_hidden(guarded, big)
    assert mx.isfinite(got).all().item() and _cos(got, want) > 0.9
    plain = _greedy(ref, "for i in", verify_mode="off")
    assert _greedy(guarded, "for i in").token_ids == plain.token_ids


def test_compute_dtype_setting(world, monkeypatch):
    """`dtype` (setting, or load_model's argument over it) is the target's compute
    dtype; the memory estimate follows it."""
    monkeypatch.delenv("MLX_DFLASH_DTYPE", raising=False)
    store = world["store"]
    full = by_id(store)["flat-target"].est_memory_bytes  # the test pair is stored in float32
    store.set_model("flat-target", dtype="bfloat16")
    assert by_id(store)["flat-target"].est_memory_bytes == full // 2
    lm = load_model("flat-target", store)
    assert lm.model.model.norm.weight.dtype == mx.bfloat16 and lm.settings.dtype == "bfloat16"
    over = load_model("flat-target", store, dtype="float32")
    assert over.model.model.norm.weight.dtype == mx.float32
    with pytest.raises(SettingsError, match="unknown dtype 'f8'"):
        store.set_model("flat-target", dtype="f8")


@pytest.mark.slow
def test_activation_dtype_is_applied(world):
    store = world["store"]
    store.set_model("embedded/target", **{"drafter.activation_dtype": "bfloat16"})
    lm = load_model("embedded/target", store)
    assert lm.drafter.norm.weight.dtype == mx.bfloat16 and lm.notices == []
    f = _feats(lm)
    t = Target(lm.model)
    h = lm.drafter(t.embed(mx.array([[5, lm.drafter.config.mask_token_id]])), f, lm.drafter.make_cache())
    assert h.dtype == mx.bfloat16
    assert _greedy(lm, "print(").token_ids == _greedy(lm, "print(", verify_mode="off").token_ids

