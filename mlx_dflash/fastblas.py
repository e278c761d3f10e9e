"""Make mlx-cpu use an optimised BLAS on Linux.

The mlx[cpu] wheel links the netlib reference BLAS, which makes a 16-token
forward ~10-30x a 1-token forward, so speculative decoding can only lose. We
compile a tiny shim that exports the three `cblas_*gemm` symbols mlx imports
and forwards them to the (symbol-prefixed) OpenBLAS of `scipy-openblas32`, and
load it RTLD_GLOBAL *before* mlx: the dynamic linker then binds libmlx's gemm
calls to the shim. Nothing in mlx is patched. Must run before `import mlx`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

_SHIM_C = r"""
/* mlx-dflash BLAS shim: forward mlx's cblas gemm calls to scipy-openblas32,
   except few-row float products x @ W.T (the verify forward of w <= 8 tokens),
   which OpenBLAS runs ~2x slower than needed: it repacks W on every call. */
#include <stddef.h>
#include <string.h>
typedef int I;
#define GEMM(T, name) \
  extern void scipy_cblas_##name(I, I, I, I, I, I, T, const void*, I, const void*, I, T, void*, I);
GEMM(float, sgemm)
GEMM(double, dgemm)
GEMM(const void*, cgemm)
void cblas_dgemm(I o, I ta, I tb, I m, I n, I k, double al, const void* a, I lda,
                 const void* b, I ldb, double be, void* c, I ldc)
{ scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
void cblas_cgemm(I o, I ta, I tb, I m, I n, I k, const void* al, const void* a, I lda,
                 const void* b, I ldb, const void* be, void* c, I ldc)
{ scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }

/* Rows m <= MB of C = alpha A B^T + beta C, with A [M, K] and B [N, K] row-major.
   Each C[m, n] is one dot product in a fixed order (16 lanes, a tree, the tail),
   whatever M is: a row's result does not depend on how many rows came with it. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
#define MB 8
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline float hsum(v16 v) {
  v8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32); a += b;
  v4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char*)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static void small_sgemm_nt(I M, I N, I K, float alpha, const float* A, I lda,
                           const float* B, I ldb, float beta, float* C, I ldc) {
  I K16 = K & ~15;
  for (I n = 0; n < N; n += 2) {  /* two rows of B per pass: 2 * M independent sums */
    int two = n + 1 < N;
    const float* b0 = B + (size_t)n * ldb;
    const float* b1 = two ? b0 + ldb : b0;
    v16 acc0[MB], acc1[MB];
    for (int i = 0; i < MB; i++) { acc0[i] = (v16){0}; acc1[i] = (v16){0}; }
    for (I k = 0; k < K16; k += 16) {
      v16 w0 = ld(b0 + k), w1 = ld(b1 + k);
      for (int i = 0; i < MB; i++)
        if (i < M) { v16 x = ld(A + (size_t)i * lda + k); acc0[i] += x * w0; acc1[i] += x * w1; }
    }
    for (I i = 0; i < M; i++) {
      const float* x = A + (size_t)i * lda;
      float r0 = hsum(acc0[i]), r1 = hsum(acc1[i]);
      for (I k = K16; k < K; k++) { r0 += x[k] * b0[k]; r1 += x[k] * b1[k]; }
      float* c = C + (size_t)i * ldc + n;
      c[0] = alpha * r0 + (beta != 0 ? beta * c[0] : 0);  /* beta = 0: C may hold garbage */
      if (two) c[1] = alpha * r1 + (beta != 0 ? beta * c[1] : 0);
    }
  }
}

/* C = alpha A B + beta C with B [K, N] row-major: rows of B scaled into
   16-lane accumulators (attention's probs @ V). Each C[m, n] sums k in order. */
static void small_sgemm_nn(I M, I N, I K, float alpha, const float* A, I lda,
                           const float* B, I ldb, float beta, float* C, I ldc) {
  I n = 0;
  for (; n + 32 <= N; n += 32) {
    v16 acc0[MB], acc1[MB];
    for (int i = 0; i < MB; i++) { acc0[i] = (v16){0}; acc1[i] = (v16){0}; }
    for (I k = 0; k < K; k++) {
      v16 w0 = ld(B + (size_t)k * ldb + n), w1 = ld(B + (size_t)k * ldb + n + 16);
      for (int i = 0; i < MB; i++)
        if (i < M) { float x = A[(size_t)i * lda + k]; acc0[i] += x * w0; acc1[i] += x * w1; }
    }
    for (I i = 0; i < M; i++) {
      float* c = C + (size_t)i * ldc + n;
      for (int j = 0; j < 16; j++) {
        c[j] = alpha * acc0[i][j] + (beta != 0 ? beta * c[j] : 0);
        c[16 + j] = alpha * acc1[i][j] + (beta != 0 ? beta * c[16 + j] : 0);
      }
    }
  }
  for (; n < N; n++)
    for (I i = 0; i < M; i++) {
      float r = 0;
      for (I k = 0; k < K; k++) r += A[(size_t)i * lda + k] * B[(size_t)k * ldb + n];
      float* c = C + (size_t)i * ldc + n;
      c[0] = alpha * r + (beta != 0 ? beta * c[0] : 0);
    }
}

int mlx_dflash_small_gemm = 1;  /* 0: everything to OpenBLAS (A/B runs, tests) */
long mlx_dflash_small_gemm_calls = 0;

