"""DFlash 2 dynamic grouped depthwise convolution (DFLASH2.md 3.1), K taps (2 in
every published checkpoint):

    y[b, t, c] = sum_{j < K} (base[side, j, c] + dyn[b, t, side, j, c // G]) * x[b, t - j, c]

with x[b, t - j] read as zero where it crosses a block start (t % block_size < j).

The op is tiny and memory-bound, so on a GPU it is one fused pass. The pass is
written once, as KERNEL_BODY below, and wrapped by a two-line prelude for Metal
(`mx.fast.metal_kernel`) and for CUDA (`mx.fast.cuda_kernel`); the tests compile
the very same body as C and compare it with the ops path. On the CPU the ops path
(`_conv_ops`, under `mx.compile`) is used and is the reference.

Rounding rule (every path): inputs are taken in x.dtype (base and dyn are cast
to it), the two products and the sum are computed in fp32, and the result is
rounded to x.dtype once, at the store. Paths can then differ only by fp32
summation/FMA rounding: ~1e-7 relative in fp32, at most 1 ulp after a half store.

Gradients: the fused kernels are wrapped in `mx.custom_function` whose vjp is
the ops path's, so training may run on either backend.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

# One output element per `elem` (flat index into y [B, L, H]). The prelude
# defines `elem`; SIDE, BS (block size), G (group size) and T (dtype of x / y)
# are compile-time constants. Only C-style casts, so it compiles as Metal, CUDA
# and C alike.
KERNEL_BODY = """
    const int L = x_shape[1];
    const int H = x_shape[2];
    if (elem >= x_shape[0] * L * H) return;  /* CUDA rounds the grid up to whole blocks */
    const int row = elem / H;                /* b * L + t */
    const int c = elem - row * H;
    const int NG = H / G;
    const int d = (row * 4 + SIDE * 2) * NG + c / G;  /* dyn[b, t, SIDE, 0, c / G] */
    float acc = ((float)base[SIDE * 2 * H + c] + (float)dyn[d]) * (float)x[elem];
    if ((row % L) % BS != 0)                 /* the t-1 tap never crosses a block start */
        acc += ((float)base[(SIDE * 2 + 1) * H + c] + (float)dyn[d + NG]) * (float)x[elem - H];
    y[elem] = (T)acc;
"""

METAL_PRELUDE = "const int elem = (int)thread_position_in_grid.x;\n"
CUDA_PRELUDE = "const int elem = (int)(blockIdx.x * blockDim.x + threadIdx.x);\n"


def kernel_backend() -> str:
    """Which path `dynamic_conv` takes now: "metal", "cuda" or "mlx-ops"."""
    if mx.default_device().type != mx.gpu:
        return "mlx-ops"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "mlx-ops"


@mx.compile
def _conv_ops(x, base, dyn, side, block_size, group_size):
    B, L, H = x.shape
    G, K = group_size, base.shape[1]
    f32 = mx.float32
    x32 = x.astype(f32)
    base, dyn = base.astype(x.dtype).astype(f32), dyn.astype(x.dtype).astype(f32)  # see rounding rule
    # Broadcast each dynamic coefficient over its G channels without repeating it.
    k = base[side].reshape(K, H // G, G) + dyn[:, :, side, :, :, None]  # [B, L, K, H/G, G]
    y = k[:, :, 0] * x32.reshape(B, L, H // G, G)
    pos = mx.arange(L) % block_size if L > block_size else None
    for j in range(1, K):  # tap j reads x[t - j], zero where that crosses a block start
        prev = mx.concatenate([mx.zeros((B, j, H), f32), x32[:, :-j]], axis=1)[:, :L]
        if pos is not None:  # (one block, as in a draft: only its start, zero already)
            prev = mx.where((pos >= j)[:, None], prev, 0.0)
        y = y + k[:, :, j] * prev.reshape(B, L, H // G, G)
    return y.reshape(B, L, H).astype(x.dtype)


@lru_cache(maxsize=None)
def _kernel(backend: str):
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    prelude = METAL_PRELUDE if backend == "metal" else CUDA_PRELUDE
    return make(name="dflash2_dynamic_conv", input_names=["x", "base", "dyn"],
                output_names=["y"], source=prelude + KERNEL_BODY)


@lru_cache(maxsize=None)
def _fused(backend: str, side: int, block_size: int, group_size: int):
    """The fused kernel as a differentiable function of (x, base, dyn)."""

    @mx.custom_function
    def f(x, base, dyn):
        return _kernel(backend)(
            inputs=[x, base, dyn],
            template=[("T", x.dtype), ("SIDE", side), ("BS", block_size), ("G", group_size)],
            grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[x.shape], output_dtypes=[x.dtype],
        )[0]

    @f.vjp
    def f_vjp(primals, cotangent, output):
        ops = lambda x, b, d: _conv_ops(x, b, d, side, block_size, group_size)
        return mx.vjp(ops, list(primals), [cotangent])[1]

    return f


def dynamic_conv(x, base, dyn, side: int, block_size: int, group_size: int) -> mx.array:
    """x [B, L, H], base [2, K, H], dyn [B, L, 2, K, H // G] -> y [B, L, H].
    The fused kernels are written for the usual K = 2; other sizes take the ops path."""
    backend = kernel_backend()
    if backend == "mlx-ops" or base.shape[1] != 2:
        return _conv_ops(x, base, dyn, side, block_size, group_size)
    f = _fused(backend, side, block_size, group_size)
    return f(x, base.astype(x.dtype), dyn.astype(x.dtype))


class DynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash 2 layer; identity at init."""

    def __init__(self, hidden_size: int, group_size: int = 16, kernel_size: int = 2):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1 (got {kernel_size})")
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.group_size, self.kernel_size = group_size, kernel_size
        base = mx.zeros((2, kernel_size, hidden_size))
        base[:, 0, :] = 1.0
        self.base_kernel = base
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def coefficients(self, a: mx.array) -> mx.array:
        """[B, L, H] -> dyn [B, L, 2, K, H // G] (side, tap, group)."""
        return self.kernel_projection(a).reshape(*a.shape[:-1], 2, self.kernel_size, -1)

    def __call__(self, x: mx.array, dyn: mx.array, side: int, block_size: int) -> mx.array:
        return dynamic_conv(x, self.base_kernel, dyn, side, block_size, self.group_size)
