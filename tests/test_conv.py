import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import ctypes
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash.drafting import conv
from mlx_dflash.drafting.conv import KERNEL_BODY, DynamicConv, dynamic_conv, kernel_backend

# The GPU kernel body, compiled as C: the thread index becomes a loop (the body
# returns once elem runs past the end), and SIDE/BS/G become arguments.
C_PRELUDE = """
void dflash2_conv(const T* x, const int* x_shape, const T* base, const T* dyn, T* y,
                  int SIDE, int BS, int G) {
    for (int elem = 0;; ++elem) {
"""
C_EPILOGUE = "    }\n}\n"


@pytest.fixture(scope="module")
def c_kernels(tmp_path_factory):
    """{np dtype: ctypes function} for the body as given and a deliberately wrong one."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("cconv")
    wrong = KERNEL_BODY.replace("x[elem - H]", "x[elem - 1]")  # taps the wrong neighbour
    assert wrong != KERNEL_BODY
    out = {}
    for tag, body in (("ok", KERNEL_BODY), ("wrong", wrong)):
        for np_dt, c_t in ((np.float32, "float"), (np.float16, "_Float16")):
            src = d / f"{tag}_{c_t}.c"
            src.write_text(C_PRELUDE + body + C_EPILOGUE)
            lib = d / f"{tag}_{c_t}.so"
            # -ffp-contract=off: no FMA, so C rounds like the ops path.
            subprocess.run(["cc", "-O2", "-ffp-contract=off", f"-DT={c_t}", "-shared", "-fPIC",
                            str(src), "-o", str(lib)], check=True)
            out[tag, np_dt] = ctypes.CDLL(str(lib)).dflash2_conv
    return out


def run_c(fn, x, base, dyn, side, bs, G):
    x, base, dyn = (np.ascontiguousarray(a) for a in (x, base, dyn))
    y = np.empty_like(x)
    shape = (ctypes.c_int * 3)(*x.shape)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    fn(p(x), shape, p(base), p(dyn), p(y), side, bs, G)
    return y


def naive(x, base, dyn, side, bs, G):
    x, base, dyn = (np.asarray(a, np.float64) for a in (x, base, dyn))
    B, L, H = x.shape
    y = np.zeros_like(x)
    for b in range(B):
        for t in range(L):
            for c in range(H):
                for j in range(base.shape[1]):
                    if t % bs < j:
                        continue
                    y[b, t, c] += (base[side, j, c] + dyn[b, t, side, j, c // G]) * x[b, t - j, c]
    return y


def rand_case(rng, B, L, H, G, dtype=np.float32, K=2):
    x = rng.standard_normal((B, L, H)).astype(dtype)
    base = rng.standard_normal((2, K, H)).astype(dtype)
    dyn = rng.standard_normal((B, L, 2, K, H // G)).astype(dtype)
    return x, base, dyn


def ops(x, base, dyn, side, bs, G):
    return np.array(dynamic_conv(mx.array(x), mx.array(base), mx.array(dyn), side, bs, G))


SHAPES = [  # B, L, H, G, block_size
    (1, 5, 64, 16, 5), (2, 8, 48, 16, 4), (3, 16, 32, 1, 16), (1, 3, 64, 8, 16),
    (2, 12, 128, 4, 3), (1, 7, 16, 16, 1), (2, 32, 96, 32, 16),
]


def test_ops_path_is_the_cpu_path():
    assert kernel_backend() == "mlx-ops"  # no GPU here


@pytest.mark.parametrize("B,L,H,G,bs", SHAPES)
@pytest.mark.parametrize("side", [0, 1])
def test_ops_matches_naive_loop(B, L, H, G, bs, side):
    x, base, dyn = rand_case(np.random.default_rng(B * 100 + L + side), B, L, H, G)
    np.testing.assert_allclose(ops(x, base, dyn, side, bs, G), naive(x, base, dyn, side, bs, G),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("B,L,H,G,bs", SHAPES)
@pytest.mark.parametrize("side", [0, 1])
def test_kernel_body_as_c_matches_ops(c_kernels, B, L, H, G, bs, side):
    rng = np.random.default_rng(7 + B + L + H + side)
    # fp32: same products and sum in the same order -> equal up to fp32 rounding.
    x, base, dyn = rand_case(rng, B, L, H, G)
    np.testing.assert_allclose(run_c(c_kernels["ok", np.float32], x, base, dyn, side, bs, G),
                               ops(x, base, dyn, side, bs, G), rtol=1e-6, atol=1e-6)
    # half: fp32 math, one rounding at the store on both sides -> at most 1 ulp apart.
    x, base, dyn = rand_case(rng, B, L, H, G, np.float16)
    yc = run_c(c_kernels["ok", np.float16], x, base, dyn, side, bs, G).astype(np.float32)
    yo = ops(x, base, dyn, side, bs, G).astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(yc), np.abs(yo)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(yc - yo) <= ulp)
    # ...and the half result is the fp64 truth rounded once (within 1 ulp of it).
    truth = naive(x, base, dyn, side, bs, G)
    assert np.all(np.abs(yc - truth) <= ulp)


def test_comparison_can_fail(c_kernels):
    x, base, dyn = rand_case(np.random.default_rng(0), 2, 8, 64, 16)
    ref = ops(x, base, dyn, 1, 4, 16)
    y = run_c(c_kernels["wrong", np.float32], x, base, dyn, 1, 4, 16)
    assert not np.allclose(y, ref, rtol=1e-3, atol=1e-3)
    y = run_c(c_kernels["ok", np.float32], np.roll(x, 1, axis=1), base, dyn, 1, 4, 16)
    assert not np.allclose(y, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_identity_init(dtype):
    m = DynamicConv(64, group_size=16)
    x = mx.random.normal((2, 10, 64)).astype(dtype)
    d = m.coefficients(x)
    assert d.shape == (2, 10, 2, 2, 4)
    for side in (0, 1):
        y = m(x, d, side, 5)
        assert y.dtype == dtype and mx.array_equal(y, x).item()


@pytest.mark.parametrize("side", [0, 1])
def test_no_read_across_block_boundary(side):
    bs, nb, H, G = 4, 3, 32, 8
    x, base, dyn = (mx.array(a) for a in rand_case(np.random.default_rng(1), 1, bs * nb, H, G))
    y0 = dynamic_conv(x, base, dyn, side, bs, G)
    for k in range(nb - 1):
        t = (k + 1) * bs - 1  # last position of block k
        x2 = x.at[:, t, :].add(100.0)
        y1 = dynamic_conv(x2, base, dyn, side, bs, G)
        assert not mx.allclose(y1[:, t], y0[:, t]).item()  # the perturbation is live
        assert mx.array_equal(y1[:, t + 1:], y0[:, t + 1:]).item()  # block k+1 on: untouched


@pytest.mark.parametrize("G", [1, 4, 16, 32])
def test_group_broadcast(G):
    H, g = 64, 1
    x = mx.random.normal((1, 4, H))
    base = mx.random.normal((2, 2, H))
    dyn = mx.zeros((1, 4, 2, 2, H // G))
    y0 = dynamic_conv(x, base, dyn, 0, 4, G)
    dyn[..., 0, 0, g] = 1.0  # side 0, tap 0, group g only
    diff = np.array(dynamic_conv(x, base, dyn, 0, 4, G) - y0)
    changed = np.where(np.abs(diff).max(axis=(0, 1)) > 0)[0]
    assert changed.tolist() == list(range(g * G, (g + 1) * G))
    np.testing.assert_allclose(diff[..., g * G:(g + 1) * G], np.array(x)[..., g * G:(g + 1) * G], rtol=1e-5, atol=1e-5)


def test_fused_dispatch_and_grad(c_kernels, monkeypatch):
    """Drive the GPU dispatch with the C build of the body standing in for the
    kernel launch: checks template names, the launch arguments and the vjp."""

    def fake_kernel(backend):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            t = dict(template)
            x, base, dyn = (np.array(a) for a in inputs)
            assert grid[0] == x.size and output_shapes == [x.shape] and t["T"] == output_dtypes[0]
            return [mx.array(run_c(c_kernels["ok", x.dtype.type], x, base, dyn, t["SIDE"], t["BS"], t["G"]))]
        return launch

    rng = np.random.default_rng(3)
    x, base, dyn = (mx.array(a) for a in rand_case(rng, 2, 8, 32, 8))
    want = [dynamic_conv(x, base, dyn, s, 4, 8) for s in (0, 1)]
    loss = lambda x, b, d, s: (dynamic_conv(x, b, d, s, 4, 8) ** 2).sum()
    want_g = [mx.grad(loss, argnums=(0, 1, 2))(x, base, dyn, s) for s in (0, 1)]

    monkeypatch.setattr(conv, "kernel_backend", lambda: "metal")
    monkeypatch.setattr(conv, "_kernel", fake_kernel)
    conv._fused.cache_clear()
    try:
        for s in (0, 1):
            assert mx.allclose(dynamic_conv(x, base, dyn, s, 4, 8), want[s], rtol=1e-6, atol=1e-6).item()
            for g, w in zip(mx.grad(loss, argnums=(0, 1, 2))(x, base, dyn, s), want_g[s]):
                assert mx.allclose(g, w, rtol=1e-5, atol=1e-5).item()
    finally:
        conv._fused.cache_clear()


def test_kernel_sources_are_one_body():
    for prelude in (conv.METAL_PRELUDE, conv.CUDA_PRELUDE):
        assert "elem" in prelude and len(prelude.splitlines()) == 1
    with pytest.raises(ValueError):
        DynamicConv(64, kernel_size=0)


@pytest.mark.parametrize("K", [1, 3, 4])
@pytest.mark.parametrize("side", [0, 1])
def test_any_kernel_size_matches_naive_loop(K, side):
    """conv_kernel_size other than 2: tap j reads x[t - j], never across a block start."""
    for B, L, H, G, bs in SHAPES[:4]:
        x, base, dyn = rand_case(np.random.default_rng(K * 10 + side), B, L, H, G, K=K)
        np.testing.assert_allclose(ops(x, base, dyn, side, bs, G), naive(x, base, dyn, side, bs, G),
                                   rtol=1e-5, atol=1e-5)
    m = DynamicConv(32, 8, kernel_size=K)
    a = mx.random.normal((1, 6, 32))
    assert mx.array_equal(m(a, m.coefficients(a), side, 6), a).item()  # identity init for any K


def test_fused_backends_route_other_kernel_sizes_to_ops(monkeypatch):
    monkeypatch.setattr(conv, "kernel_backend", lambda: "metal")
    monkeypatch.setattr(conv, "_fused", lambda *a: pytest.fail("K=3 must not reach the 2-tap kernel"))
    x, base, dyn = rand_case(np.random.default_rng(0), 1, 5, 32, 8, K=3)
    np.testing.assert_allclose(ops(x, base, dyn, 1, 5, 8), naive(x, base, dyn, 1, 5, 8), rtol=1e-5, atol=1e-5)


def test_param_count_h2560():
    m = DynamicConv(2560, 16)
    n = sum(v.size for _, v in tree_flatten(m.parameters()))
    assert dict(tree_flatten(m.parameters()))["base_kernel"].shape == (2, 2, 2560)
    assert m.kernel_projection.weight.shape == (2 * 2 * 160, 2560)
    total = 5 * 2 * n  # 5 layers, attention_conv + mlp_conv
    assert abs(total - 16.5e6) < 0.1e6, total
