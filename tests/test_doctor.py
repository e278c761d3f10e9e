"""`mlx-dflash doctor`: progress while it measures, the BLAS thread count it used,
both probe sizes, the kernel A/B, and warnings for impossible figures and a busy
machine."""

import json

import pytest

from app.commands import doctor
from app.cli import main
from mlx_dflash.platform import fastblas


@pytest.fixture
def tiny_probes(monkeypatch):
    """Probe targets small enough for a test (the real ones are ~30M and ~304M)."""
    shape = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256)
    monkeypatch.setitem(doctor.PROBES, "small", ("tiny", shape, 3))
    monkeypatch.setitem(doctor.PROBES, "large", ("tiny-large", {**shape, "num_hidden_layers": 3}, 3))


@pytest.mark.slow
def test_json_progress_threads_and_both_sizes(tiny_probes, capsys):
    rc = main(["doctor", "--json", "--context", "32", "--kernel-ab", "--contexts", "700"])
    cap = capsys.readouterr()
    assert rc == 0
    out = json.loads(cap.out)  # stdout is only the JSON: progress went to stderr
    progress = [l for l in cap.err.splitlines() if l.startswith("doctor: ")]
    assert any("measuring c(w)" in l and "small" in l for l in progress)
    assert any("measuring c(w)" in l and "large" in l for l in progress)
    assert any("round 3/3" in l for l in progress)
    assert out["blas_threads"] == fastblas.STATE["threads"]
    assert set(out["probes"]) == {"small", "large"}
    assert out["probes"]["large"]["params"] > out["probes"]["small"]["params"]
    runs = out["probes"]["small"]["runs"]
    assert set(runs) == ({"on", "off"} if fastblas.STATE["shim"] else {"off"})
    for r in runs.values():
        assert set(r["verify_cost"]) == {"1", "2", "4", "8", "16"} and r["verify_cost"]["1"] == 1.0
        assert all(v > 0 for v in r["verify_ms"].values())
    assert out["verify_cost"] in [r["verify_cost"] for r in runs.values()]
    for probe in out["probes"].values():
        for r in probe["runs"].values():  # the c(w) check ran on every measurement
            assert isinstance(r["check"], list) and set(r["noise"]) == set(r["verify_cost"])
    st = out["probes"]["large"].get("step_threads")
    if fastblas.STATE["shim"] and fastblas.STATE["small_gemm"] and doctor._cpus() > 1:
        assert set(st["ms"]) == {"measured", "1 thread", f"{min(doctor._cpus(), 8)} threads"}
        assert st["fastest"] in st["ms"] and all(v > 0 for v in st["ms"].values())
    assert len(out["load_average"]) == 1 + len(runs) * 2 and isinstance(out["warnings"], list)
    # the guard's curves for the default model: its base length and the long length 700 tokens are priced at
    (g,) = out["guard_costs"]
    assert [r["context"] for r in g["curves"]] == [128, 1024]
    for r in g["curves"]:
        assert r["c"]["1"] == 1.0 and r["d"]["1"] == 0.0 and r["t1_ms"] > 0 and r["plain_ms"] > 0
        assert set(r["c"]) == set(r["d"]) and len(r["c"]) > 1 and r["catch_up_ms_1k"] > 0
    if fastblas.STATE["shim"]:
        assert out["blas_threads"] >= 1 and out["blas_threads_from"]
    # the compute dtype, and on a CPU backend the measured bf16 / float32 step of the embedded target
    assert out["compute_dtype"]["dtype"] in ("checkpoint", "float32", "bfloat16", "float16")
    if out["backend"] == "cpu":
        st = out["dtype_step"]
        assert st["float32_ms"] > 0 and st["bfloat16_ms"] > 0
        assert st["ratio"] == pytest.approx(st["bfloat16_ms"] / st["float32_ms"], rel=0.02)
        slow = st["ratio"] > 1.3 and out["compute_dtype"]["dtype"] != "float32"
        assert ("dtype_hint" in out) == slow
        if slow:
            assert "MLX_DFLASH_DTYPE=float32" in out["dtype_hint"] and "dtype float32" in out["dtype_hint"]


