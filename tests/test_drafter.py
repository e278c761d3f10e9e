"""DFlash 1 / DFlash 2 drafters: identity init, checkpoints, validation, accounting."""

import json
import shutil

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_dflash import generate
from mlx_dflash.models.loader import load
from mlx_dflash.drafting.drafter import Drafter, load_drafter, param_counts, save_drafter, validate
from mlx_dflash.drafting.drafter_config import ARCH_V2, DrafterConfig, DrafterError
from mlx_dflash.platform.hub import HubError
from mlx_dflash.target.adapter import Target

PROMPTS = ["def fibonacci(n):", "Janet's ducks lay 16 eggs per day.", "import os\n", "class A:", "The answer is"]


def _v2_from_v1(d1: Drafter) -> Drafter:
    c = DrafterConfig(**{**d1.config.__dict__, "version": 2, "selector_rank": 32})
    d2 = Drafter(c)
    d2.load_weights(list(tree_flatten(d1.parameters())), strict=False)
    mx.eval(d2.parameters())
    return d2


@pytest.mark.slow
def test_identity_initialised_dflash2_equals_dflash1(pairs):
    d = pairs("qwen3", version=1, layers=4)
    model, tok, d1 = load(str(d / "target"), str(d / "drafter"))
    d2 = _v2_from_v1(d1)
    t = Target(model)
    feats = t(mx.array([[5, 9, 33, 7, 100, 3]]), t.make_cache(), d1.config.target_layer_ids)[1]
    block = t.embed(mx.array([[11, 3, 3, 3, 3]]))
    h1 = d1(block, feats, d1.make_cache())
    h2 = d2(block, feats, d2.make_cache())
    assert mx.array_equal(h1, h2).item()
    for prompt in PROMPTS:
        for w in (3, 5, 8):
            # guard=False: at w = 5 the default guard would decide per drafter from
            # each one's own measured costs, so the two runs could draft differently
            r1 = generate(model, tok, prompt, d1, max_tokens=20, block_size=w, guard=False)
            r2 = generate(model, tok, prompt, d2, max_tokens=20, block_size=w, guard=False)
            assert r1.token_ids == r2.token_ids and r1.from_draft == r2.from_draft
            assert r1.stats.accepted == r2.stats.accepted


@pytest.mark.slow
def test_dflash2_greedy_equals_mlx_lm(pairs):
    d = pairs("qwen3", version=2)
    model, tok, d2 = load(str(d / "target"), str(d / "drafter"))
    assert d2.version == 2
    # a selector with a non-zero successor side picks paths other than top-1
    sel = d2.candidate_selector
    sel.successor_projection.weight = mx.random.normal(sel.successor_projection.weight.shape, key=mx.random.key(3))
    for prompt in PROMPTS:
        ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=20)]
        for w in (2, 5, 8, 16):
            assert generate(model, tok, prompt, d2, max_tokens=20, block_size=w).token_ids == ref


@pytest.mark.slow
def test_dflash2_sampling_uses_selector_q(pairs):
    d = pairs("qwen3", version=2)
    model, tok, d2 = load(str(d / "target"), str(d / "drafter"))
    # guard=False: the default guard may find drafting cannot pay on this machine and never draft
    r = generate(model, tok, PROMPTS[0], d2, max_tokens=16, temperature=0.8, seed=3, guard=False)
    assert len(r.token_ids) == 16 and r.stats.drafted > 0


@pytest.mark.slow
def test_checkpoint_round_trip_v1_v2(pairs, tmp_path):
    for version in (1, 2):
        d = pairs("qwen3", version=version)
        src = load_drafter(str(d / "drafter"))
        out = save_drafter(src, tmp_path / f"v{version}", layout="factorised")
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ([ARCH_V2] if version == 2 else ["DFlashDraftModel"])
        if version == 2:
            assert set(cfg["dflash_config"]) >= {"block_size", "conv_group_size", "conv_kernel_size",
                                                 "mask_token_id", "selector_rank", "selector_top_k",
                                                 "target_layer_ids"}
        back = load_drafter(str(out))
        a, b = dict(tree_flatten(src.parameters())), dict(tree_flatten(back.parameters()))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
        assert DrafterConfig.from_dict(back.config.to_dict()) == back.config
    keys = set(dict(tree_flatten(back.parameters())))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.attention_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
            "layers.0.mlp_conv.base_kernel", "candidate_selector.hidden_projection.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)


