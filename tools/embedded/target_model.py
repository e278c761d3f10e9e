"""The embedded models' architecture: the two presets (target, draft) and their
mlx-lm qwen3 config, read against the trained tokenizer."""

from __future__ import annotations

from .target_data import DATA

PRESETS = {
    "target": dict(
        model=dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=96, intermediate_size=1024),
        lr=2e-3, batch=8, run="runs/target", out="models/target",
        title="mlx-dflash default target model"),
    "draft": dict(
        model=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, intermediate_size=1024),
        lr=3e-3, batch=8, run="runs/draft-ar", out="models/draft-ar",
        title="mlx-dflash classic autoregressive draft model"),
}
VAL_SEQ = 512  # fixed, so val losses stay comparable when --seq changes


def model_config(preset: str) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer" / "tokenizer.json"))
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
               vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-6,
               max_position_embeddings=2048, rope_theta=10000.0,
               tie_word_embeddings=True, hidden_act="silu",
               attention_bias=False, rope_scaling=None)
    cfg.update(PRESETS[preset]["model"])
    cfg["eos_token_id"] = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg["pad_token_id"] = tok.token_to_id("<|endoftext|>")
    cfg["bos_token_id"] = None
    cfg["mask_token_id"] = tok.token_to_id("<|mask|>")
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def build_model(cfg):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs.from_dict(cfg)
    return qwen3.Model(args)


def count_params(model):
    from mlx.utils import tree_flatten

    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    emb = model.model.embed_tokens.weight.size
    return total, total - emb
