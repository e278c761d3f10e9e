"""The fused conv kernel on a GPU (Metal or CUDA) against the MLX ops path, for
every shape class the drafters use, in fp32 / bf16 / fp16. Skipped without a
GPU: scripts/gpu_check.sh runs it on a Mac or an NVIDIA box."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.drafting.conv import DynamicConv, dynamic_conv, kernel_backend

pytestmark = pytest.mark.skipif(kernel_backend() == "mlx-ops", reason="no GPU: the fused kernel does not run here")

SHAPES = [  # B, L, H, G, block_size: the unit-test shapes, then the drafters' (published H, verify widths, training)
    (1, 5, 64, 16, 5), (2, 8, 48, 16, 4), (3, 16, 32, 1, 16), (1, 3, 64, 8, 16), (2, 12, 128, 4, 3),
    (1, 7, 16, 16, 1), (2, 32, 96, 32, 16),
    (1, 1, 2560, 16, 16), (1, 5, 2560, 16, 5), (1, 8, 2560, 16, 8), (1, 16, 2560, 16, 16),
    (1, 16, 4096, 16, 16), (1, 8, 5120, 16, 8), (4, 64, 2560, 16, 16), (2, 512, 4096, 16, 16),
]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def case(seed, B, L, H, G, dtype):
    r = np.random.default_rng(seed)
    x = mx.array(r.standard_normal((B, L, H)).astype(np.float32)).astype(dtype)
    base = mx.array(r.standard_normal((2, 2, H)).astype(np.float32)).astype(dtype)
    dyn = mx.array(r.standard_normal((B, L, 2, 2, H // G)).astype(np.float32)).astype(dtype)
    return x, base, dyn


def on_cpu(f, *a):
    """The ops path (what dynamic_conv takes on the CPU), computed on the CPU."""
    with mx.stream(mx.cpu):
        prev = mx.default_device()
        mx.set_default_device(mx.cpu)
        try:
            assert kernel_backend() == "mlx-ops"
            y = f(*a)
            mx.eval(y)
        finally:
            mx.set_default_device(prev)
    return y


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,L,H,G,bs", SHAPES)
@pytest.mark.parametrize("side", [0, 1])
def test_kernel_matches_ops(B, L, H, G, bs, side, dtype):
    dt = DTYPES[dtype]
    x, base, dyn = case(B * 1000 + L + H + side, B, L, H, G, dt)
    y = dynamic_conv(x, base, dyn, side, bs, G)  # the fused kernel
    ref = on_cpu(dynamic_conv, x, base, dyn, side, bs, G)
    assert y.dtype == dt and y.shape == x.shape
    a, b = np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32))
    if dt == mx.float32:  # same products, same order: fp32 rounding (FMA) apart
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:  # fp32 math, one rounding at the store on both sides: at most 1 ulp apart
        ulp = np.array(mx.abs(mx.maximum(mx.abs(y), mx.abs(ref))).astype(mx.float32)) * (
            2.0 ** -7 if dt == mx.bfloat16 else 2.0 ** -10)
        assert np.all(np.abs(a - b) <= ulp + 1e-30), float(np.max(np.abs(a - b) - ulp))


def test_kernel_is_taken():
    assert kernel_backend() in ("metal", "cuda")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_identity_init_on_gpu(dtype):
    m = DynamicConv(2560, group_size=16)
    x = mx.random.normal((1, 16, 2560)).astype(DTYPES[dtype])
    for side in (0, 1):
        assert mx.array_equal(m(x, m.coefficients(x), side, 16), x).item()


def test_kernel_grad_matches_ops():
    x, base, dyn = case(3, 2, 16, 256, 16, mx.float32)
    f = lambda x, b, d: (dynamic_conv(x, b, d, 1, 8, 16) ** 2).sum()
    g = mx.grad(f, argnums=(0, 1, 2))(x, base, dyn)
    r = on_cpu(lambda *a: mx.grad(f, argnums=(0, 1, 2))(*a), x, base, dyn)
    for u, v in zip(g, r):
        np.testing.assert_allclose(np.array(u), np.array(v), rtol=1e-4, atol=1e-4)
