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
/* mlx-dflash BLAS shim: forward mlx's cblas gemm calls to scipy-openblas32. */
typedef int I;
#define GEMM(T, name) \
  extern void scipy_cblas_##name(I, I, I, I, I, I, T, const void*, I, const void*, I, T, void*, I); \
  void cblas_##name(I o, I ta, I tb, I m, I n, I k, T al, const void* a, I lda, \
                    const void* b, I ldb, T be, void* c, I ldc) \
  { scipy_cblas_##name(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
GEMM(float, sgemm)
GEMM(double, dgemm)
GEMM(const void*, cgemm)
"""

# What happened, for `mlx-dflash doctor`.
STATE = {"blas": "reference (mlx-cpu bundled)", "shim": None, "error": None, "threads": None}


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
    """Compile the shim once per OpenBLAS location (cached)."""
    key = hashlib.sha1((_SHIM_C + str(lib)).encode()).hexdigest()[:12]
    out = _cache_dir() / f"libmlx_dflash_blas-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(_SHIM_C)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(tmp), f"-L{lib.parent}",
         f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"],
        check=True, capture_output=True,
    )
    os.replace(tmp, out)  # atomic: concurrent first runs cannot see a half-written .so
    return out


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
    try:
        shim = build_shim(lib)
        blas = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
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
    STATE["blas"] = f"OpenBLAS {scipy_openblas32.__version__} (scipy-openblas32, via shim), {STATE['threads']} threads"
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
