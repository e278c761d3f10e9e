"""DFlash (v1) and DFlash 2 drafters: config, model, load/save, validation.

A drafter is a short stack of Qwen3-style layers with the target's hidden size
and no embedding or head of its own (it borrows the target's). Its context is a
projection of tapped target-layer outputs; the draft block
`[anchor, MASK, ...]` attends bidirectionally to itself and to every cached
context row (DFLASH2.md sections 2 and 3)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .hub import HubError, resolve_path

ARCH_V1 = "DFlashDraftModel"
ARCH_V2 = "DFlash2DraftModel"


class DrafterError(HubError):
    """A drafter that cannot be loaded or does not fit its target (one-line message)."""


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list
    block_size: int = 16
    num_target_layers: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    version: int = 1
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_codebooks: bool = False  # materialised [V, r] tables (public checkpoints)
    extra: dict = field(default_factory=dict)  # unknown fields, written back on save

    _QWEN3 = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
              "max_position_embeddings")

    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        archs = cfg.get("architectures") or []
        if ARCH_V2 in archs:
            version = 2
        elif ARCH_V1 in archs:
            version = 1
        else:
            raise DrafterError(f"not a DFlash drafter (architectures={archs}); expected {ARCH_V1} or {ARCH_V2}")
        dc = cfg.get("dflash_config") or {}
        try:
            kw = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "vocab_size")}
            kw["num_key_value_heads"] = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
            kw["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            kw["mask_token_id"] = int(dc["mask_token_id"])
            kw["target_layer_ids"] = [int(i) for i in dc["target_layer_ids"]]
        except KeyError as e:
            raise DrafterError(f"drafter config is missing {e.args[0]!r}") from None
        for k in ("rms_norm_eps", "rope_theta", "max_position_embeddings"):
            if k in cfg:
                kw[k] = cfg[k]
        kw["block_size"] = int(dc.get("block_size", cfg.get("block_size", 16)))
        kw["num_target_layers"] = cfg.get("num_target_layers")
        kw["version"] = version
        if version == 2:
            for k in ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k"):
                if k in dc:
                    kw[k] = int(dc[k])
            kw["selector_codebooks"] = bool(dc.get("selector_codebooks", False))
        known = set(cls._QWEN3) | {"architectures", "dflash_config", "block_size", "num_target_layers", "model_type"}
        kw["extra"] = {k: v for k, v in cfg.items() if k not in known}
        return cls(**kw)

    def to_dict(self) -> dict:
        cfg = dict(self.extra)
        cfg.update({k: getattr(self, k) for k in self._QWEN3})
        cfg["model_type"] = "qwen3"
        cfg["num_target_layers"] = self.num_target_layers
        dc = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.version == 1:
            cfg["architectures"] = [ARCH_V1]
            cfg["block_size"] = self.block_size
        else:
            cfg["architectures"] = [ARCH_V2]
            dc.update(block_size=self.block_size, conv_group_size=self.conv_group_size,
                      conv_kernel_size=self.conv_kernel_size, selector_rank=self.selector_rank,
                      selector_top_k=self.selector_top_k)
            if self.selector_codebooks:
                dc["selector_codebooks"] = True
        cfg["dflash_config"] = dc
        return cfg


def default_target_layer_ids(num_target_layers: int, n_taps: int) -> list:
    """Evenly spaced from layer 1 to num_layers - 3 (DFLASH2.md section 2)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if n_taps == 1:
        return [(lo + hi) // 2]
    return [round(lo + i * (hi - lo) / (n_taps - 1)) for i in range(n_taps)]


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        h = c.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, h, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.rope = nn.RoPE(c.head_dim, traditional=False, base=c.rope_theta)

    def _kv(self, x, offset):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x, ctx_k, ctx_v, offset, mask=None):
        """x: block rows [B, L, H] at positions offset.. ; ctx_k/v: cached context K/V."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)
        k, v = self._kv(x, offset)
        if ctx_k is not None:
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
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.version == 2:
            from .conv import DynamicConv

            self.attention_conv = DynamicConv(c.hidden_size, c.conv_group_size, c.conv_kernel_size)
            self.mlp_conv = DynamicConv(c.hidden_size, c.conv_group_size, c.conv_kernel_size)
        self.v2 = c.version == 2

    def __call__(self, x, ctx_k, ctx_v, offset, block_size, mask=None):
        a = self.input_layernorm(x)
        if self.v2:  # one projection per sublayer feeds the conv on both sides
            d = self.attention_conv.coefficients(a)
            a = self.attention_conv(a, d, 0, block_size)
            x = x + self.attention_conv(self.self_attn(a, ctx_k, ctx_v, offset, mask), d, 1, block_size)
        else:
            x = x + self.self_attn(a, ctx_k, ctx_v, offset, mask)
        a = self.post_attention_layernorm(x)
        if self.v2:
            d = self.mlp_conv.coefficients(a)
            return x + self.mlp_conv(self.mlp(self.mlp_conv(a, d, 0, block_size)), d, 1, block_size)
        return x + self.mlp(a)


class Drafter(nn.Module):
    """The drafter's own weights; embedding and head come from the target."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [DraftLayer(c) for _ in range(c.num_hidden_layers)]
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

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def context(self, feats: mx.array) -> mx.array:
        """Tapped target features [B, n, taps*H] -> context rows [B, n, H]."""
        return self.hidden_norm(self.fc(feats))

    def __call__(self, block_emb, new_feats, cache, offset=None):
        """One parallel draft forward.

        block_emb: embedded block `[anchor, MASK, ...]` [1, w, H];
        new_feats: target features of rows not yet in the context [1, n, taps*H] (or None);
        cache: per-layer context K/V (grows by n rows). The block sits at positions
        `offset` (default: the context length, i.e. the anchor's position).
        Returns the final-normed hidden states [1, w, H] (apply the target head)."""
        ctx = self.context(new_feats) if new_feats is not None and new_feats.shape[1] else None
        x = block_emb
        w = x.shape[1]
        for layer, c in zip(self.layers, cache):
            if ctx is not None:  # context rows keep their real positions
                k, v = layer.self_attn._kv(ctx, c.offset)
                ctx_k, ctx_v = c.update_and_fetch(k, v)
            elif c.offset:
                ctx_k, ctx_v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            else:
                ctx_k = ctx_v = None
            start = c.offset if offset is None else offset
            x = layer(x, ctx_k, ctx_v, start, w)
        return self.norm(x)


    def propose(self, target, anchor: int, new_feats, cache, width: int, temperature: float = 0.0) -> "Proposal":
        """Draft `width - 1` tokens after `anchor` in one parallel forward."""
        block = mx.array([[anchor] + [self.config.mask_token_id] * (width - 1)])
        h = self(target.embed(block), new_feats, cache)[0, 1:]
        logits = target.head(h)
        if self.config.version == 1:
            tokens = mx.argmax(logits, axis=-1)
            conf = mx.softmax(logits, axis=-1).max(axis=-1)
            mx.eval(tokens, conf)
            return Proposal(tokens.tolist(), None, 0.0, conf.tolist())
        mx.eval(logits, h)  # the draft / select boundary, for the stats
        t0 = time.perf_counter()
        drafts, q, conf = self.candidate_selector.propose(
            logits, h, anchor, target.embed_tokens, temperature=temperature, with_conf=True)
        return Proposal(drafts, q, time.perf_counter() - t0, conf)


