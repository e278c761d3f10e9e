"""Tiny random-weight targets of every supported mlx-lm family, built from
mlx-lm's own ModelArgs (no downloads), with windows small enough that every
sliding window wraps in a short generation. Used by tests/test_families.py,
tests/test_rollback.py and bench/families/families.py."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

VOCAB = 512
H = 64
WINDOW = 6  # sliding windows: prompts and outputs are longer, so every one wraps

_BASE = dict(hidden_size=H, num_hidden_layers=4, intermediate_size=96, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
             max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)

_LINEAR = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
               partial_rotary_factor=0.5)
_MOE = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=32, norm_topk_prob=True)

FAMILIES = {
    "qwen3": {},
    "qwen2": dict(attention_bias=True),
    "llama": {},
    "ministral3": dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 16}),
    "gemma2": dict(query_pre_attn_scalar=32.0),
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=32),
    "gemma4_text": dict(sliding_window=WINDOW, sliding_window_pattern=2, global_head_dim=32,
                        num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                        tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"] * 2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_moe": dict(_MOE),
    "qwen3_next": dict(_LINEAR, **_MOE, shared_expert_intermediate_size=32),
    "qwen3_5": dict(_LINEAR, rope_parameters={"type": "default", "mrope_section": [4, 2, 2],
                                               "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "qwen3_5_moe": dict(_LINEAR, **_MOE, shared_expert_intermediate_size=32,
                        rope_parameters={"type": "default", "mrope_section": [4, 2, 2],
                                         "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "lfm2": dict(norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=H, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=96,
                 layer_types=["conv", "full_attention", "conv", "conv"]),
    "nemotron_h": dict(attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
                      mamba_chunk_size=8, tie_word_embeddings=False),
    "granitemoehybrid": dict(attention_bias=False, embedding_multiplier=2.0, attention_multiplier=0.2,
                             logits_scaling=2.0, residual_multiplier=0.5, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4,
                             mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                             mamba_n_groups=1, mamba_conv_bias=True,
                             layer_types=["mamba", "attention", "mamba", "mamba"]),
    "muse_glimmer": dict(sliding_window=WINDOW, qk_scale_factor=1.0, final_logit_softcapping=20.0,
                         output_multiplier=1.0),
    "phi3": {},
    "olmo2": {},
}


def config(family: str, **over) -> dict:
    base = family.split(":")[0]
    cfg = dict(copy.deepcopy(_BASE), model_type=base, **copy.deepcopy(FAMILIES[base]))
    if base in ("qwen3_5", "qwen3_5_moe"):
        cfg = {"model_type": base, "text_config": dict(cfg, model_type=base + "_text")}
    cfg.update(over)
    return cfg


SPECIAL = 4  # ids 0..3: the test tokenizer's special tokens (make_test_pair.SPECIALS)


def _peak(model) -> None:
    """Scale the output head x8: a trained model's logits are peaked; random
    near-ties would make greedy equality depend on float noise, not on the decoder.
    Special tokens get a zero row, so random generations run to max_tokens."""
    from mlx_dflash.target.adapter import Target

    t = Target(model)
    m = t._lm_head if t._lm_head is not None else t.embed_tokens
    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return
    keep = (mx.arange(m.weight.shape[0]) >= SPECIAL)[:, None]
    m.weight = m.weight * 8.0 * keep


def build(family: str, seed: int = 0, bits: int = 0, group_size: int = 64, dtype=None, **over):
    """A tiny random model of `family` (evaluated). bits: quantize it with mlx
    (4, 8 or "mixed" bits, `group_size`); dtype: cast its float parameters."""
    from mlx_lm.utils import _get_classes

    cfg = config(family, **over)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    _peak(model)
    if dtype is not None:
        model.set_dtype(dtype)
    if bits:  # bits="mixed": 8-bit embedding and head, 4-bit elsewhere (a mixed-precision predicate)
        def pred(path, m):
            if not (hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0):
                return False
            if bits == "mixed":
                return {"bits": 8 if ("embed" in path or "lm_head" in path) else 4, "group_size": group_size}
            return True
        nn.quantize(model, group_size=group_size, bits=4 if bits == "mixed" else bits, class_predicate=pred)
    mx.eval(model.parameters())
    return model
