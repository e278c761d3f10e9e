"""Make mlx-cpu use an optimised BLAS on Linux.

The mlx[cpu] wheel links the netlib reference BLAS, which makes a 16-token
forward ~10-30x a 1-token forward, so speculative decoding can only lose. We
compile a tiny shim (blas_shim.py) that exports the three `cblas_*gemm` symbols
mlx imports and forwards them to the (symbol-prefixed) OpenBLAS of
`scipy-openblas32`, and load it RTLD_GLOBAL *before* mlx: the dynamic linker
then binds libmlx's gemm calls to the shim. Nothing in mlx is patched. Must run
before `import mlx`.

Three choices are measured on this machine once and cached (`calibrate`): the
OpenBLAS thread count (more threads are not faster on a small shared CPU) and,
per row count m <= 16 and weight size class, whether the shim's few-row kernel
beats OpenBLAS and how many threads it runs (a 1-token step over a 600 MB head
reads memory faster on two cores; a 4 MB one does not gain).
Only float32 products reach BLAS: mlx-cpu runs bf16/fp16 matmuls in its own
code (and `load` widens them to float32 on the CPU), so the shim never sees them.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from .blas_shim import build, cache_dir, cpu_id, shim_key

# What happened, for `mlx-dflash doctor`.
STATE = {"blas": "reference (mlx-cpu bundled)", "shim": None, "error": None, "threads": None,
         "kernel_threads": None, "threads_from": None, "small_gemm": False, "route": None, "calibration": None}
_SHIM = None  # the loaded shim (ctypes.CDLL)
_BLAS = None  # the loaded OpenBLAS
MB = 16  # widest row count the kernel takes
# (n, k) measured for each size class of W; the last stands for the LM heads of
# published vocabularies (32k-150k rows: 130-620 MB in float32)
CLASS_SHAPES = [(128, 128), (256, 256), (512, 512), (1024, 1024), (4096, 1024), (8192, 1024), (32768, 1024)]
CLASS_MAX = [16384, 65536, 262144, 1048576, 4194304, 16777216, None]  # n * k bound of each size class
POOL_MIN = 1 << 19  # n * k below which the kernel runs on the calling thread alone (see the shim)
MEASURED_M = (1, 2, 4, 8, 16)
SPINNERS = 2  # busy processes during the busy OpenBLAS thread-count rounds
CALIBRATION_VERSION = 6  # bump when what is measured changes: old files are measured again


def _openblas_lib() -> Path | None:
    """scipy-openblas32's library, in the wheel's lib/ (its get_lib_dir()), found
    without importing the package: that reads package metadata, ~40 ms of every start."""
    spec = find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(spec.submodule_search_locations[0]) / "lib" / "libscipy_openblas.so"
    return lib if lib.exists() else None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- switches -------------------------------------------------------------------------


def set_small_gemm(on) -> object:
    """Route few-row float gemms: False (all to OpenBLAS), True (where this
    machine measured the kernel faster) or "all" (every shape the kernel takes:
    tests and A/B runs). Returns the previous setting; a no-op without the shim."""
    if _SHIM is None:
        return False
    flag = ctypes.c_int.in_dll(_SHIM, "mlx_dflash_small_gemm")
    prev = {0: False, 1: True, 2: "all"}[flag.value]
    flag.value = 2 if on == "all" else int(bool(on))
    STATE["small_gemm"] = on if on == "all" else bool(on)
    return prev


def small_gemm_calls() -> int:
    """How many gemms the kernel has run in this process (0 without the shim)."""
    return ctypes.c_long.in_dll(_SHIM, "mlx_dflash_small_gemm_calls").value if _SHIM else 0


def size_class(n: int, k: int) -> int:
    """The size class of an [n, k] weight (what the shim's tables are indexed by)."""
    return next((i for i, b in enumerate(CLASS_MAX) if b is None or n * k <= b), len(CLASS_MAX) - 1)


def _table(kernel, n: int) -> list:
    """Kernel threads as a [MB + 1][class] table, from an int (everywhere), a
    list by row count (every class alike) or a table."""
    if not isinstance(kernel, (list, tuple)):
        return [[int(kernel or n)] * len(CLASS_MAX) for _ in range(MB + 1)]
    return [list(r) if isinstance(r, (list, tuple)) else [int(r)] * len(CLASS_MAX) for r in kernel]


def set_threads(n: int, kernel=None) -> None:
    """Threads for OpenBLAS, and for the few-row kernel: `kernel` an int, a list
    of MB + 1 counts by row count (index 0 unused), or a table of them by row
    count and size class (what calibrate measures); default: `n`."""
    if _SHIM is None:
        return
    _BLAS.scipy_openblas_set_num_threads(int(n))
    per = _table(kernel, n)
    ctypes.c_int.in_dll(_SHIM, "mlx_dflash_threads").value = int(n)
    arr = (ctypes.c_ubyte * len(CLASS_MAX) * (MB + 1)).in_dll(_SHIM, "mlx_dflash_kthreads")
    for m in range(MB + 1):
        for c in range(len(CLASS_MAX)):
            arr[m][c] = max(1, min(64, int(per[m][c])))
    STATE["threads"] = int(n)
    STATE["kernel_threads"] = [[int(arr[m][c]) for c in range(len(CLASS_MAX))] for m in range(MB + 1)]


def kernel_threads_at(m: int, n: int, k: int) -> int:
    """Threads the kernel runs an [m, k] @ [n, k].T product on now (1 below the pool's size)."""
    if _SHIM is None or not 1 <= m <= MB or n * k < POOL_MIN:
        return 1
    return STATE["kernel_threads"][m][size_class(n, k)]


def _rows_text(per: list) -> str:
    runs = []  # [threads, first row, last row]
    for m in range(1, MB + 1):
        if runs and runs[-1][0] == per[m]:
            runs[-1][2] = m
        else:
            runs.append([per[m], m, m])
    return ", ".join(f"{t} thread{'s' * (t > 1)} at {a}{'' if a == b else f'-{b}'} row{'s' * (b > 1)}"
                     for t, a, b in runs)


def _size_text(n_k: int) -> str:
    return f"{n_k >> 20}M" if n_k >= 1 << 20 else f"{n_k >> 10}K"


def kernel_threads_text(table=None) -> str:
    """'1 thread at 1 row, 2 threads at 2-16 rows' where every weight size the
    pool runs on is alike; else per range of weight sizes (elements of W)."""
    table = table or STATE["kernel_threads"]
    if not table:
        return "none"
    table = _table(table, 1)
    first = next(c for c, b in enumerate(CLASS_MAX) if b is None or b > POOL_MIN)  # smaller: one thread
    groups = []  # [column, first class, last class]
    for c in range(first, len(CLASS_MAX)):
        col = [table[m][c] for m in range(MB + 1)]
        if groups and groups[-1][0] == col:
            groups[-1][2] = c
        else:
            groups.append([col, c, c])
    if len(groups) == 1:
        return _rows_text(groups[0][0])
    parts = []
    for col, a, b in groups:
        lo = POOL_MIN if a == first else CLASS_MAX[a - 1]
        rng = f"W over {_size_text(lo)}" + (f" up to {_size_text(CLASS_MAX[b])}" if CLASS_MAX[b] else "")
        parts.append(f"{rng}: {_rows_text(col)}")
    return "; ".join(parts)


def _route_array():
    return (ctypes.c_ubyte * len(CLASS_MAX) * (MB + 1)).in_dll(_SHIM, "mlx_dflash_route")


def set_route(route) -> None:
    """route[m][size class] = 1 where the kernel takes an m-row product."""
    arr = _route_array()
    for m in range(MB + 1):
        for c in range(len(CLASS_MAX)):
            arr[m][c] = int(bool(route[m][c]))
    STATE["route"] = [list(r) for r in route]


def routed(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] @ [n, k].T product goes to the kernel now."""
    if _SHIM is None or not STATE["small_gemm"] or not 1 <= m <= MB:
        return False
    if STATE["small_gemm"] == "all":
        return True
    return bool(_route_array()[m][size_class(n, k)])


def fastest_threads(step, reps: int = 7, apply: bool = False) -> dict:
    """Median seconds of `step()` (one decode step of a loaded model) with the
    few-row kernel's threads as measured for this machine, on 1 thread and on
    every core (up to 8), timed round-robin after a warm-up round. With `apply`
    the fastest stays set (a benchmark's plain baseline runs at its fastest
    configuration, and so does everything compared with it). {} without the shim
    or with one core."""
    if _SHIM is None or _cpus() < 2:
        return {}
    threads, measured = STATE["threads"], STATE["kernel_threads"]
    many = min(_cpus(), 8)
    configs = {"measured": measured, "1 thread": 1, f"{many} threads": many}
    times = {k: [] for k in configs}
    try:
        for _ in range(reps + 1):
            for k, kt in configs.items():
                set_threads(threads, kt)
                t0 = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t0)
    finally:
        set_threads(threads, measured)
    ms = {k: round(sorted(v[1:])[reps // 2] * 1e3, 2) for k, v in times.items()}
    best = min(ms, key=ms.get)
    if ms[best] > 0.97 * ms["measured"]:  # within noise: keep what was measured
        best = "measured"
    if apply:
        set_threads(threads, configs[best])
    return {"ms": ms, "fastest": best}


# -- measurement ------------------------------------------------------------------------


class _Bench:
    """Times the shim's sgemm on a 64 MB rotation of weights, so that every
    size class reads its weights from memory as a real model's layers do."""

    def __init__(self, total: int = 16 << 20):  # 64 MB: twice the L3 here (at least the largest class)
        import numpy as np

        self.np = np
        self.w = np.full(max(total, max(n * k for n, k in CLASS_SHAPES)), 0.01, np.float32)
        self.a = np.full(max(32, MB) * max(k for _, k in CLASS_SHAPES), 0.02, np.float32)
        self.c = np.zeros(max(32, MB) * max(n for n, _ in CLASS_SHAPES), np.float32)  # (32 rows: the thread test)
        f = _SHIM.cblas_sgemm
        f.restype = None
        f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        self.f = f
        self.flag = ctypes.c_int.in_dll(_SHIM, "mlx_dflash_small_gemm")

    def sweep(self, m: int, n: int, k: int, kernel: bool) -> float:
        """Seconds per product, over one pass through the rotation."""
        copies = max(1, self.w.size // (n * k))
        self.flag.value = 2 if kernel else 0
        a, c, w0 = self.a.ctypes.data, self.c.ctypes.data, self.w.ctypes.data
        t0 = time.perf_counter()
        for i in range(copies):
            self.f(101, 111, 112, m, n, k, 1.0, a, k, w0 + 4 * i * n * k, k, 0.0, c, n)
        return (time.perf_counter() - t0) / copies

    def pair(self, m: int, n: int, k: int, reps: int = 5):
        """(kernel, OpenBLAS) seconds, alternated so that load drift hits both;
        medians: this VM's memory bandwidth swings 2x for seconds at a time (seen:
        a best-of-3 that sent 8-row products to OpenBLAS, 3x slower there)."""
        tk, to = [], []
        for _ in range(reps):
            tk.append(self.sweep(m, n, k, True))
            to.append(self.sweep(m, n, k, False))
        return sorted(tk)[reps // 2], sorted(to)[reps // 2]


def _measure_route(b: _Bench) -> tuple:
    """route[m][class] from kernel vs OpenBLAS times at m in MEASURED_M; an m in
    between takes the kernel only where both measured neighbours do."""
    times, meas = {}, {}
    for m in MEASURED_M:
        for ci, (n, k) in enumerate(CLASS_SHAPES):
            tk, to = b.pair(m, n, k)
            times[f"{m},{n}x{k}"] = [round(tk * 1e6, 1), round(to * 1e6, 1)]
            meas[(m, ci)] = tk < 0.95 * to  # a clear win only
    route = [[0] * len(CLASS_SHAPES) for _ in range(MB + 1)]
    for m in range(1, MB + 1):
        lo = max(x for x in MEASURED_M if x <= m)
        hi = min(x for x in MEASURED_M if x >= m)
        for ci in range(len(CLASS_SHAPES)):
            route[m][ci] = int(meas[(lo, ci)] and meas[(hi, ci)])
    return route, times


def _spin(n: int) -> list:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.05)
    return procs


def _stop(procs) -> None:
    for p in procs or []:
        p.kill()
        p.wait()


def _measure_threads(b: _Bench, cpus: int, rounds: int = 8) -> tuple:
    """Fastest OpenBLAS thread count, in alternating rounds, most of them with
    two cores kept busy by other processes, on a decode step (m = 1), a verify
    (m = 8) and a 32-row product (prefill) on the largest weights. Judged on the
    slowest round, and more threads must win by >= 10%: an OpenBLAS thread that
    waits for a busy core stalls the whole product (seen here: 2 threads 1.3-13x
    slower than 1)."""
    n, k = CLASS_SHAPES[-2]  # a decoder layer's largest weight
    cands = sorted({1, min(cpus, 8)})
    tb = {t: [] for t in cands}
    spinner = None
    try:
        for r in range(rounds):
            if r == 2 and len(cands) > 1:  # 2 quiet rounds, then the busy ones
                spinner = _spin(SPINNERS)
            for t in cands:
                set_threads(t)
                tb[t].append(b.sweep(1, n, k, False) + b.sweep(8, n, k, False) + 4 * b.sweep(32, 1024, 1024, False))
    finally:
        _stop(spinner)
    score = {t: max(v) for t, v in tb.items()}
    best = min(score, key=score.get)
    if best != 1 and score[best] > 0.9 * score[1]:
        best = 1
    return best, {str(t): round(x * 1e3, 3) for t, x in score.items()}


def _measure_kernel_threads(b: _Bench, cpus: int, blas_threads: int, rounds: int = 10) -> tuple:
    """Kernel threads by row count and weight size class: more than 1 where
    they win by >= 10% (median of quiet rounds) and lose at most 10% (median of
    rounds where another process holds a core). The kernel's threads sleep
    between calls and take small chunks of W from a shared counter, so one that
    waits for a busy core delays a product by one chunk. Measured at MEASURED_M
    on each class the pool runs on (the classes below run on one thread); a row
    count in between takes more threads only where both neighbours do."""
    many = min(cpus, 8)
    per = [[1] * len(CLASS_MAX) for _ in range(MB + 1)]
    if many == 1:
        return per, None
    classes = [c for c, (n, k) in enumerate(CLASS_SHAPES) if n * k >= POOL_MIN]
    t_ = {(m, c, t, busy): [] for m in MEASURED_M for c in classes for t in (1, many) for busy in (0, 1)}
    spinner = None
    try:
        for r in range(rounds):
            busy = int(r >= rounds // 2)
            if busy and spinner is None:
                spinner = _spin(1)
            for m in MEASURED_M:
                for c in classes:
                    n, k = CLASS_SHAPES[c]
                    for t in (1, many):
                        set_threads(blas_threads, t)
                        t_[(m, c, t, busy)].append(b.sweep(m, n, k, True))
    finally:
        _stop(spinner)

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    wins = {(m, c): med(t_[(m, c, many, 0)]) < 0.9 * med(t_[(m, c, 1, 0)])
            and med(t_[(m, c, many, 1)]) <= 1.1 * med(t_[(m, c, 1, 1)])
            for m in MEASURED_M for c in classes}
    for m in range(1, MB + 1):
        lo = max(x for x in MEASURED_M if x <= m)
        hi = min(x for x in MEASURED_M if x >= m)
        for c in classes:
            per[m][c] = many if wins[(lo, c)] and wins[(hi, c)] else 1
    per[0] = list(per[1])
    times = {f"{m},{CLASS_SHAPES[c][0]}x{CLASS_SHAPES[c][1]}": {
        f"{t} thread{'s' if t > 1 else ''}, {'busy' if busy else 'quiet'}": round(med(t_[(m, c, t, busy)]) * 1e3, 3)
        for t in (1, many) for busy in (0, 1)} for m in MEASURED_M for c in classes}
    return per, times


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _calibration_path(lib: Path) -> Path:
    return cache_dir() / f"calibration-{shim_key(lib)}-{_cpus()}cpu.json"


def _fixed_threads() -> tuple:
    """(MLX_DFLASH_BLAS_THREADS or None, the calibration's key for it): a fixed
    thread count has its own routing, measured for it."""
    env_t = os.environ.get("MLX_DFLASH_BLAS_THREADS", "")
    fixed = int(env_t) if env_t.isdigit() and int(env_t) > 0 else None
    return fixed, f"t{fixed}" if fixed else "auto"


def calibrate(force: bool = False, log=None, measure: bool = True) -> dict:
    """Measure (or read back) the thread count and the kernel's routing for this
    machine, and apply them. Cached next to the shim; concurrent first starts
    wait for one measurement (file lock). MLX_DFLASH_BLAS_THREADS=N fixes the
    thread count (the routing is then measured for N). With `measure` False
    (importing the package) nothing is measured: a missing calibration runs
    one thread with every product on OpenBLAS until `prepare()` measures it."""
    lib = _openblas_lib()
    path = _calibration_path(lib)
    fixed, key = _fixed_threads()

    def read():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if data.get("version") == CALIBRATION_VERSION else {}

    def stale(data):  # measured on a busy machine, quiet now: measure again (seen: 1 thread chosen at load 2.9)
        was = (data.get(key) or {}).get("load_average") or [0]
        return key not in data or (was[0] > 0.5 * _cpus() and _load1() < 0.25 * _cpus())

    data = {} if force else read()
    if not measure and key not in data:
        data = {key: {"threads": fixed or 1, "kernel_threads": fixed or 1, "route": [[0] * len(CLASS_MAX)] * (MB + 1),
                      "date_utc": None, "note": "not measured yet: run `mlx-dflash doctor`"}}
    elif measure and stale(data):
        from filelock import FileLock, Timeout  # here: ~50 ms that a start which only reads never pays

        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(path) + ".lock", timeout=300):
                data = {} if force else read()
                if stale(data):
                    if log:
                        log("measuring BLAS threads and the few-row kernel on this machine (once)...")
                    b = _Bench()
                    prev = STATE["small_gemm"]
                    if fixed:
                        threads, kthreads, scores, ktimes = fixed, [fixed] * (MB + 1), None, None
                    else:
                        threads, scores = _measure_threads(b, _cpus())
                        kthreads, ktimes = _measure_kernel_threads(b, _cpus(), threads)
                        scores = {"openblas": scores}
                    set_threads(threads, kthreads)
                    route, times = _measure_route(b)
                    set_small_gemm(prev)
                    data = read() if not force else {}
                    data.update({"version": CALIBRATION_VERSION, key: {
                        "threads": threads, "kernel_threads": kthreads, "thread_scores_ms": scores,
                        "kernel_thread_times_ms": ktimes,
                        "route": route, "times_us": times,
                        "cpus": _cpus(), "cpu": cpu_id()[:80],
                        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}})
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(data, indent=1))
                    os.replace(tmp, path)
        except Timeout:  # someone else is stuck measuring: run safe, measure nothing
            data = {key: {"threads": fixed or 1, "kernel_threads": fixed or 1, "route": [[0] * len(CLASS_MAX)] * (MB + 1),
                          "date_utc": None, "note": "calibration lock timed out"}}
    cal = data[key]
    env_k = os.environ.get("MLX_DFLASH_KERNEL_THREADS", "")  # the kernel's alone, at every row count
    set_threads(cal["threads"], int(env_k) if env_k.isdigit() and int(env_k) > 0 else cal.get("kernel_threads"))
    set_route(cal["route"])
    STATE["threads_from"] = ("MLX_DFLASH_BLAS_THREADS" if fixed
                             else f"measured fastest on this machine ({cal.get('date_utc')} UTC)")
    STATE["calibration"] = {"file": str(path), **{k: v for k, v in cal.items() if k != "times_us"}}
    STATE["blas"] = _describe()
    return cal


def _openblas_version() -> str:
    """The loaded OpenBLAS's version, from its own config string ("OpenBLAS 0.3.x ...");
    importing scipy_openblas32 for its __version__ would read package metadata at every start."""
    get = _BLAS.scipy_openblas_get_config
    get.restype = ctypes.c_char_p
    words = get().decode("utf8", "replace").split()
    return words[1] if len(words) > 1 else "?"


def _describe() -> str:
    mode = STATE["small_gemm"]
    kern = ("few-row kernel off" if not mode else "few-row kernel on every shape" if mode == "all"
            else f"few-row kernel on {sum(map(sum, STATE['route'] or []))} of {MB * len(CLASS_MAX)} "
                 "(rows, size) classes")
    return (f"OpenBLAS {_openblas_version()} (scipy-openblas32, via shim), "
            f"{STATE['threads']} thread{'s' if STATE['threads'] != 1 else ''}, {kern}"
            + (f" (threads: {kernel_threads_text()})"
               if mode and {t for r in STATE["kernel_threads"] for t in r} != {STATE["threads"]} else ""))


# -- loading ----------------------------------------------------------------------------


def ready() -> bool:
    """Whether the shim is built and this machine measured for the thread
    setting in force (what `prepare` does once); a cheap file check. Always
    True where there is no shim to build."""
    if not sys.platform.startswith("linux") or os.environ.get("MLX_DFLASH_REFERENCE_BLAS") == "1":
        return True
    lib = _openblas_lib()
    if lib is None:
        return True
    built = (cache_dir() / f"libmlx_dflash_blas-{shim_key(lib)}.so").exists()
    try:
        data = json.loads(_calibration_path(lib).read_text())
    except (OSError, ValueError):
        data = {}
    return built and data.get("version") == CALIBRATION_VERSION and _fixed_threads()[1] in data


def use_fast_blas(prepare: bool = False) -> str:
    """Load the OpenBLAS shim on Linux (idempotent). Returns a description.

    Importing the package calls this with `prepare` False: a shim already
    built is loaded and its calibration read; nothing is compiled, measured,
    written or started. `prepare=True` (`prepare()`: doctor, the CLI's first
    start, the tests) also builds the shim and measures this machine."""
    if STATE["shim"] or not sys.platform.startswith("linux"):
        if not sys.platform.startswith("linux"):
            STATE["blas"] = "Accelerate (macOS)" if sys.platform == "darwin" else "platform default"
        elif prepare:
            calibrate()
        return STATE["blas"]
    if os.environ.get("MLX_DFLASH_REFERENCE_BLAS") == "1":  # for A/B measurements
        STATE["error"] = "disabled by MLX_DFLASH_REFERENCE_BLAS=1"
        return STATE["blas"]
    late = "mlx.core" in sys.modules  # mlx is bound already: a shim loaded now is only measured
    if late and not prepare:
        STATE["error"] = "mlx was imported before mlx_dflash; import mlx_dflash first"
        return STATE["blas"]
    lib = _openblas_lib()
    if lib is None:
        STATE["error"] = "scipy-openblas32 is not installed (pip install scipy-openblas32)"
        return STATE["blas"]
    shim = cache_dir() / f"libmlx_dflash_blas-{shim_key(lib)}.so"
    if not prepare and not shim.exists():
        STATE["error"] = "the fast BLAS is not built yet: run `mlx-dflash doctor` (once per machine)"
        return STATE["blas"]
    # OpenBLAS threads spin ~0.1 s after each call by default, which stalls a
    # shared CPU (seen: 7x slower decode steps); 2^4 cycles is its minimum.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    global _SHIM, _BLAS
    try:
        shim = build(lib) if prepare else shim
        _BLAS = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        _SHIM = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
        STATE["error"] = f"could not build or load the BLAS shim ({type(e).__name__}); is a C compiler installed?"
        return STATE["blas"]
    except Exception as e:  # a lock that timed out: run on the reference BLAS rather than fail
        STATE["error"] = f"could not build the BLAS shim ({type(e).__name__}: {e})"
        return STATE["blas"]
    STATE["shim"] = str(shim)
    if late:
        STATE["error"] = "mlx was imported before the shim was built: it is used from the next start"
    mode = os.environ.get("MLX_DFLASH_SMALL_GEMM", "1")
    set_small_gemm("all" if mode == "all" else mode != "0")
    calibrate(measure=prepare)
    return STATE["blas"]


def prepare(log=None) -> str:
    """Build the shim and measure this machine (once; a calibration taken on a
    busy machine is measured again when it is quiet). Returns a description."""
    out = use_fast_blas(prepare=True)
    if log is not None and STATE["error"]:
        log(STATE["error"])
    return out


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


if __name__ == "__main__":  # `python -m mlx_dflash.platform.fastblas`: what `prepare()` does, for installers
    print(prepare(log=lambda m: print(f"mlx-dflash: {m}", file=sys.stderr)))