def test_compute_dtype_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "float32")
    assert main(["doctor", "--quick"]) == 0
    text = capsys.readouterr().out
    assert "compute dtype: float32 ($MLX_DFLASH_DTYPE)" in text and "hint:" not in text
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "float64")
    assert main(["doctor", "--quick", "--json"]) == 0  # a bad value is reported, not a crash
    out = json.loads(capsys.readouterr().out)
    assert out["compute_dtype"]["dtype"] == "invalid" and "float64" in out["compute_dtype"]["source"]


def test_text_shows_threads(capsys):
    assert main(["doctor", "--quick"]) == 0
    text = capsys.readouterr().out
    if fastblas.STATE["shim"]:
        assert f"BLAS threads: {fastblas.STATE['threads']} (" in text


def _fake(c2, load, spread=0.1):
    run = {"verify_cost": {"1": 1.0, "2": c2, "4": 1.2, "8": 1.4, "16": 1.9}, "spread_t1": spread}
    return {"cpus": 2, "load_average": [load, load], "probes": {"small": {"runs": {"on": run}}}}


def test_no_busy_warning_without_figures():
    assert doctor._warnings({"cpus": 2, "load_average": [6.5]}) == []


def test_warns_on_impossible_figures_and_a_busy_machine():
    assert doctor._warnings(_fake(1.1, 0.3)) == []
    w = doctor._warnings(_fake(0.11, 0.3))  # printed under load once, without a word
    assert len(w) == 1 and "c(2) = 0.11 is impossible" in w[0]
    w = doctor._warnings(_fake(1.1, 6.5))
    assert len(w) == 1 and "machine busy" in w[0] and "6.5 on 2 cores" in w[0]
    w = doctor._warnings(_fake(1.1, 0.3, spread=2.0))
    assert len(w) == 1 and "noisy" in w[0]


@pytest.mark.slow
def test_recalibrate_measures_again(tmp_path, monkeypatch, capsys):
    if not fastblas.STATE["shim"]:
        pytest.skip("no BLAS shim on this platform")
    monkeypatch.setenv("MLX_DFLASH_BLAS_DIR", str(tmp_path))
    monkeypatch.setenv("MLX_DFLASH_BLAS_THREADS", "1")
    prev = fastblas.STATE["threads"], [list(r) for r in fastblas.STATE["route"]], dict(fastblas.STATE)
    try:
        assert main(["doctor", "--quick", "--recalibrate"]) == 0
        assert "measuring BLAS threads" in capsys.readouterr().err
        cal = json.loads(next(tmp_path.glob("calibration-*.json")).read_text())
        assert cal["t1"]["threads"] == 1 and fastblas.STATE["threads"] == 1
    finally:
        fastblas.set_threads(prev[0])
        fastblas.set_route(prev[1])
        fastblas.STATE.update(prev[2])


def test_warnings_come_before_the_figures_and_the_dtype_line_says_why(monkeypatch, capsys):
    fake = {"mlx": "x", "platform": "p", "backend": "cpu", "device": "cpu", "cpus": 2, "blas": "b",
            "sgemm_gflops": 1.0, "blas_note": None, "blas_threads": None, "conv_kernel": "mlx-ops",
            "fused_kernels": False, "verify_context": 256,
            "compute_dtype": {"dtype": "float32", "source": "auto", "model": "embedded/target",
                              "why": "auto: measured, a bfloat16 step costs 2.0x a float32 one on this CPU"},
            "probes": {"small": {"label": "tiny", "params": 1e6,
                                 "runs": {"on": {"verify_cost": {"1": 1.0, "2": 1.1}, "verify_ms": {"1": 5.0}}}}},
            "warnings": ["machine busy: load average up to 6.5 on 2 cores while measuring; the figures below "
                         "are unreliable (run again when the machine is idle)"]}
    monkeypatch.setattr(doctor, "report", lambda *a, **k: fake)
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    warn = next(i for i, l in enumerate(lines) if l.startswith("warning: machine busy"))
    figures = next(i for i, l in enumerate(lines) if l.startswith("verify cost c(w)"))
    dt = next(i for i, l in enumerate(lines) if l.startswith("compute dtype:"))
    assert warn < dt < figures
    assert lines[dt] == ("compute dtype: float32 (auto) for embedded/target: auto: measured, a bfloat16 step "
                         "costs 2.0x a float32 one on this CPU")


