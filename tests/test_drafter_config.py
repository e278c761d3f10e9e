"""Drafter config parsing: the reference's defaults and precedence, and one-line
refusals naming each field the project cannot honour."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_dflash.drafting.drafter import load_drafter
from mlx_dflash.drafting.drafter_config import DrafterConfig, DrafterError
from reference_configs import H, SLIDE, base_config, write_published


@pytest.mark.parametrize("draft_layers,n_target,want", [(3, 12, [1, 5, 9]), (5, 36, [1, 9, 17, 25, 33]),
                                                        (1, 12, [6]), (2, 4, [1, 1])])
def test_default_taps_follow_the_reference_formula(draft_layers, n_target, want):
    cfg = base_config(1, num_hidden_layers=draft_layers, num_target_layers=n_target)
    cfg["dflash_config"].pop("target_layer_ids")
    assert DrafterConfig.from_dict(cfg).target_layer_ids == want


# -- refusals: one line, naming the field ---------------------------------------

REFUSED = [
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types"),
    ({"layer_types": SLIDE}, "sliding_window"),
    ({"layer_types": SLIDE, "sliding_window": 0}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "no-such-rope", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor"),
    ({"quantization": {"bits": 4, "group_size": 64}}, "quantization"),
    ({"dc_conv_group_size": 24}, "conv_group_size"),
    ({"dc_conv_kernel_size": 0}, "conv_kernel_size"),
    ({"dc_mask_token_id": None}, "mask_token_id"),
    ({"dc_target_layer_ids": None, "num_target_layers": None}, "target_layer_ids"),
    ({"hidden_size": None}, "hidden_size"),
]


@pytest.mark.parametrize("over,field", REFUSED)
def test_refused_fields_name_themselves(over, field):
    cfg = base_config(2)
    for k, v in over.items():
        if k.startswith("dc_"):
            if v is None:
                cfg["dflash_config"].pop(k[3:])
            else:
                cfg["dflash_config"][k[3:]] = v
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with pytest.raises(DrafterError, match=field) as e:
        DrafterConfig.from_dict(cfg)
    assert "\n" not in str(e.value)


def test_quantized_weights_refused_in_one_line(tmp_path):
    d = write_published(tmp_path / "q", base_config(1), seed=9)
    w = mx.load(str(d / "model.safetensors"))
    w["fc.scales"] = mx.zeros((H, 4))
    mx.save_safetensors(str(d / "model.safetensors"), w)
    with pytest.raises(DrafterError, match="quantized") as e:
        load_drafter(str(d))
    assert "\n" not in str(e.value)


def test_drafter_keeps_its_checkpoint_dtype(tmp_path):
    d = write_published(tmp_path / "bf", base_config(2), seed=10)
    w = mx.load(str(d / "model.safetensors"))
    mx.save_safetensors(str(d / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in w.items()})
    m = load_drafter(str(d))
    assert {v.dtype for _, v in tree_flatten(m.parameters())} == {mx.bfloat16}


def test_dflash_config_wins_over_the_top_level():
    """The reference's precedence: dflash_config, then the top level, then the default."""
    cfg = base_config(2, mask_token_id=1, block_size=4, output_multiplier=0.5, conv_kernel_size=3,
                      dc_output_multiplier=0.25)
    c = DrafterConfig.from_dict(cfg)
    assert (c.mask_token_id, c.block_size, c.output_multiplier) == (5, 8, 0.25)
    assert c.conv_kernel_size == 2  # dflash_config has it
    cfg["dflash_config"].pop("conv_kernel_size")
    cfg["dflash_config"].pop("block_size")
    c = DrafterConfig.from_dict(cfg)
    assert (c.conv_kernel_size, c.block_size) == (3, 4)
    bare = base_config(1, rope_theta=None, rms_norm_eps=None, max_position_embeddings=None, head_dim=None,
                       num_key_value_heads=None)
    c = DrafterConfig.from_dict(bare)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.head_dim, c.num_key_value_heads,
            c.block_size, c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping,
            c.is_causal, c.attention_bias, c.kinds()) == (10000.0, 1e-6, 32768, 128, 32, 8, 1.0, 1.0, None,
                                                         None, False, ["full_attention"] * 3)
    bare["num_key_value_heads"] = None  # transformers: null means one KV head per query head
    assert DrafterConfig.from_dict(bare).num_key_value_heads == 4