@dataclass
class Proposal:
    """What a drafter proposes for one cycle."""

    tokens: list  # the drafts d_1 .. d_{w-1}
    q: Optional[mx.array] = None  # [n, V] proposal rows when sampled; None: deterministic
    t_select: float = 0.0  # seconds spent in the path selector
    conf: Optional[list] = None  # per draft: DFlash 2 path score as a probability, DFlash 1 softmax (adaptive width)


# -- loading, saving, validation ------------------------------------------------


def load_drafter(path_or_repo: str, dtype=None) -> Drafter:
    path = resolve_path(path_or_repo, "drafter")
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path} has no .safetensors weights (only safetensors are loaded)")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    model = Drafter(config)
    _load_weights(model, weights, path)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _load_weights(model: Drafter, weights: dict, path) -> None:
    from mlx.utils import tree_flatten

    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise DrafterError(f"drafter weights in {path} do not match its config ({what})")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise DrafterError(f"drafter weight {k} has shape {tuple(v.shape)}, config implies {tuple(expected[k].shape)}")
    model.load_weights(list(weights.items()))


def save_drafter(model: Drafter, out, dtype=None) -> Path:
    from mlx.utils import tree_flatten

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        params = {k: v.astype(dtype) for k, v in params.items()}
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
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


def read_config(path) -> DrafterConfig:
    """The DrafterConfig of a drafter folder, without loading weights."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise DrafterError(f"{path} has no config.json; not a drafter folder")
    try:
        return DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise DrafterError(f"{cfg_file} is not valid JSON (line {e.lineno}); fix or re-download it") from None
