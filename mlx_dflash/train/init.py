"""The frozen target a drafter trains against and the drafter's starting point:
its config (read off the target) and Qwen3-style initial weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..drafting.drafter import Drafter, load_drafter
from ..drafting.drafter_config import DrafterConfig, default_target_layer_ids
from ..target.adapter import Target
from .config import TrainConfig, TrainError


def load_target(path: Optional[str]):
    """(model, tokenizer) frozen; float32 on the CPU backend (see loader.load)."""
    from ..models.loader import load

    model, tok, _ = load(path)
    model.freeze()
    return model, tok


def mask_token_id(tokenizer, override: Optional[int] = None) -> int:
    if override is not None:
        return int(override)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    mask = getattr(hf, "mask_token_id", None)
    if mask is not None:
        return int(mask)
    vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
    tid = vocab.get("<|mask|>")
    if tid is None:
        raise TrainError("the target's tokenizer has no <|mask|> token; pass --mask-token ID (an unused token id)")
    return int(tid)


def target_features(target: Target, tokens: mx.array, layer_ids: Sequence[int]) -> mx.array:
    """tokens [S, L] -> tapped layer outputs [S, L, taps*H], through the model's own
    forward (embedding scales, per-layer masks, recurrent layers), no cache."""
    return target.features(tokens, layer_ids)


# ----------------------------------------------------------------------------- drafter init


def drafter_config(target: Target, model, cfg: TrainConfig, mask_id: int) -> DrafterConfig:
    args = getattr(model, "args", None)
    get = lambda k, d=None: getattr(args, k, None) or d  # noqa: E731
    n = target.num_layers
    hi = max(1, n - 3)
    taps = cfg.taps or min(5, hi)  # evenly spaced over layers 1..n-3 without repeats
    heads = get("num_attention_heads")
    if not heads:
        raise TrainError("cannot read num_attention_heads from the target's config")
    if cfg.block_size < 2:
        raise TrainError(f"--block-size must be >= 2 (got {cfg.block_size})")
    return DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=cfg.intermediate_size or get("intermediate_size", 3 * target.hidden_size),
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", heads),
        head_dim=get("head_dim", target.hidden_size // heads),
        vocab_size=target.vocab_size,
        mask_token_id=mask_id,
        target_layer_ids=default_target_layer_ids(n, taps),
        block_size=cfg.block_size,
        num_target_layers=n,
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=get("rope_theta", 10000.0),
        max_position_embeddings=get("max_position_embeddings", 40960),
        version=cfg.version,
        selector_rank=min(256, target.hidden_size),
        extra={"target_model": str(cfg.target)} if cfg.target else {},  # lets `--model TARGET` find it
    )


def init_drafter(config: DrafterConfig, seed: int) -> Drafter:
    """Qwen3-style init (normal 0.02 linears, unit norms). A DFlash 2 drafter copies
    every weight it shares with the DFlash 1 drafter of the same seed; its convs are
    identity and its selector's successor side zero, so both start as the same
    function (an honest ablation)."""
    mx.random.seed(seed)
    v1 = Drafter(replace(config, version=1))
    v1.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02)
                              for k, v in tree_flatten(v1.parameters()) if k.endswith("proj.weight")
                              or k == "fc.weight"]))
    if config.version == 1:
        mx.eval(v1.parameters())
        return v1
    v2 = Drafter(config)
    v2.load_weights(tree_flatten(v1.parameters()), strict=False)
    mx.eval(v2.parameters())
    return v2


# what --init must agree on with the run (field, how the run sets it); the target's
# side (vocabulary, hidden size, depth) is checked first, with its own message
_TARGET_FIELDS = (("vocab_size", "vocabulary"), ("hidden_size", "hidden size"),
                  ("num_target_layers", "target layers"))
_RUN_FIELDS = (("version", "--version"), ("num_hidden_layers", "--layers"), ("block_size", "--block-size"),
               ("target_layer_ids", "--taps"), ("intermediate_size", "--intermediate-size"),
               ("mask_token_id", "--mask-token"), ("num_attention_heads", "target heads"),
               ("num_key_value_heads", "target KV heads"), ("head_dim", "target head_dim"))


def load_init_drafter(path: str, requested: DrafterConfig) -> Drafter:
    """The drafter saved in `path` (published layout), float32, to train on from its
    weights; refused (one line) unless it is the architecture the run asks for, for
    this target. Its own config is kept (selector rank, convs, RoPE, codebook tables)."""
    drafter = load_drafter(path, dtype=mx.float32)
    c = drafter.config
    bad = [f"{what} {getattr(c, k)} != {getattr(requested, k)}" for k, what in _TARGET_FIELDS
           if getattr(c, k) != getattr(requested, k)]
    if bad:
        raise TrainError(f"--init {path} was trained for another target ({', '.join(bad)}); "
                         "pass a drafter of this target or train from scratch without --init")
    bad = [f"{flag}: {getattr(c, k)} here, {getattr(requested, k)} asked" for k, flag in _RUN_FIELDS
           if getattr(c, k) != getattr(requested, k)]
    if bad:
        raise TrainError(f"--init {path} does not match the requested drafter ({'; '.join(bad)}); "
                         "pass the same --version/--layers/--block-size/--taps or another --init")
    return drafter
