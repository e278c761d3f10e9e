"""The BLAS shim's few-row kernel (mlx_dflash/platform/fastblas.py, blas_shim.py) against
numpy, its routing, threads and concurrent first builds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_dflash.platform import fastblas
import mlx.core as mx

pytestmark = pytest.mark.skipif(fastblas.STATE["shim"] is None, reason="no BLAS shim on this platform")


@pytest.fixture
def kernel():
    prev = fastblas.set_small_gemm("all")
    yield
    fastblas.set_small_gemm(prev)


@pytest.fixture
def two_threads():
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    fastblas.set_threads(2)
    yield
    fastblas.set_threads(*prev)


def _ref(a, b):
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


# (M, N, K): K and N off the 16-lane grid, odd N, the LM-head and attention shapes
SHAPES = [(1, 4096, 384), (1, 257, 96), (2, 1024, 384), (3, 33, 17), (5, 7, 100),
          (8, 384, 1024), (8, 1, 16), (7, 2049, 31), (4, 96, 300), (9, 50, 40), (12, 1000, 77),
          (16, 2048, 256), (13, 5, 1024), (16, 3, 5)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout", ["x@W.T", "x@W"])
def test_kernel_matches_numpy(kernel, M, N, K, layout):
    rng = np.random.default_rng(M * 1000 + N + K)
    a = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K) if layout == "x@W.T" else (K, N), dtype=np.float32)
    before = fastblas.small_gemm_calls()
    out = mx.array(a) @ (mx.array(w).T if layout == "x@W.T" else mx.array(w))
    ref = _ref(a, w.T if layout == "x@W.T" else w)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-4, atol=1e-4 * np.sqrt(K))
    if layout == "x@W.T" or N * K <= 65536:  # the shapes the kernel takes
        assert fastblas.small_gemm_calls() > before


def test_alpha_beta_and_broadcast_rows(kernel):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((6, 40), dtype=np.float32)
    w = rng.standard_normal((50, 40), dtype=np.float32)
    c = rng.standard_normal((6, 50), dtype=np.float32)
    out = mx.addmm(mx.array(c), mx.array(a), mx.array(w).T, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(np.array(out), 0.5 * _ref(a, w.T) + 2.0 * c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, "mixed"])
@pytest.mark.parametrize("K", [384, 1027])
def test_a_row_does_not_depend_on_its_batch(kernel, threads, K):
    """Each output is one dot product in a fixed order: verifying w tokens gives a row
    bit-identical to the same row computed alone, for every batch size 1-16 (each
    takes its own register blocking), with one thread, several (the product is
    large enough for the pool) or a different count per row count; K off the
    8-lane grid exercises the tail and the k-chunks."""
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    fastblas.set_threads(1, [1, 1] + [2, 1] * 7 + [2] if threads == "mixed" else threads)
    try:
        rng = np.random.default_rng(2)
        a = mx.array(rng.standard_normal((16, K), dtype=np.float32))
        w = mx.array(rng.standard_normal((1600, K), dtype=np.float32))
        full = np.array(a @ w.T)
        for i in (0, 3, 7, 8, 15):
            assert np.array_equal(np.array(a[i:i + 1] @ w.T), full[i:i + 1])
        for m in range(2, 17):
            lo = (3 * m) % (17 - m)
            assert np.array_equal(np.array(a[lo:lo + m] @ w.T), full[lo:lo + m]), m
        np.testing.assert_allclose(full, _ref(np.array(a), np.array(w).T), rtol=1e-4, atol=1e-3)
    finally:
        fastblas.set_threads(*prev)


def test_kernel_threads_by_row_count():
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    n_cls = len(fastblas.CLASS_MAX)
    try:
        fastblas.set_threads(1, [1, 1] + [2] * 15)
        assert fastblas.STATE["kernel_threads"][1] == [1] * n_cls and fastblas.STATE["kernel_threads"][16] == [2] * n_cls
        assert fastblas.kernel_threads_text() == "1 thread at 1 row, 2 threads at 2-16 rows"
        fastblas.set_threads(2)
        assert fastblas.STATE["kernel_threads"] == [[2] * n_cls] * (fastblas.MB + 1)
        assert fastblas.kernel_threads_text() == "2 threads at 1-16 rows"
    finally:
        fastblas.set_threads(*prev)


def test_kernel_threads_by_row_count_and_weight_size():
    """The 1-token step over an LM head takes two threads while a layer's
    weights of a few MB keep one: the table is per row count and size class,
    and the shim runs each product on its own class's count."""
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    n_cls = len(fastblas.CLASS_MAX)
    big = n_cls - 1
    table = [[2 if (c == big or m >= 2) else 1 for c in range(n_cls)] for m in range(fastblas.MB + 1)]
    try:
        fastblas.set_threads(1, table)
        assert fastblas.kernel_threads_at(1, 151936, 1024) == 2  # a Qwen3 head
        assert fastblas.kernel_threads_at(1, 3072, 1024) == 1  # an MLP projection
        assert fastblas.kernel_threads_at(4, 3072, 1024) == 2
        assert fastblas.kernel_threads_at(1, 64, 64) == 1  # below the pool's size: always one
        text = fastblas.kernel_threads_text()
        assert text == ("W over 512K up to 16M: 1 thread at 1 row, 2 threads at 2-16 rows; "
                        "W over 16M: 2 threads at 1-16 rows"), text
        rng = np.random.default_rng(7)
        a = mx.array(rng.standard_normal((3, 1024), dtype=np.float32))
        w = mx.array(rng.standard_normal((20000, 1024), dtype=np.float32))  # 20M: the two-thread class at 1 row
        full = np.array(a @ w.T)
        assert np.array_equal(np.array(a[1:2] @ w.T), full[1:2])  # 2 threads at 1 row, as at 3 rows
    finally:
        fastblas.set_threads(*prev)


