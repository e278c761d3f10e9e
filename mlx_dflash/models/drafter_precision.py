"""The drafter's precision: activation dtype (with the float16 overflow guard)
and weight quantization, applied to one loaded drafter instance, and what
`drafter.quant_bits auto` means on this backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..settings.schema import SettingsError
from .dtype_choice import cast, on_cpu

# drafter.quant_bits auto: 4-bit where quantized matmuls are the fast ones (Metal:
# memory-bound, 28% of the bytes, no tau loss: bench/quant.md); full precision on
# mlx-cpu, whose quantized matmul is compute-bound and slower than float32 BLAS
AUTO_QUANT_BITS = {"metal": 4, "cpu": None}


def resolve_quant_bits(setting) -> tuple:
    """(bits the drafter's weights are quantized to, None for full precision; why)."""
    if setting != "auto":
        return setting, "from the setting"
    where = "cpu" if on_cpu() else "metal"
    bits = AUTO_QUANT_BITS[where]
    return bits, ("auto on Metal: memory-bound, a quarter of the bytes" if bits else
                  "auto on mlx-cpu: its quantized matmul is slower than full precision there")


def quant_label(bits) -> str:
    return f"{bits}-bit" if bits else "full precision"


def param_bytes(module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def safe_activation_dtype(requested: str, target_dtype) -> tuple:
    """The drafter's activation dtype and a notice if the request was overridden.

    Half precision with a 5-bit exponent (float16) overflows on the large hidden
    states of bf16/fp32-trained targets: inf -> NaN drafts -> acceptance silently
    zero. So float16 is only kept for a float16 target on a GPU; otherwise the
    target's own dtype is used."""
    if requested == "auto":
        return target_dtype, None
    want = getattr(mx, requested)
    if want == mx.float16 and (target_dtype != mx.float16 or on_cpu()):
        why = "on the CPU backend" if on_cpu() else f"with a {_dtype_name(target_dtype)} target"
        return target_dtype, (f"drafter activations in float16 {why} can overflow and zero acceptance; "
                              f"using {_dtype_name(target_dtype)}")
    return want, None


def _dtype_name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def set_activation_dtype(drafter, dtype) -> None:
    """Run the drafter in `dtype`: its float parameters, and its inputs (the target's
    embeddings and features arrive in the target's dtype). No safety check: see
    safe_activation_dtype."""
    cast(drafter, dtype)
    base = type(drafter)
    while getattr(base, "_casts_inputs", False):
        base = base.__mro__[1]

    class Cast(base):  # per instance: other drafters keep their own dtype
        _casts_inputs = True

        def __call__(self, block_emb, new_feats, cache, offset=None):
            if new_feats is not None:
                new_feats = new_feats.astype(dtype)
            return super().__call__(block_emb.astype(dtype), new_feats, cache, offset)

    Cast.__name__ = Cast.__qualname__ = base.__name__
    drafter.__class__ = Cast


def quantize_drafter(drafter, bits: int, group_size: int = 64, scale_dtype=None) -> int:
    """Quantize the drafter's Linear layers in place (those whose input dim is a
    multiple of group_size); returns how many were quantized.

    Scales and biases take the weights' dtype, or `scale_dtype`: bfloat16 keeps
    4-bit weights at 4.5 bits each (group 64) even where activations run in
    float32 (the CPU backend), with a rounding error far below the 4-bit step."""
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        raise SettingsError(f"drafter quantization must be 4 or 8 bits, group size 32/64/128 (got {bits}, {group_size})")
    n = [0]

    def pred(path, m):
        if not (isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0):
            return False
        if scale_dtype is not None:
            m.weight = m.weight.astype(scale_dtype)
        n[0] += 1
        return True

    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=pred)
    mx.eval(drafter.parameters())
    return n[0]
