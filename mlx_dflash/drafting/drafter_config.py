"""A drafter's config.json: every field the reference runtimes read, with their
defaults and precedence, and a one-line refusal for anything we cannot honour.

Precedence follows the z-lab reference (`dflash` package): DFlash fields are read
from `dflash_config` first, then from the top level, then the default. The field
table, with defaults, is FIELDS below (`mlx-dflash inspect` prints what it read)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..platform.hub import HubError

ARCH_V1 = "DFlashDraftModel"
ARCH_V2 = "DFlash2DraftModel"
FULL, SLIDING = "full_attention", "sliding_attention"

# name -> (where it is read, default, what it does). "top": top level only;
# "dflash": dflash_config, then top level. Documentation and `inspect` use it.
FIELDS = {
    "architectures": ("top", "required", f"{ARCH_V1} -> DFlash 1, {ARCH_V2} -> DFlash 2"),
    "hidden_size": ("top", "required", "width of every layer (must equal the target's)"),
    "intermediate_size": ("top", "required", "SiLU-gated MLP width"),
    "num_hidden_layers": ("top", "required", "number of draft layers"),
    "num_attention_heads": ("top", "required", "query heads"),
    "num_key_value_heads": ("top", "32 (Qwen3Config; null: num_attention_heads)", "key/value heads (GQA)"),
    "head_dim": ("top", 128, "per-head width (Qwen3Config default)"),
    "vocab_size": ("top", "required", "must equal the target's vocabulary"),
    "rms_norm_eps": ("top", 1e-6, "epsilon of every RMSNorm"),
    "rope_theta": ("top", "rope_parameters.rope_theta, else 10000.0", "RoPE base"),
    "rope_parameters": ("top", None, "RoPE kind and scaling (mlx-lm initialize_rope); wins over rope_scaling"),
    "rope_scaling": ("top", None, "RoPE scaling, when rope_parameters is absent"),
    "max_position_embeddings": ("top", 32768, "used by the dynamic / llama3 / yarn / longrope kinds"),
    "layer_types": ("top", "all full_attention", "per layer: full_attention or sliding_attention"),
    "sliding_window": ("top", None, "window of sliding_attention layers (required if any)"),
    "is_causal": ("top", "None (sliding layers causal, full layers bidirectional)",
                  "causal mask inside the draft block"),
    "attention_bias": ("top", False, "biases on q/k/v/o projections"),
    "hidden_act": ("top", "silu", "MLP activation (only silu)"),
    "num_target_layers": ("top", None, "target depth: checked against the target; derives default taps"),
    "mask_token_id": ("dflash", "required", "token id of the MASK rows of a block"),
    "target_layer_ids": ("dflash", "round(1 + i*(n-4)/(L-1)), n target layers, L draft layers",
                         "target layers whose outputs form the context"),
    "block_size": ("dflash", 16, "trained block size (largest verify width)"),
    "input_embedding_scale": ("dflash", 1.0, "block embeddings are multiplied by it"),
    "output_multiplier": ("dflash", 1.0, "draft logits are multiplied by it"),
    "final_logit_softcapping": ("dflash", None, "draft logits -> cap * tanh(logits / cap) when > 0"),
    "conv_kernel_size": ("dflash", 2, "DFlash 2: taps of the dynamic convolution"),
    "conv_group_size": ("dflash", 16, "DFlash 2: channels sharing one dynamic coefficient"),
    "selector_rank": ("dflash", 256, "DFlash 2: rank of the path selector"),
    "selector_top_k": ("dflash", 16, "DFlash 2: candidates per position"),
}


class DrafterError(HubError):
    """A drafter that cannot be loaded or does not fit its target (one-line message)."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """The reference's default taps: one per draft layer, evenly spaced over target
    layers 1 .. n-3 (the middle layer for a single draft layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def default_target_layer_ids(num_target_layers: int, n_taps: int) -> list:
    """Evenly spaced from layer 1 to num_layers - 3 (the project's trainer)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if n_taps == 1:
        return [(lo + hi) // 2]
    return [round(lo + i * (hi - lo) / (n_taps - 1)) for i in range(n_taps)]


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
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    rope_scaling: Optional[dict] = None
    layer_types: Optional[list] = None  # None: all full attention
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    version: int = 1
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_codebooks: bool = False  # materialised [V, r] tables: set from the weight keys, never saved
    extra: dict = field(default_factory=dict)  # unknown fields, written back on save

    _QWEN3 = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
              "max_position_embeddings")
    _DFLASH = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
    _V2 = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")

    # -- per-layer attention -------------------------------------------------------
    def kinds(self) -> list:
        return list(self.layer_types or [FULL] * self.num_hidden_layers)

    def window(self, i: int) -> Optional[int]:
        return self.sliding_window if self.kinds()[i] == SLIDING else None

    def causal(self, i: int) -> bool:
        """The reference rule: is_causal when set, else causal exactly on sliding layers."""
        return self.kinds()[i] == SLIDING if self.is_causal is None else bool(self.is_causal)

    @property
    def logit_transform(self) -> bool:
        cap = self.final_logit_softcapping
        return self.output_multiplier != 1.0 or (cap is not None and cap > 0)

    # -- parsing -------------------------------------------------------------------
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

        def dv(name, default=None):  # dflash_config, then top level, then default
            return dc.get(name, cfg.get(name, default))

        try:
            kw = {k: int(cfg[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "vocab_size")}
        except KeyError as e:
            raise DrafterError(f"drafter config is missing {e.args[0]!r}") from None
        n_layers = kw["num_hidden_layers"]
        # Absent fields take transformers' Qwen3Config defaults, as the torch reference
        # does (the MLX one requires them): 32 KV heads (null: one per query head), head_dim 128.
        kv = cfg.get("num_key_value_heads", 32)
        kw["num_key_value_heads"] = int(kv if kv is not None else kw["num_attention_heads"])
        kw["head_dim"] = int(cfg.get("head_dim") or 128)
        if dv("mask_token_id") is None:
            raise DrafterError("drafter config is missing 'mask_token_id' (in dflash_config or at the top level)")
        kw["mask_token_id"] = int(dv("mask_token_id"))
        kw["num_target_layers"] = cfg.get("num_target_layers")
        taps = dv("target_layer_ids")
        if taps is None:
            if not kw["num_target_layers"]:
                raise DrafterError("drafter config has neither 'target_layer_ids' nor 'num_target_layers' to derive them")
            taps = build_target_layer_ids(int(kw["num_target_layers"]), n_layers)
        kw["target_layer_ids"] = [int(i) for i in taps]
        kw["block_size"] = int(dv("block_size", 16))
        for k in ("rms_norm_eps", "max_position_embeddings"):
            if cfg.get(k) is not None:
                kw[k] = cfg[k]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        kw["rope_theta"] = float(cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0)))
        kw["rope_scaling"] = dict(rope) if rope else None
        _check_rope(kw)
        lt = cfg.get("layer_types")
        if lt is not None:
            lt = list(lt)
            if len(lt) != n_layers:
                raise DrafterError(f"drafter config 'layer_types' has {len(lt)} entries for {n_layers} layers")
            bad = sorted(set(lt) - {FULL, SLIDING})
            if bad:
                raise DrafterError(f"drafter config 'layer_types' has unsupported kinds {bad} (only {FULL}, {SLIDING})")
            kw["layer_types"] = lt
        sw = cfg.get("sliding_window")
        if lt and SLIDING in lt:
            if sw is None or int(sw) < 1:
                raise DrafterError("drafter config has sliding_attention layers but no positive 'sliding_window'")
        kw["sliding_window"] = int(sw) if sw is not None else None
        if cfg.get("is_causal") is not None:
            kw["is_causal"] = bool(cfg["is_causal"])
        kw["attention_bias"] = bool(cfg.get("attention_bias", False))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise DrafterError(f"drafter config 'hidden_act' is {act!r}; only silu drafters are supported")
        prf = cfg.get("partial_rotary_factor")
        rope_kind = (rope or {}).get("type") or (rope or {}).get("rope_type")
        if prf is None and rope_kind != "proportional":  # transformers 5 keeps it in rope_parameters
            prf = (rope or {}).get("partial_rotary_factor")
        if prf is not None and float(prf) != 1.0:
            raise DrafterError(f"drafter config 'partial_rotary_factor' is {prf}; only full-width RoPE is supported")
        for k in ("quantization", "quantization_config"):
            if cfg.get(k):
                raise DrafterError(f"drafter config has {k!r}: load the float checkpoint (quantize with the drafter settings)")
        kw["input_embedding_scale"] = float(dv("input_embedding_scale", 1.0))
        kw["output_multiplier"] = float(dv("output_multiplier", 1.0))
        cap = dv("final_logit_softcapping")
        kw["final_logit_softcapping"] = float(cap) if cap is not None else None
        kw["version"] = version
        if version == 2:
            for k in cls._V2:
                if dv(k) is not None:
                    kw[k] = int(dv(k))
            if kw.get("conv_kernel_size", 2) < 1:
                raise DrafterError(f"drafter config 'conv_kernel_size' must be >= 1 (got {kw['conv_kernel_size']})")
            g = kw.get("conv_group_size", 16)
            if g < 1 or kw["hidden_size"] % g:
                raise DrafterError(f"drafter config 'conv_group_size' {g} does not divide hidden_size {kw['hidden_size']}")
        known = (set(cls._QWEN3) | set(cls._DFLASH) | set(cls._V2) | set(FIELDS)
                 | {"dflash_config", "model_type", "selector_codebooks"})
        kw["extra"] = {k: v for k, v in cfg.items() if k not in known}
        return cls(**kw)

    def to_dict(self) -> dict:
        """The published (z-lab) layout: the reference runtimes read every field."""
        cfg = dict(self.extra)
        cfg.update({k: getattr(self, k) for k in self._QWEN3})
        cfg["model_type"] = "qwen3"
        cfg["hidden_act"] = "silu"
        cfg["num_target_layers"] = self.num_target_layers
        cfg["attention_bias"] = self.attention_bias
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.layer_types is not None:
            cfg["layer_types"] = list(self.layer_types)
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        dc = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
              "block_size": self.block_size}
        if self.input_embedding_scale != 1.0:
            dc["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dc["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dc["final_logit_softcapping"] = self.final_logit_softcapping
        if self.version == 1:
            cfg["architectures"] = [ARCH_V1]
            cfg["block_size"] = self.block_size
        else:
            cfg["architectures"] = [ARCH_V2]
            dc.update({k: getattr(self, k) for k in self._V2})
        cfg["dflash_config"] = dc
        return cfg

    def describe(self) -> list:
        """(field, value read, effect) rows for `inspect`."""
        rows = [(k, getattr(self, k, "silu"), FIELDS[k][2]) for k in FIELDS  # hidden_act: silu or refused
                if k not in ("architectures", "rope_parameters", "rope_scaling", "layer_types")
                and (self.version == 2 or k not in self._V2)]
        rows.insert(0, ("architectures", ARCH_V2 if self.version == 2 else ARCH_V1, f"DFlash {self.version}"))
        rows.append(("rope_parameters/rope_scaling", self.rope_scaling, _rope_effect(self)))
        rows.append(("layer_types", self.layer_types, "; ".join(attention_summary(self))))
        return rows


def _rope_effect(c: DrafterConfig) -> str:
    kind = (c.rope_scaling or {}).get("type") or (c.rope_scaling or {}).get("rope_type", "default")
    return f"RoPE {kind}, base {c.rope_theta:g}"


def attention_summary(c: DrafterConfig) -> list:
    """Runs of layers with the same attention, e.g. 'layers 0-3: sliding window 2048, causal'."""
    def desc(i):
        w = c.window(i)
        kind = f"sliding window {w}" if w else "full"
        return f"{kind}, {'causal' if c.causal(i) else 'bidirectional'} block"

    out, i, n = [], 0, c.num_hidden_layers
    while i < n:
        j = i
        while j + 1 < n and desc(j + 1) == desc(i):
            j += 1
        out.append(f"{'layer' if i == j else 'layers'} {i if i == j else f'{i}-{j}'}: {desc(i)}")
        i = j + 1
    return out


def _check_rope(kw: dict) -> None:
    """Build the RoPE once so an unsupported kind is refused at load, by name."""
    from mlx_lm.models.rope_utils import initialize_rope

    try:
        initialize_rope(kw["head_dim"], base=kw["rope_theta"], traditional=False,
                        scaling_config=kw["rope_scaling"],
                        max_position_embeddings=kw.get("max_position_embeddings", 32768))
    except Exception as e:  # KeyError / ValueError / NotImplementedError from mlx-lm
        kind = (kw["rope_scaling"] or {}).get("type") or (kw["rope_scaling"] or {}).get("rope_type")
        raise DrafterError(f"drafter config 'rope_scaling'/'rope_parameters' ({kind!r}) is not supported "
                           f"by mlx-lm's initialize_rope ({type(e).__name__}: {e})") from None


def read_config(path) -> DrafterConfig:
    """The DrafterConfig of a drafter folder, without loading weights."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise DrafterError(f"{path} has no config.json; not a drafter folder")
    try:
        return DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise DrafterError(f"{cfg_file} is not valid JSON (line {e.lineno}); fix or re-download it") from None


__all__ = ["ARCH_V1", "ARCH_V2", "FIELDS", "DrafterConfig", "DrafterError", "build_target_layer_ids",
           "default_target_layer_ids", "read_config", "attention_summary"]
