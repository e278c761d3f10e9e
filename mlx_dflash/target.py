"""Target adapter: one forward over an mlx-lm model that returns logits AND the
outputs of chosen layers, using the model's own layer objects, masks and KV
caches (no monkeypatching), plus KV rollback by trimming."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


class TargetError(ValueError):
    """A model that does not have the standard decoder layout."""


class Target:
    """Standard layout: `model.model.{embed_tokens, layers, norm}` plus
    `lm_head` or tied embeddings (Qwen2/Qwen3/Llama/Mistral and kin)."""

    def __init__(self, model: nn.Module):
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise TargetError(
                f"model type '{getattr(model, 'model_type', type(model).__name__)}' has no "
                "standard decoder layout (embed_tokens, layers, norm); use --verify-mode off"
            )
        self.model = model
        self.inner = inner
        self.layers = inner.layers
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.num_layers = len(self.layers)
        args = getattr(model, "args", None)
        self.hidden_size = getattr(args, "hidden_size", None) or self.embed_tokens.weight.shape[-1]
        self.vocab_size = getattr(args, "vocab_size", None) or self.embed_tokens.weight.shape[0]
        self.sliding_window = getattr(inner, "sliding_window", None) or getattr(args, "sliding_window", None)
        self._lm_head = getattr(model, "lm_head", None)

    # -- pieces the drafter borrows ------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def head(self, h: mx.array) -> mx.array:
        if self._lm_head is not None:
            return self._lm_head(h)
        return self.embed_tokens.as_linear(h)

    # -- caches --------------------------------------------------------------------
    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    @staticmethod
    def can_trim(cache: list) -> bool:
        return can_trim_prompt_cache(cache)

    @staticmethod
    def trim(cache: list, n: int) -> None:
        if n > 0:
            trim_prompt_cache(cache, n)

    # -- the forward -----------------------------------------------------------------
    def __call__(self, tokens: mx.array, cache: list, capture: Sequence[int] = ()):
        """tokens [1, L] -> (logits [1, L, V], features [1, L, len(capture)*H] or None)."""
        h = self.embed_tokens(tokens)
        masks = {}  # one mask per attention kind, built like the model itself does
        want = set(capture)
        feats = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            sliding = bool(getattr(layer, "use_sliding", False))
            if sliding not in masks:
                masks[sliding] = create_attention_mask(
                    h, c, window_size=self.sliding_window if sliding else None
                )
            h = layer(h, masks[sliding], c)
            if i in want:
                feats[i] = h
        logits = self.head(self.norm(h))
        if not capture:
            return logits, None
        return logits, mx.concatenate([feats[i] for i in capture], axis=-1)