void cblas_sgemm(I o, I ta, I tb, I m, I n, I k, float al, const void* a, I lda,
                 const void* b, I ldb, float be, void* c, I ldc) {
  /* 101 RowMajor, 111 NoTrans, 112 Trans. A 1-row product of a big matrix stays
     with OpenBLAS's gemv, except for wide outputs (the LM head): ~3x faster here. */
  if (mlx_dflash_small_gemm && o == 101 && ta == 111 && m >= 1 && m <= MB && n > 0 && k > 0
      && (m >= 2 || n >= 2048 || (long)n * k <= 65536)) {
    if (tb == 112) {
      mlx_dflash_small_gemm_calls++;
      small_sgemm_nt(m, n, k, al, a, lda, b, ldb, be, c, ldc);
      return;
    }
    if (tb == 111 && (long)n * k <= 65536) {  /* attention-sized only: W @ x is rare */
      mlx_dflash_small_gemm_calls++;
      small_sgemm_nn(m, n, k, al, a, lda, b, ldb, be, c, ldc);
      return;
    }
  }
  scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
"""

# What happened, for `mlx-dflash doctor`.
STATE = {"blas": "reference (mlx-cpu bundled)", "shim": None, "error": None, "threads": None,
         "small_gemm": False}
_SHIM = None  # the loaded shim (ctypes.CDLL), for set_small_gemm


def _openblas_lib() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib = Path(scipy_openblas32.get_lib_dir()) / "libscipy_openblas.so"
    return lib if lib.exists() else None


def _cache_dir() -> Path:
    home = os.environ.get("MLX_DFLASH_HOME")
    if home:
        return Path(home) / "cache" / "blas"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlx-dflash")) / "blas"


def build_shim(lib: Path) -> Path:
    """Compile the shim once per OpenBLAS location and CPU (cached): -march=native
    gives the kernel this CPU's vector width (AVX-512 here, NEON on arm)."""
    key = hashlib.sha1((_SHIM_C + str(lib) + _cpu_id()).encode()).hexdigest()[:12]
    out = _cache_dir() / f"libmlx_dflash_blas-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(_SHIM_C)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O3", "-shared", "-fPIC", str(src), "-o", str(tmp), f"-L{lib.parent}",
           f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]
    try:
        subprocess.run(cmd[:2] + ["-march=native"] + cmd[2:], check=True, capture_output=True)
    except subprocess.CalledProcessError:  # a compiler without -march=native: generic vectors
        subprocess.run(cmd, check=True, capture_output=True)
    os.replace(tmp, out)  # atomic: concurrent first runs cannot see a half-written .so
    return out


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((l for l in info.splitlines() if l.startswith(("flags", "Features"))), "")


def set_small_gemm(on: bool) -> bool:
    """Route few-row float gemms to the shim's kernel (True) or all to OpenBLAS.
    Returns the previous setting; a no-op without the shim."""
    if _SHIM is None:
        return False
    flag = ctypes.c_int.in_dll(_SHIM, "mlx_dflash_small_gemm")
    prev, flag.value = bool(flag.value), int(on)
    STATE["small_gemm"] = bool(on)
    return prev


def small_gemm_calls() -> int:
    """How many gemms the kernel has run in this process (0 without the shim)."""
    return ctypes.c_long.in_dll(_SHIM, "mlx_dflash_small_gemm_calls").value if _SHIM else 0


def use_fast_blas() -> str:
    """Load the OpenBLAS shim on Linux (idempotent). Returns a description."""
    if STATE["shim"] or not sys.platform.startswith("linux"):
        if not sys.platform.startswith("linux"):
            STATE["blas"] = "Accelerate (macOS)" if sys.platform == "darwin" else "platform default"
        return STATE["blas"]
    if os.environ.get("MLX_DFLASH_REFERENCE_BLAS") == "1":  # for A/B measurements
        STATE["error"] = "disabled by MLX_DFLASH_REFERENCE_BLAS=1"
        return STATE["blas"]
    if "mlx.core" in sys.modules:
        STATE["error"] = "mlx was imported before mlx_dflash; import mlx_dflash first"
        return STATE["blas"]
    lib = _openblas_lib()
    if lib is None:
        STATE["error"] = "scipy-openblas32 is not installed (pip install scipy-openblas32)"
        return STATE["blas"]
    global _SHIM
    try:
        shim = build_shim(lib)
        blas = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        _SHIM = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
        STATE["error"] = f"could not build or load the BLAS shim ({type(e).__name__}); is a C compiler installed?"
        return STATE["blas"]
    import scipy_openblas32

    # Busy-waiting BLAS threads collapse when the cores are shared with other
    # work (seen: 7x slower decode steps); MLX_DFLASH_BLAS_THREADS=1 avoids it.
    threads = os.environ.get("MLX_DFLASH_BLAS_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        blas.scipy_openblas_set_num_threads(int(threads))
    STATE["threads"] = blas.scipy_openblas_get_num_threads()
    STATE["shim"] = str(shim)
    set_small_gemm(os.environ.get("MLX_DFLASH_SMALL_GEMM", "1") != "0")
    STATE["blas"] = (f"OpenBLAS {scipy_openblas32.__version__} (scipy-openblas32, via shim), "
                     f"{STATE['threads']} threads" + (", few-row kernel" if STATE["small_gemm"] else ""))
    return STATE["blas"]


def gemm_gflops(n: int = 384, reps: int = 5) -> float:
    """Measured sgemm throughput through mlx: tells which BLAS is really bound."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    dt = (time.perf_counter() - t0) / reps
    return 2 * n**3 / dt / 1e9
