"""`dtype auto` (mlx_dflash/models/dtype_choice.py): the compute dtype a model runs in
where nothing else is asked for. On mlx-cpu the faster of the checkpoint's dtype
and float32, measured once per model and machine (cached), float32 only where it
fits in memory; on Metal the checkpoint's. Greedy output stays token for token
mlx-lm's run at the dtype actually used (the reference runs the same model object).
Also `drafter.quant_bits auto`."""

import mlx.core as mx
import mlx_lm
import pytest

from mlx_dflash.models import dtype_choice
from mlx_dflash import generate
from mlx_dflash.models.drafter_precision import resolve_quant_bits
from mlx_dflash.models.loader import model_dtype
from mlx_dflash.models.manager import load_model

PROMPT = "Natalia sold clips to 48 of her friends in April"


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("MLX_DFLASH_DTYPE", raising=False)


def test_requested_reads_the_setting_then_the_environment(no_env, monkeypatch):
    assert dtype_choice.requested("auto") == ("auto", "setting")
    assert dtype_choice.requested(None) == ("checkpoint", "default")  # the library's load(): as stored
    assert dtype_choice.requested("fp32") == ("float32", "setting")
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "bf16")
    assert dtype_choice.requested("auto") == ("bfloat16", "$MLX_DFLASH_DTYPE")
    assert dtype_choice.requested("float32") == ("float32", "setting")  # a model's own setting wins
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "auto")
    assert dtype_choice.requested(None) == ("auto", "$MLX_DFLASH_DTYPE")
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "float64")
    with pytest.raises(ValueError, match="unknown dtype 'float64'.*auto, checkpoint, float32"):
        dtype_choice.requested("auto")


@pytest.fixture
def bf16_world(world):
    """The model world with its embedded pair stored in bfloat16 (as the real one is)."""
    for folder in ("target", "dflash2"):
        for f in (world["emb"] / folder).glob("*.safetensors"):
            w = mx.load(str(f))
            mx.save_safetensors(str(f), {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                                         for k, v in w.items()})
    return world


def _measured(monkeypatch, ckpt_ms, f32_ms):
    calls = []

    def fake(model, dtypes, **kw):
        calls.append([dtype_choice.dtype_name(d) for d in dtypes])
        return {dtype_choice.dtype_name(dtypes[0]): ckpt_ms, "float32": f32_ms}

    monkeypatch.setattr(dtype_choice, "step_times", fake)
    monkeypatch.setattr(dtype_choice, "on_cpu", lambda: True)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_auto_takes_the_faster_measured_once_and_stays_lossless(bf16_world, no_env, monkeypatch, faster):
    """The embedded target is a bfloat16 checkpoint. Which dtype is faster is made
    up here (the real timing is machine-dependent); the rest is real: the cast,
    the cache, and greedy output equal to mlx-lm's at the dtype in use."""
    calls = _measured(monkeypatch, 10.0, 5.0 if faster == "float32" else 12.0)
    lm = load_model("embedded/target", bf16_world["store"])
    c = lm.dtype
    assert calls == [["bfloat16", "float32"]] and c.fresh and c.setting == "auto" and c.checkpoint == "bfloat16"
    assert c.name == faster == model_dtype(lm.model) == model_dtype(lm.drafter)
    assert "measured" in c.why and "\n" not in c.why
    assert (lm.dtype_notice() is not None) == (faster == "float32")  # said once, where it changed the dtype
    ref = mlx_lm.generate(lm.model, lm.tokenizer, PROMPT, max_tokens=24)  # mlx-lm at the same dtype
    r = generate(lm.model, lm.tokenizer, PROMPT, lm.drafter, **{**lm.generation_kwargs(), "max_tokens": 24})
    assert r.text == ref
    # the second load reads the cache: no measurement, the same choice, nothing said
    again = load_model("embedded/target", bf16_world["store"])
    assert len(calls) == 1 and not again.dtype.fresh and again.dtype.name == faster
    assert again.dtype_notice() is None and model_dtype(again.model) == faster


def test_auto_keeps_the_checkpoint_where_float32_does_not_fit(bf16_world, no_env, monkeypatch):
    calls = _measured(monkeypatch, 10.0, 1.0)
    monkeypatch.setattr(dtype_choice, "available_memory", lambda: 1000)
    lm = load_model("embedded/target", bf16_world["store"])
    assert calls == [] and lm.dtype.name == "bfloat16" == model_dtype(lm.model)
    assert "float32 would need" in lm.dtype.why


def test_auto_on_metal_keeps_the_checkpoint_and_explicit_settings_win(bf16_world, no_env, monkeypatch):
    calls = _measured(monkeypatch, 10.0, 1.0)
    monkeypatch.setattr(dtype_choice, "on_cpu", lambda: False)
    lm = load_model("embedded/target", bf16_world["store"])
    assert calls == [] and lm.dtype.name == "bfloat16" and "Metal" in lm.dtype.why
    bf16_world["store"].set_model("embedded/target", dtype="checkpoint")
    monkeypatch.setattr(dtype_choice, "on_cpu", lambda: True)
    lm = load_model("embedded/target", bf16_world["store"])
    assert calls == [] and model_dtype(lm.model) == "bfloat16" and lm.dtype.setting == "checkpoint"
    lm = load_model("embedded/target", bf16_world["store"], dtype="float32")
    assert model_dtype(lm.model) == "float32" and lm.dtype.why == "from the setting"


def test_step_times_measures_each_dtype_and_choose_restores_the_checkpoint(no_env, monkeypatch):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                           rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=1e4, tie_word_embeddings=True)
    m = qwen3.Model(args)
    dtype_choice.cast(m, mx.bfloat16)
    monkeypatch.setattr(dtype_choice, "on_cpu", lambda: True)
    c = dtype_choice.choose(m, "auto", "setting", path=None)  # no folder: measured, not cached
    assert c.fresh and set(c.measured) == {"checkpoint_ms", "float32_ms"} and all(v > 0 for v in c.measured.values())
    assert c.name in ("bfloat16", "float32") and dtype_choice.param_dtype(m) == mx.bfloat16


def test_drafter_quant_bits_auto(monkeypatch):
    from mlx_dflash.models import drafter_precision

    monkeypatch.setattr(drafter_precision, "on_cpu", lambda: True)
    assert resolve_quant_bits("auto")[0] is None and "mlx-cpu" in resolve_quant_bits("auto")[1]
    monkeypatch.setattr(drafter_precision, "on_cpu", lambda: False)
    assert resolve_quant_bits("auto")[0] == 4
    assert resolve_quant_bits(8) == (8, "from the setting") and resolve_quant_bits(None)[0] is None