@pytest.mark.slow
def test_codebook_selector_checkpoint_loads(pairs, tmp_path):
    """The published selector layout is recognised from the weight keys alone (no
    config flag), and saving a factorised drafter writes that layout by default."""
    d = pairs("qwen3", version=2)
    model, tok, src = load(str(d / "target"), str(d / "drafter"))
    sel = src.candidate_selector
    sel.successor_projection.weight = mx.random.normal(sel.successor_projection.weight.shape, key=mx.random.key(5))
    with pytest.raises(DrafterError, match="needs the target's embedding"):
        save_drafter(src, tmp_path / "nope")
    out = save_drafter(src, tmp_path / "cb", embed=model.model.embed_tokens)
    assert "selector_codebooks" not in json.dumps(_cfg(out))
    w = mx.load(str(out / "model.safetensors"))
    c = src.config
    assert w["candidate_selector.predecessor_codebook"].shape == (c.vocab_size, c.selector_rank)
    assert not any(k.startswith(("candidate_selector.predecessor_proj", "candidate_selector.successor_proj")) for k in w)
    back = load_drafter(str(out))
    assert back.config.selector_codebooks and back.candidate_selector.codebooks
    for prompt in PROMPTS[:3]:
        a = generate(model, tok, prompt, src, max_tokens=12, block_size=6)
        b = generate(model, tok, prompt, back, max_tokens=12, block_size=6)
        assert a.token_ids == b.token_ids and a.from_draft == b.from_draft


def test_parameter_accounting_at_published_sizes():
    c = DrafterConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=248_320, mask_token_id=248_319,
                      target_layer_ids=[1, 9, 17, 25, 33], version=2)
    n = param_counts(Drafter(c))  # lazy: nothing allocated
    assert abs(n["conv"] - 16.5e6) <= 0.5e6
    assert abs(n["selector"] - 2.0e6) <= 0.1e6
    assert n["total"] == n["layers"] + n["fc"] + n["conv"] + n["selector"]
    assert n["fc"] == 5 * 2560 * 2560 + 2560


def test_published_like_dflash2_config_builds_lazily():
    cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 5120,
           "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "vocab_size": 248_320, "num_target_layers": 64, "layer_types": ["full_attention"] * 5,
           "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                             "mask_token_id": 248_077, "selector_rank": 256, "selector_top_k": 16,
                             "target_layer_ids": [1, 16, 31, 46, 61]}}
    c = DrafterConfig.from_dict(cfg)
    assert c.version == 2 and c.block_size == 16 and c.extra == {}
    assert c.layer_types == ["full_attention"] * 5 and not any(map(c.causal, range(5)))
    shapes = {k: v.shape for k, v in tree_flatten(Drafter(c).parameters())}
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (64 * 128, 5120)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 5120)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 5120 // 16, 5120)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    assert c.to_dict()["layer_types"] == cfg["layer_types"]


def _cfg(d):
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", 96, "hidden size"),
    ("vocab_size", 1000, "vocabulary"),
    ("mask", 9999, "mask token"),
    ("layers", [1, 7], "target layers"),
    ("num_target_layers", 12, "12-layer target"),
])
def test_mismatched_drafter_is_refused(pairs, tmp_path, field, value, msg):
    d = pairs("qwen3", version=1)
    bad = tmp_path / "bad"
    shutil.copytree(d / "drafter", bad)
    cfg = _cfg(bad)
    if field == "mask":
        cfg["dflash_config"]["mask_token_id"] = value
    elif field == "layers":
        cfg["dflash_config"]["target_layer_ids"] = value
    else:
        cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    if field in ("hidden_size", "vocab_size"):  # weights no longer fit: build fresh ones
        save_drafter(Drafter(DrafterConfig.from_dict(cfg)), bad)
    if field == "layers":
        save_drafter(Drafter(DrafterConfig.from_dict(cfg)), bad)
    with pytest.raises(DrafterError, match=msg) as e:
        load(str(d / "target"), str(bad))
    assert "\n" not in str(e.value)