def test_threaded_kernel_matches_numpy(kernel, two_threads):
    rng = np.random.default_rng(5)
    for m, n, k in ((1, 3000, 1024), (8, 4099, 200), (16, 2048, 1000)):  # n * k >= 2^19: the pool runs
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        out = np.array(mx.array(a) @ mx.array(w).T)
        np.testing.assert_allclose(out, _ref(a, w.T), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_routing_follows_the_measured_table():
    """Mode True sends a product to the kernel only where the table says the kernel
    won on this machine; mode False never; the table is what calibrate() stored."""
    cal = fastblas.STATE["calibration"]
    assert cal is not None and len(cal["route"]) == fastblas.MB + 1 and cal["threads"] >= 1
    saved = [list(r) for r in fastblas.STATE["route"]]
    prev = fastblas.set_small_gemm(True)
    rng = np.random.default_rng(4)
    a = mx.array(rng.standard_normal((4, 64), dtype=np.float32))
    w = mx.array(rng.standard_normal((64, 64), dtype=np.float32))  # size class 0
    try:
        for on in (0, 1):
            fastblas.set_route([[on] * len(fastblas.CLASS_MAX) for _ in range(fastblas.MB + 1)])
            assert fastblas.routed(4, 64, 64) == bool(on)
            n = fastblas.small_gemm_calls()
            mx.eval(a @ w.T)
            assert fastblas.small_gemm_calls() == n + on
        fastblas.set_route([[int(m == 4) for _ in fastblas.CLASS_MAX] for m in range(fastblas.MB + 1)])
        assert fastblas.routed(4, 64, 64) and not fastblas.routed(5, 64, 64)
        assert not fastblas.routed(17, 64, 64)  # wider than the kernel: OpenBLAS
    finally:
        fastblas.set_route(saved)
        fastblas.set_small_gemm(prev)


def test_switch_routes_to_openblas():
    rng = np.random.default_rng(3)
    a = mx.array(rng.standard_normal((4, 64), dtype=np.float32))
    w = mx.array(rng.standard_normal((64, 64), dtype=np.float32))
    prev = fastblas.set_small_gemm(False)
    try:
        n = fastblas.small_gemm_calls()
        off = np.array(a @ w.T)
        assert fastblas.small_gemm_calls() == n
        fastblas.set_small_gemm("all")
        on = np.array(a @ w.T)
        assert fastblas.small_gemm_calls() == n + 1
    finally:
        fastblas.set_small_gemm(prev)
    np.testing.assert_allclose(on, off, rtol=1e-5, atol=1e-5)


_PREPARE = "from mlx_dflash.platform import fastblas\nfastblas.prepare()\n"
_IMPORT = ("import mlx_dflash, mlx.core as mx\n"
           "from mlx_dflash.platform import fastblas\n"
           "assert fastblas.STATE['shim'], fastblas.STATE\n"
           "x = mx.ones((4, 64)) @ mx.ones((64, 64)).T\n"
           "print(fastblas.STATE['threads'], float(x[0, 0]))\n")


@pytest.mark.slow
def test_concurrent_first_starts_do_not_race(tmp_path):
    """Six processes prepare the fast BLAS at once with an empty shim folder: one
    builds and measures under the file lock, the others wait and load the same
    library (7 of 40 simultaneous first starts used to fail with an undefined
    symbol); a later import then loads it before mlx."""
    env = {**os.environ, "MLX_DFLASH_BLAS_DIR": str(tmp_path / "blas"), "MLX_DFLASH_BLAS_THREADS": "1"}
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", _PREPARE], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert len(list((tmp_path / "blas").glob("libmlx_dflash_blas-*.so"))) == 1
    assert not list((tmp_path / "blas").glob("*.tmp")) and not list((tmp_path / "blas").glob("*.c"))
    cal = json.loads(next((tmp_path / "blas").glob("calibration-*.json")).read_text())
    assert cal["t1"]["threads"] == 1 and len(cal["t1"]["route"]) == fastblas.MB + 1
    out = subprocess.run([sys.executable, "-c", _IMPORT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "64.0"]


_NO_WORK = ("import subprocess, os\n"
            "def refuse(*a, **k):\n"
            "    raise AssertionError(f'a process was started at import: {a[:1]}')\n"
            "subprocess.Popen.__init__ = refuse\n"
            "os.fork = refuse\n"
            "import mlx_dflash\n"
            "from mlx_dflash.platform import fastblas\n"
            "assert fastblas.STATE['shim'] is None and 'doctor' in fastblas.STATE['error'], fastblas.STATE\n"
            "assert not fastblas.ready()\n")


def test_importing_the_package_builds_measures_and_writes_nothing(tmp_path):
    """A fresh machine (empty shim folder, cache and home): importing mlx_dflash
    compiles nothing, starts no process and writes no file; it runs on the
    reference BLAS and says how to prepare the fast one."""
    dirs = {k: tmp_path / k for k in ("blas", "home", "cache", "tmp")}
    for d in dirs.values():
        d.mkdir()
    env = {**os.environ, "MLX_DFLASH_BLAS_DIR": str(dirs["blas"]), "MLX_DFLASH_HOME": str(dirs["home"]),
           "XDG_CACHE_HOME": str(dirs["cache"]), "TMPDIR": str(dirs["tmp"])}
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _NO_WORK], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [p for d in dirs.values() for p in d.rglob("*")] == []


def test_calibration_from_a_busy_machine_is_measured_again_when_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_BLAS_DIR", str(tmp_path))
    monkeypatch.setenv("MLX_DFLASH_BLAS_THREADS", "1")  # routing only: quick
    monkeypatch.setattr(fastblas, "_measure_route", lambda b: ([[1] * len(fastblas.CLASS_MAX)] * (fastblas.MB + 1), {}))
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"], [list(r) for r in fastblas.STATE["route"]], dict(fastblas.STATE)
    try:
        path = fastblas._calibration_path(fastblas._openblas_lib())
        for load, again in ((0.1, False), (3.0, True)):
            path.write_text(json.dumps({"version": fastblas.CALIBRATION_VERSION, "t1": {
                "threads": 1, "kernel_threads": 1, "route": [[0] * len(fastblas.CLASS_MAX)] * (fastblas.MB + 1),
                "load_average": [load], "date_utc": "old"}}))
            monkeypatch.setattr(fastblas, "_load1", lambda: 0.2)
            cal = fastblas.calibrate()
            assert (cal["date_utc"] != "old") == again
    finally:
        fastblas.set_threads(*prev[:2])
        fastblas.set_route(prev[2])
        fastblas.STATE.update(prev[3])


class _FakeBench:
    """Kernel vs OpenBLAS times by (m, n*k): the kernel wins for m <= 4 on every
    size, for m = 8 only on small weights, never for m = 16."""

    def pair(self, m, n, k, reps=3):
        small = n * k <= 262144
        wins = m <= 4 or (m == 8 and small)
        return (1.0, 2.0) if wins else (2.0, 1.0)


class _FakeThreadBench:
    """Kernel seconds: 2 threads halve 8 and 16 rows on a quiet machine; at 1 row they
    win quietly but lose 30% when another process holds a core, except on the
    largest weights (memory-bound: two cores read faster, busy or not)."""

    def sweep(self, m, n, k, kernel):
        t = fastblas.STATE["kernel_threads"][m][fastblas.size_class(n, k)]
        busy = len(_FakeThreadBench.spinning) > 0
        if t == 1:
            return 1.0
        if n * k > fastblas.CLASS_MAX[-2]:
            return 0.6
        return {1: 1.3 if busy else 0.7, 2: 1.0, 4: 0.95}.get(m, 1.05 if busy else 0.5)

    spinning = []


def test_kernel_threads_are_measured_per_row_count(monkeypatch):
    monkeypatch.setattr(fastblas, "_spin", lambda n: _FakeThreadBench.spinning.append(n) or ["x"])
    monkeypatch.setattr(fastblas, "_stop", lambda procs: _FakeThreadBench.spinning.clear())
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    try:
        per, times = fastblas._measure_kernel_threads(_FakeThreadBench(), 2, 1)
    finally:
        fastblas.set_threads(*prev)
    layer, head = len(fastblas.CLASS_MAX) - 2, len(fastblas.CLASS_MAX) - 1
    col = [per[m][layer] for m in range(fastblas.MB + 1)]
    assert col[1] == 1  # slower when a core is busy
    assert col[2] == col[4] == 1  # no clear win
    assert col[5] == col[7] == 1 and col[8] == col[12] == col[16] == 2  # between 4 and 8: both must win
    assert [per[m][head] for m in range(1, fastblas.MB + 1)] == [2] * fastblas.MB  # the head: 2 at every row count
    assert all(per[m][c] == 1 for m in range(fastblas.MB + 1) for c, (n, k) in enumerate(fastblas.CLASS_SHAPES)
               if n * k < fastblas.POOL_MIN)  # the pool does not run there: not measured, one thread
    pooled = [c for c, (n, k) in enumerate(fastblas.CLASS_SHAPES) if n * k >= fastblas.POOL_MIN]
    assert set(times) == {f"{m},{fastblas.CLASS_SHAPES[c][0]}x{fastblas.CLASS_SHAPES[c][1]}"
                          for m in fastblas.MEASURED_M for c in pooled}
    assert fastblas._measure_kernel_threads(_FakeThreadBench(), 1, 1)[0] == [[1] * len(fastblas.CLASS_MAX)] * (fastblas.MB + 1)


def test_route_is_the_measured_crossover():
    route, times = fastblas._measure_route(_FakeBench())
    n_cls = len(fastblas.CLASS_MAX)
    assert route[0] == [0] * n_cls  # no rows: nothing to route
    assert route[1] == route[4] == [1] * n_cls
    assert route[8] == [1, 1, 1] + [0] * (n_cls - 3)  # crossover at the size where OpenBLAS won
    assert route[6] == route[8]  # between two measured m: only where both neighbours won
    assert route[12] == route[16] == [0] * n_cls
    assert len(times) == len(fastblas.MEASURED_M) * n_cls


def test_fastest_threads_times_each_configuration_and_keeps_the_fastest(monkeypatch):
    """A step that runs twice as fast when the kernel has two threads at 1 row
    on the largest weights (a memory-bound LM head): the measured table said 1,
    the run switches to 2 and says so; a step that does not care keeps the table."""
    monkeypatch.setattr(fastblas, "_cpus", lambda: 2)
    prev = fastblas.STATE["threads"], fastblas.STATE["kernel_threads"]
    clock = [0.0]
    monkeypatch.setattr(fastblas.time, "perf_counter", lambda: clock[0])

    def head_step():
        clock[0] += 1.0 if fastblas.kernel_threads_at(1, 151936, 1024) == 2 else 2.0

    try:
        fastblas.set_threads(1, 1)
        out = fastblas.fastest_threads(head_step, reps=3, apply=False)
        assert out == {"ms": {"measured": 2000.0, "1 thread": 2000.0, "2 threads": 1000.0}, "fastest": "2 threads"}
        assert fastblas.kernel_threads_at(1, 151936, 1024) == 1  # not applied: the table is back
        fastblas.fastest_threads(head_step, reps=3, apply=True)
        assert fastblas.kernel_threads_at(1, 151936, 1024) == 2
        fastblas.set_threads(1, 1)
        flat = fastblas.fastest_threads(lambda: clock.__setitem__(0, clock[0] + 1.0), reps=3, apply=True)
        assert flat["fastest"] == "measured" and fastblas.kernel_threads_at(1, 151936, 1024) == 1
    finally:
        fastblas.set_threads(*prev)


def test_a_fixed_thread_count_is_ready_only_once_measured_for_it(tmp_path, monkeypatch):
    """MLX_DFLASH_BLAS_THREADS=N has its own routing of the few-row kernel: a
    machine measured only for the automatic choice is not ready for it (the CLI's
    first start then measures it, instead of every product going to OpenBLAS)."""
    lib = fastblas._openblas_lib()
    if lib is None:
        pytest.skip("scipy-openblas32 is not installed")
    monkeypatch.setenv("MLX_DFLASH_BLAS_DIR", str(tmp_path))
    monkeypatch.delenv("MLX_DFLASH_BLAS_THREADS", raising=False)
    (tmp_path / f"libmlx_dflash_blas-{fastblas.shim_key(lib)}.so").write_bytes(b"")
    fastblas._calibration_path(lib).write_text(json.dumps({"version": fastblas.CALIBRATION_VERSION, "auto": {}}))
    assert fastblas.ready()
    monkeypatch.setenv("MLX_DFLASH_BLAS_THREADS", "1")
    assert not fastblas.ready()
    fastblas._calibration_path(lib).write_text(
        json.dumps({"version": fastblas.CALIBRATION_VERSION, "auto": {}, "t1": {}}))
    assert fastblas.ready()
