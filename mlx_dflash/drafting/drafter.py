"""DFlash (v1) and DFlash 2 drafters: model, load/save, validation.

A drafter is a short stack of Qwen3-style layers with the target's hidden size
and no embedding or head of its own (it borrows the target's). Its context is a
projection of tapped target-layer outputs; the draft block
`[anchor, MASK, ...]` attends to itself and to the cached context rows
(DFLASH2.md sections 2 and 3). Per layer, as the config says: full or sliding-window
attention, bidirectional or causal inside the block (drafter_config.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..platform.hub import resolve_path
from ..target import rope_tables
from .batch_draft import propose_batch
from .drafter_config import (
    ARCH_V1,
    ARCH_V2,
    FIELDS,
    DrafterConfig,
    DrafterError,
    build_target_layer_ids,
    default_target_layer_ids,
    read_config,
)


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        h, bias = c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, h, bias=bias)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.rope = initialize_rope(c.head_dim, base=c.rope_theta, traditional=False,
                                    scaling_config=c.rope_scaling,
                                    max_position_embeddings=c.max_position_embeddings)
        self.window = c.window(layer)
        self.causal = c.causal(layer)
        # every layer rotates at the same positions: within a forward opened with
        # rope_tables.Tables (Drafter.__call__, propose_batch) they share the tables
        self._rope = rope_tables.shared(self.rope) or self.rope

    def _kv(self, x, offset):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self._rope(k, offset=offset), v

    def visible(self, L: int, n: int, offset: int, first: int = 0):
        """Context rows kept (from lo) and the boolean mask [L, n - lo + L], or None
        when every row sees everything. Context row j sits at position first + j
        (a bounded cache keeps only the last rows of a window layer), block row i
        at offset + i; a window W keeps p > offset + i - W (the reference's rule)."""
        lo = 0 if self.window is None else min(n, max(0, offset - self.window + 1 - first))
        cut = self.window is not None and n > lo and first + lo <= offset + L - 1 - self.window
        if not (self.causal and L > 1) and not cut:
            return lo, None
        i = mx.arange(L)[:, None]
        if self.window is not None:
            ctx = (first + lo + mx.arange(n - lo))[None] > offset + i - self.window
        else:
            ctx = mx.ones((L, n - lo), dtype=mx.bool_)
        blk = (mx.arange(L)[None] <= i) if self.causal else mx.ones((L, L), dtype=mx.bool_)
        return lo, mx.concatenate([ctx, blk], axis=1)

    def __call__(self, x, ctx_k, ctx_v, offset, mask=None, first: int = 0):
        """x: block rows [B, L, H] at positions offset.. ; ctx_k/v: cached context K/V
        (row j at position first + j on a window layer)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self._rope(q, offset=offset)
        k, v = self._kv(x, offset)
        if mask is None:
            lo, mask = self.visible(L, 0 if ctx_k is None else ctx_k.shape[2], offset, first)
            if ctx_k is not None and lo:
                ctx_k, ctx_v = ctx_k[..., lo:, :], ctx_v[..., lo:, :]
        if ctx_k is not None and ctx_k.shape[2]:
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig, layer: int = 0):
        super().__init__()
        self.self_attn = DraftAttention(c, layer)
        self.mlp = DraftMLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.version == 2:
            from .conv import DynamicConv

            self.attention_conv = DynamicConv(c.hidden_size, c.conv_group_size, c.conv_kernel_size)
            self.mlp_conv = DynamicConv(c.hidden_size, c.conv_group_size, c.conv_kernel_size)
        self.v2 = c.version == 2

    def __call__(self, x, ctx_k, ctx_v, offset, block_size, mask=None, first: int = 0):
        a = self.input_layernorm(x)
        if self.v2:  # one projection per sublayer feeds the conv on both sides
            d = self.attention_conv.coefficients(a)
            a = self.attention_conv(a, d, 0, block_size)
            x = x + self.attention_conv(self.self_attn(a, ctx_k, ctx_v, offset, mask, first), d, 1, block_size)
        else:
            x = x + self.self_attn(a, ctx_k, ctx_v, offset, mask, first)
        a = self.post_attention_layernorm(x)
        if self.v2:
            d = self.mlp_conv.coefficients(a)
            return x + self.mlp_conv(self.mlp(self.mlp_conv(a, d, 0, block_size)), d, 1, block_size)
        return x + self.mlp(a)


class ContextCache:
    """A drafter layer's context K/V bounded to a sink of the first `sink` rows
    and a window of the last `window` rows (mlx-lm's RotatingKVCache(max_size,
    keep), kept in temporal order instead of rotating in place, so that it trims
    exactly on prompt-cache reuse): memory and the draft's attention cost stay flat
    as the context grows. Every row keeps the position it was RoPE'd at; `offset`
    counts all rows ever fed (the next row's position). After a trim that reaches
    below the window's first row, the window is shorter until new rows arrive."""

    def __init__(self, window: int, sink: int = 0):
        if window < 1 or sink < 0:
            raise ValueError(f"drafter context window must be >= 1 and sink >= 0, got {window} and {sink}")
        self.window, self.sink = window, sink
        self.keys = self.values = None  # [B, H, rows, D]: the sink rows, then the window rows
        self.offset = 0

    @property
    def rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def first(self) -> int:
        """The position of the first window row (rows after the sink are contiguous)."""
        return self.offset - (self.rows - min(self.sink, self.offset))

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        s = min(self.sink, self.offset)
        if self.rows > s + self.window:
            self.keys = mx.concatenate([self.keys[..., :s, :], self.keys[..., -self.window:, :]], axis=2)
            self.values = mx.concatenate([self.values[..., :s, :], self.values[..., -self.window:, :]], axis=2)
        return self.keys, self.values

    def fetch(self):
        return self.keys, self.values

    def skip(self, n: int) -> None:
        """Advance by `n` rows that are never fed (they would fall out of the
        window anyway: the caller feeds at least `window` rows after them)."""
        s = min(self.sink, self.offset)
        if self.keys is not None and self.rows > s:
            self.keys, self.values = self.keys[..., :s, :], self.values[..., :s, :]
        self.offset += n

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if n <= 0:
            return 0
        t = self.offset - n
        s_old, s_new = min(self.sink, self.offset), min(self.sink, t)
        keep = min(s_old, s_new) + max(0, t - self.first)
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.offset = t
        return n

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def fetch(cache):
    """The context K/V a layer cache holds (None, None when empty)."""
    if not cache.offset:
        return None, None
    if isinstance(cache, ContextCache):
        return cache.fetch()
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def _unseen(cache, n: int):
    """(head, gap): of `n` new context rows, the first `head` reach a sink and the
    next `gap` would leave every layer's window before a draft could see them;
    (n, 0) when some layer keeps every row."""
    if not n or not all(isinstance(c, ContextCache) for c in cache):
        return n, 0
    off = cache[0].offset
    head = min(n, max(0, max(c.sink for c in cache) - off))
    gap = max(0, n - head - max(c.window for c in cache))
    return head, gap


def taken_in(cache, n: int) -> int:
    """Of `n` new context rows, how many the next draft takes into `cache` (the
    rest would leave every layer's window unseen): what its catch-up costs."""
    return n - _unseen(cache, n)[1]


class Drafter(nn.Module):
    """The drafter's own weights; embedding and head come from the target."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [DraftLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.version == 2:
            from .selector import PathSelector

            self.candidate_selector = PathSelector(
                c.hidden_size, c.selector_rank, c.selector_top_k,
                codebook_vocab=c.vocab_size if c.selector_codebooks else None,
            )

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def make_cache(self, window: Optional[int] = None, sink: int = 0) -> list:
        """Per layer: the context K/V. Layers the checkpoint gives a sliding window
        keep the last `sliding_window` rows (all they can see, as published);
        the others a sink of the first `sink` rows plus the last `window` rows
        (None: every row, a plain KVCache)."""
        out = []
        for layer in self.layers:
            w = layer.self_attn.window
            if w is not None:
                out.append(ContextCache(w, 0))
            elif window is not None:
                out.append(ContextCache(window, sink))
            else:
                out.append(KVCache())
        return out

    def context(self, feats: mx.array) -> mx.array:
        """Tapped target features [B, n, taps*H] -> context rows [B, n, H]."""
        return self.hidden_norm(self.fc(feats))

    def logits(self, target, h: mx.array) -> mx.array:
        """Draft logits from final-normed hidden states: the target's head, then the
        config's output_multiplier and final_logit_softcapping (as the reference)."""
        out = target.head(h)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        cap = c.final_logit_softcapping
        if cap is not None and cap > 0:
            out = mx.tanh(out / cap) * cap
        return out

    def feed(self, new_feats, cache) -> list:
        """Project target features of rows not yet in the context [1, n, taps*H]
        (or None) into every layer's context cache. Returns per layer the
        context K/V it holds and the position of its first window row:
        [(ctx_k, ctx_v, first)] (None, None when empty)."""
        n = new_feats.shape[1] if new_feats is not None else 0
        head, gap = _unseen(cache, n)
        if gap:  # rows no bounded cache keeps: never projected
            new_feats = mx.concatenate([new_feats[:, :head], new_feats[:, head + gap:]], axis=1)
        ctx = self.context(new_feats) if n else None
        out = []
        for layer, c in zip(self.layers, cache):
            if ctx is not None:  # context rows keep their real positions
                if gap:
                    if head:
                        c.update_and_fetch(*layer.self_attn._kv(ctx[:, :head], c.offset))
                    c.skip(gap)
                    k, v = layer.self_attn._kv(ctx[:, head:], c.offset)
                else:
                    k, v = layer.self_attn._kv(ctx, c.offset)
                ctx_k, ctx_v = c.update_and_fetch(k, v)
            else:
                ctx_k, ctx_v = fetch(c)
            first = c.offset - (ctx_k.shape[2] if ctx_k is not None else 0)  # (window layers: no sink)
            out.append((ctx_k, ctx_v, first))
        return out

    def embed_block(self, target, block: mx.array) -> mx.array:
        """The block's ids [B, w] as the first layer's input: the target's raw
        embedding times the config's input_embedding_scale."""
        x = target.embed(block)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        return x

    def __call__(self, block_emb, new_feats, cache, offset=None):
        """One parallel draft forward.

        block_emb: the target's (unscaled) embedding of the block `[anchor, MASK, ...]`
        [1, w, H], multiplied here by the config's input_embedding_scale;
        new_feats: target features of rows not yet in the context [1, n, taps*H] (or None);
        cache: per-layer context K/V (grows by n rows). The block sits at positions
        `offset` (default: the context length, i.e. the anchor's position).
        Returns the final-normed hidden states [1, w, H] (apply `logits`)."""
        with rope_tables.Tables():
            return self._forward(block_emb, new_feats, cache, offset)

    def _forward(self, block_emb, new_feats, cache, offset):
        ctxs = self.feed(new_feats, cache)
        x = block_emb
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        w = x.shape[1]
        for layer, c, (ctx_k, ctx_v, first) in zip(self.layers, cache, ctxs):
            start = c.offset if offset is None else offset
            x = layer(x, ctx_k, ctx_v, start, w, first=first)
        return self.norm(x)

    def propose(self, target, anchor: int, new_feats, cache, width: int, temperature: float = 0.0,
                key=None) -> "Proposal":
        """Draft `width - 1` tokens after `anchor` in one parallel forward. All
        lazy: nothing is evaluated here; the loop evaluates the drafts with the
        verify that consumes them (one host sync per cycle). `conf` is lazy too,
        and computed only by a policy that reads it (verify mode adaptive).
        `key`: the row's own PRNG key for a sampled selector walk."""
        block = mx.array([[anchor] + [self.config.mask_token_id] * (width - 1)])
        h = self(target.embed(block), new_feats, cache)[0, 1:]
        logits = self.logits(target, h)
        if self.config.version == 1:
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
            return Proposal(tokens, None, mx.softmax(logits, axis=-1).max(axis=-1))
        tokens, q, conf = self.candidate_selector.walk(logits, h, anchor, target.embed_tokens, temperature, key)
        return Proposal(tokens, q, conf)

    def propose_batch(self, target, anchors, feats, caches, width: int, temperatures, keys):
        """`propose` for many rows in one forward (batch_draft.propose_batch)."""
        return propose_batch(self, target, anchors, feats, caches, width, temperatures, keys)


@dataclass
class Proposal:
    """What a drafter proposes for one cycle."""

    tokens: object  # the drafts d_1 .. d_{w-1}: an mx.array [w-1] (lazy) or a list of ids
    q: Optional[mx.array] = None  # [n, V] proposal rows when sampled; None: deterministic
    conf: object = None  # per draft, mx.array or list: DFlash 2 path score as a probability, DFlash 1 softmax


# -- loading, saving, validation ------------------------------------------------

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _read_weights(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path} has no .safetensors weights (only safetensors are loaded)")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    for k in _CODEBOOKS:  # an nn.Embedding-style export of the published tables
        if k + ".weight" in weights and k not in weights:
            weights[k] = weights.pop(k + ".weight")
    return weights


def load_drafter(path_or_repo: str, dtype=None) -> Drafter:
    """A drafter folder or repo, in its checkpoint's dtype (or `dtype` when given).

    The DFlash 2 selector layout comes from the weight keys: the published [V, r]
    `*_codebook` tables, or the project's factorised `*_projection` form."""
    path = resolve_path(path_or_repo, "drafter")
    config = read_config(path)
    weights = _read_weights(path)
    config.selector_codebooks = config.version == 2 and all(k in weights for k in _CODEBOOKS)
    model = Drafter(config)
    _load_weights(model, weights, path)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _load_weights(model: Drafter, weights: dict, path) -> None:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        if any(k.endswith((".scales", ".biases")) for k in unexpected):
            what += "; a quantized checkpoint: load the float one and quantize with the drafter settings"
        raise DrafterError(f"drafter weights in {path} do not match its config ({what})")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise DrafterError(f"drafter weight {k} has shape {tuple(v.shape)}, config implies {tuple(expected[k].shape)}")
    model.load_weights(list(weights.items()))


def _codebooks(model: Drafter, embed, chunk: int = 8192) -> dict:
    """The factorised selector as the published [V, r] tables: row a of the
    predecessor table is W_A E[a] (and likewise B), which is exactly what the
    factorised form gathers at run time."""
    sel, V = model.candidate_selector, model.config.vocab_size
    pred, succ = [], []
    for s in range(0, V, chunk):
        e = embed(mx.arange(s, min(V, s + chunk)))
        pred.append(sel.predecessor_projection(e))
        succ.append(sel.successor_projection(e))
        mx.eval(pred[-1], succ[-1])
    return {_CODEBOOKS[0]: mx.concatenate(pred), _CODEBOOKS[1]: mx.concatenate(succ)}


def save_drafter(model: Drafter, out, dtype=None, embed=None, layout: str = "published") -> Path:
    """Write config.json + model.safetensors.

    layout "published" (default): the z-lab layout the reference runtimes (and
    vLLM / SGLang through it) load; a factorised DFlash 2 selector is written as
    [V, r] codebooks, which needs the target's embedding `embed` (e.g.
    `target.embed_tokens`). layout "factorised": the project's compact form
    (this project loads both)."""
    from mlx.utils import tree_flatten

    if layout not in ("published", "factorised"):
        raise DrafterError(f"unknown drafter layout {layout!r} (published or factorised)")
    out = Path(out)
    params = dict(tree_flatten(model.parameters()))
    if model.version == 2 and layout == "published" and not model.config.selector_codebooks:
        if embed is None:
            raise DrafterError("saving a DFlash 2 drafter in the published layout needs the target's embedding "
                               "(embed=target.embed_tokens) to write the selector codebooks")
        for k in ("predecessor_projection.weight", "successor_projection.weight"):
            params.pop("candidate_selector." + k)
        params.update(_codebooks(model, embed))
    if dtype is not None:
        params = {k: v.astype(dtype) for k, v in params.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    cfg = model.config.to_dict()
    kinds = {str(v.dtype).rsplit(".", 1)[-1] for v in params.values()}
    if len(kinds) == 1:  # what transformers-based runtimes read to pick the weights' dtype
        cfg["dtype"] = cfg["torch_dtype"] = kinds.pop()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def validate(drafter: Drafter, target) -> None:
    """Refuse a drafter that does not fit the target, with a one-line reason."""
    c = drafter.config
    if c.hidden_size != target.hidden_size:
        raise DrafterError(f"drafter hidden size {c.hidden_size} != target hidden size {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        raise DrafterError(f"drafter vocabulary {c.vocab_size} != target vocabulary {target.vocab_size}")
    if not 0 <= c.mask_token_id < target.vocab_size:
        raise DrafterError(f"drafter mask token id {c.mask_token_id} is outside the target vocabulary ({target.vocab_size})")
    bad = [i for i in c.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DrafterError(f"drafter taps target layers {bad} but the target has only {target.num_layers} layers")
    if c.num_target_layers and c.num_target_layers != target.num_layers:
        raise DrafterError(f"drafter was trained for a {c.num_target_layers}-layer target; this one has {target.num_layers}")


def param_counts(model: Drafter) -> dict:
    """Parameter counts by part. Shapes only: works on a lazily built model
    (nothing is allocated until evaluated)."""
    from mlx.utils import tree_flatten

    out = {"layers": 0, "fc": 0, "conv": 0, "selector": 0}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("candidate_selector."):
            part = "selector"
        elif "_conv." in k:
            part = "conv"
        elif k.startswith(("fc.", "hidden_norm.")):
            part = "fc"
        else:
            part = "layers"
        out[part] += v.size
    out["total"] = sum(out.values())
    return out


__all__ = ["ARCH_V1", "ARCH_V2", "FIELDS", "Drafter", "DrafterConfig", "DrafterError", "Proposal",
           "build_target_layer_ids", "default_target_layer_ids", "load_drafter", "param_counts", "read_config",
           "save_drafter", "validate"]