def test_loader_errors_are_one_line(pairs, tmp_path):
    d = pairs("qwen3", version=1)
    cases = []
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((str(empty), "no config.json"))
    badjson = tmp_path / "badjson"
    shutil.copytree(d / "drafter", badjson)
    (badjson / "config.json").write_text("{nope")
    cases.append((str(badjson), "not valid JSON"))
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(d / "drafter" / "config.json", noweights)
    cases.append((str(noweights), "no .safetensors"))
    notdrafter = d / "target"
    cases.append((str(notdrafter), "not a DFlash drafter"))
    wrongshape = tmp_path / "wrongshape"
    shutil.copytree(d / "drafter", wrongshape)
    w = mx.load(str(wrongshape / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, :-1]
    mx.save_safetensors(str(wrongshape / "model.safetensors"), w)
    cases.append((str(wrongshape), "fc.weight has shape"))
    missing = tmp_path / "missing"
    shutil.copytree(d / "drafter", missing)
    w.pop("fc.weight")
    mx.save_safetensors(str(missing / "model.safetensors"), w)
    cases.append((str(missing), "missing"))
    cases.append((str(d / "drafter" / "config.json"), "is a file"))
    cases.append(("no-such-org/no-such-drafter", "could not fetch"))
    cases.append(("not a path", "not a folder here"))
    for path, msg in cases:
        with pytest.raises(HubError, match=msg) as e:
            load(str(d / "target"), path)
        assert "\n" not in str(e.value), path
    with pytest.raises(HubError, match="is a DFlash drafter"):
        load(str(d / "drafter"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_target_adapter_logits_and_features(pairs, family):
    d = pairs(family, version=1)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    t = Target(model)
    x = mx.array([[1, 50, 7, 300, 12, 9, 44]])
    logits, feats = t(x, t.make_cache(), [0, 2])
    ref = model(x)
    assert mx.allclose(logits, ref, atol=1e-4).item()
    h = model.model.embed_tokens(x)
    outs = []
    for layer in model.model.layers:
        h = layer(h, "causal", None)
        outs.append(h)
    assert feats.shape == (1, 7, 2 * t.hidden_size)
    assert mx.allclose(feats, mx.concatenate([outs[0], outs[2]], axis=-1), atol=1e-4).item()
    validate(drafter, t)
    ref_ids = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPTS[0], max_tokens=16)]
    assert generate(model, tok, PROMPTS[0], drafter, max_tokens=16).token_ids == ref_ids


def test_inspect_prints_every_field_and_its_effect(tmp_path, capsys):
    """`mlx-dflash inspect`: each field read, its value, what it does (layer by layer
    for the attention), the selector layout found from the weight keys."""
    import argparse

    from app.commands import inspect as inspect_cmd
    from mlx_dflash.drafting.drafter_config import FIELDS

    cfg = {"architectures": [ARCH_V2], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "num_target_layers": 8,
           "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
           "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3], "final_logit_softcapping": 20.0,
                             "selector_rank": 32}}
    c = DrafterConfig.from_dict(cfg)
    c.selector_codebooks = True
    m = Drafter(c)
    mx.eval(m.parameters())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert inspect_cmd.run(argparse.Namespace(path=str(tmp_path), json=False)) == 0
    out = capsys.readouterr().out
    assert "layers 0-3: sliding window 2048, causal block" in out and "layer 4: full, bidirectional block" in out
    assert "published [V, r] codebooks" in out and "RoPE default, base 500000" in out
    for k in FIELDS:
        if k not in ("rope_parameters", "rope_scaling"):
            assert k in out, k
    assert inspect_cmd.run(argparse.Namespace(path=str(tmp_path), json=True)) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fields"]["final_logit_softcapping"] == 20.0 and info["fields"]["rope_theta"] == 500000.0


def test_loaded_drafter_keeps_its_checkpoint_dtype(pairs, tmp_path, monkeypatch):
    """The drafter runs in its checkpoint's dtype (not the target's); a compute dtype the
    user asks for (argument or $MLX_DFLASH_DTYPE) applies to both models."""
    monkeypatch.delenv("MLX_DFLASH_DTYPE", raising=False)
    d = pairs("qwen3", version=2)
    bf = save_drafter(load_drafter(str(d / "drafter")), tmp_path / "bf16", dtype=mx.bfloat16, layout="factorised")
    model, _, dr = load(str(d / "target"), str(bf))
    assert {v.dtype for _, v in tree_flatten(dr.parameters())} == {mx.bfloat16}
    _, _, dr = load(str(d / "target"), str(bf), dtype="float32")
    assert {v.dtype for _, v in tree_flatten(dr.parameters())} == {mx.float32}