def test_cost_check_wants_c_at_least_1_and_non_decreasing_within_noise():
    good = {1: 1.0, 2: 1.17, 4: 1.32, 8: 1.68, 16: 2.78}
    assert doctor.cost_check(good, {}) == []
    slowed = {1: 1.0, 2: 0.76, 4: 0.68, 8: 1.7, 16: 2.8}  # the slowed 1-token step the check is for
    probs = doctor.cost_check(slowed, {w: 0.01 for w in slowed})
    assert [x.split(" ")[0] for x in probs] == ["c(2)", "c(4)"] and all("< 1" in x for x in probs)
    assert doctor.cost_check({1: 1.0, 2: 0.97, 4: 1.1}, {2: 0.01}) == []  # within the noise floor
    assert len(doctor.cost_check({1: 1.0, 2: 0.9, 4: 1.1}, {2: 0.01})) == 1
    assert doctor.cost_check({1: 1.0, 2: 0.9, 4: 1.1}, {2: 0.15}) == []  # noisy rounds: not a finding
    dip = doctor.cost_check({"1": 1.0, "8": 1.5, "16": 1.35}, {})  # string keys, as in the JSON
    assert dip == ["c(16) = 1.35 < c(8) = 1.50: a wider verify measured cheaper"]


def test_warns_when_the_large_probe_fails_the_check_or_the_threads_are_slow():
    run = {"verify_cost": {"1": 1.0, "2": 0.76}, "spread_t1": 0.1, "check": ["c(2) = 0.76 < 1: x"]}
    out = {"cpus": 2, "load_average": [0.1], "probes": {"large": {"runs": {"on": run}, "step_threads": {
        "ms": {"measured": 239.0, "1 thread": 239.0, "2 threads": 131.0}, "fastest": "2 threads"}}}}
    w = doctor._warnings(out)
    assert any("c(2) = 0.76 < 1" in x for x in w)
    assert any("239.0 ms at the measured kernel threads but 131.0 ms on 2 threads" in x and "--recalibrate" in x
               for x in w)
    out["probes"]["large"]["step_threads"]["ms"]["measured"] = 135.0  # within 10%: fine
    run["check"] = []
    assert doctor._warnings(out) == []


def test_quick_shows_the_guards_cached_cost_curves_by_context(tiny_probes, tmp_path, monkeypatch, capsys):
    """--quick measures nothing: it lists the guard's curves cached on this machine,
    one row per context length, as the guard stored them (base length and long ones)."""
    from mlx_dflash.policy.costs import CostBook, Costs

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    assert main(["doctor", "--quick", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["guard_costs"] == []
    model = doctor.probe_model("small")
    book = CostBook()
    curves = {None: Costs(0.002, {1: 1.0, 2: 1.1, 5: 1.3}, {1: 0.0, 2: 0.4, 5: 0.5}, 128, 1e12, 0.0021),
              4096: Costs(0.003, {1: 1.0, 2: 1.2, 5: 1.6}, {1: 0.0, 2: 0.5, 5: 0.6}, 4096, 1e12, 0.0032, 0.002)}
    for at, c in curves.items():
        book.keep(model, None, c, context=at)
    # batch engine curves in the same cache (keyed by batch size; session 8's format tagged the
    # context "batch<B>"): not lengths, not listed
    batch = Costs(0.004, {1: 1.0, 5: 2.0}, {1: 0.0, 5: 0.5}, 128, 1e12, 0.004)
    book.keep(model, None, batch, batch=2)
    book.keep(model, None, batch, context="batch2")
    assert main(["doctor", "--quick", "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["guard_costs"]
    assert group["model"].startswith("qwen3 hidden 64")
    assert [r["context"] for r in group["curves"]] == [128, 4096]
    assert [r["c"]["5"] for r in group["curves"]] == [1.3, 1.6] and group["curves"][1]["d"]["2"] == 0.5
    assert group["curves"][1]["t1_ms"] == 3.0 and group["curves"][1]["plain_ms"] == 3.2
    assert group["curves"][1]["catch_up_ms_1k"] == 6.0  # 0.002 t1 a row: 1,000 rows at 3 ms
    assert main(["doctor", "--quick"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.strip().startswith("4096"))
    assert row.split()[:5] == ["4096", "3.00", "3.20", "6.00", "1.20"]


def test_contexts_must_be_token_counts(capsys):
    assert main(["doctor", "--quick", "--contexts", "1k"]) != 0
    err = capsys.readouterr().err
    assert "--contexts" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
