"""Drafter configs in the published layout and random weights for them, shared by
test_reference.py (against the z-lab reference) and test_drafter_config.py."""

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dflash.drafting.drafter import Drafter
from mlx_dflash.drafting.drafter_config import ARCH_V1, ARCH_V2, DrafterConfig

H, V, TL = 64, 256, 4  # hidden, vocabulary, target layers


def base_config(version, **over):
    dc = {"mask_token_id": 5, "target_layer_ids": [1, 2], "block_size": 8}
    if version == 2:
        dc.update(conv_group_size=16, conv_kernel_size=2, selector_rank=32, selector_top_k=8)
    cfg = {"architectures": [ARCH_V2 if version == 2 else ARCH_V1], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "num_target_layers": TL, "dflash_config": dc}
    for k, v in over.items():
        if k.startswith("dc_"):
            dc[k[3:]] = v
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


SLIDE = ["sliding_attention", "sliding_attention", "full_attention"]
VARIANTS = {  # name -> config changes; every one is run as DFlash 1 and DFlash 2
    "plain": {},
    "rope_parameters_only": {"rope_theta": None, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
    "rope_yarn": {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 1024}},
    "rope_llama3": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}},
    "rope_linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope_dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16},
    "sliding_default_causal": {"layer_types": SLIDE, "sliding_window": 6},
    "sliding_bidirectional": {"layer_types": SLIDE, "sliding_window": 7, "is_causal": False},
    "all_sliding": {"layer_types": ["sliding_attention"] * 3, "sliding_window": 5},
    "causal_full": {"is_causal": True},
    "head_dim_24": {"head_dim": 24},
    "logit_transform": {"dc_output_multiplier": 0.37, "dc_final_logit_softcapping": 2.5},
    "softcap_top_level": {"final_logit_softcapping": 1.5},
    "input_embedding_scale": {"dc_input_embedding_scale": 8.0},
    # the shape of a published DFlash 2 config: every layer sliding yet bidirectional, RoPE
    # only in rope_parameters, scaled and soft-capped logits
    "published_dflash2_style": {"layer_types": ["sliding_attention"] * 3, "sliding_window": 6, "is_causal": False,
                                "rope_theta": None, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
                                "dc_output_multiplier": 0.196, "dc_final_logit_softcapping": 2.0,
                                "use_sliding_window": True, "max_window_layers": 3},
}


def _randomize(model, seed):
    """Random weights at sensible scales (norms near 1, convs near identity)."""
    rng = np.random.default_rng(seed)
    out = []
    for k, v in tree_flatten(model.parameters()):
        shape = v.shape
        if k.endswith("norm.weight"):
            a = 1.0 + 0.2 * rng.standard_normal(shape)
        elif k.endswith("base_kernel"):
            a = 0.4 * rng.standard_normal(shape)
            a[:, 0, :] += 1.0
        elif k.endswith("kernel_projection.weight"):
            a = 0.1 * rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif k.endswith("_codebook"):
            a = rng.standard_normal(shape)
        elif k.endswith(".bias"):
            a = 0.3 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out.append((k, mx.array(a.astype(np.float32))))
    model.update(tree_unflatten(out))
    mx.eval(model.parameters())


def write_published(folder, cfg, seed=0):
    """A drafter folder in the published layout, written from the config alone
    (weights named and shaped as the published checkpoints: no project save code)."""
    c = DrafterConfig.from_dict(cfg)
    c.selector_codebooks = c.version == 2
    m = Drafter(c)
    _randomize(m, seed)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
