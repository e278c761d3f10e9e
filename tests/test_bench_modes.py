"""`mlx-dflash bench --batch` and `--server-load`, the recurring benchmarks that were
scripts: structure and exactness of their results on a tiny pair (no timing
thresholds: the numbers depend on the machine)."""

import json

import pytest

from app.cli import main


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))


def _prompts(tmp_path, n=3):
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def fibonacci(n):"}, {"messages": [{"role": "user", "content": "Tom has 3 apples."}]},
            {"prompt": "import os\nimport sys\n"}, {"prompt": "for i in range(10):"}][:n]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.slow
def test_batch_rows_are_exact_and_complete(pairs, tmp_path, capsys):
    d = pairs("qwen3", version=2)
    out = tmp_path / "out"
    assert main(["bench", "--batch", "--model", str(d / "target"), "--drafter", str(d / "drafter"),
                 "--prompts", str(_prompts(tmp_path)), "--streams", "1,3", "--max-tokens", "10", "--reps", "2",
                 "--batch-widths", "3", "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((out / "results.json").read_text()) == res
    rows = {(r["system"], r["streams"]): r for r in res["rows"]}
    systems = ("dflash-serial", "dflash-batched", "dflash-batched-w3", "plain-batched (mlx-lm)")
    assert set(rows) == {(s, n) for s in systems for n in (1, 3)}
    for (system, n), r in rows.items():
        assert r["exact"] is (None if system == "dflash-serial" else True), (system, n)  # every stream as served alone
        assert len(r["aggregate_tps_runs"]) == 2 and round(r["aggregate_tps"], 2) in r["aggregate_tps_runs"]
        assert r["ttft_p50_s"] <= r["ttft_p95_s"] and r["tokens"] <= 10 * n
    assert rows[("dflash-batched", 3)]["tokens"] == rows[("dflash-serial", 3)]["tokens"]
    md = (out / "results.md").read_text()
    assert all(s in md for s in systems) and res["meta"]["max_tokens"] == 10 and res["meta"]["reps"] == 2


def test_batch_lookup_ab(pairs, tmp_path, capsys):
    d = pairs("qwen3", version=2)
    assert main(["bench", "--batch", "--lookup-ab", "--model", str(d / "target"), "--drafter", str(d / "drafter"),
                 "--prompts", str(_prompts(tmp_path, 2)), "--streams", "2", "--max-tokens", "8", "--reps", "1",
                 "--out", str(tmp_path / "out"), "--json"]) == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"dflash-batched", "dflash-batched-nolookup"}
    for r in rows.values():
        assert r["exact"] and r["row_cycles"] >= r["lookup_cycles"] + r["plain_cycles"] and r["tau"] >= 1
    assert rows["dflash-batched-nolookup"]["lookup_cycles"] == 0


@pytest.mark.parametrize("argv,msg", [
    (["--batch", "--server-load"], "pick one"),
    (["--batch", "--streams", "0,2"], "--streams must be positive integers"),
    (["--batch", "--streams", "two"], "--streams must be a comma list of integers"),
    (["--realistic", "--batch", "--targets", "qwen3-0.6b,hybrid-0.6b"], "one target at a time"),
    (["--batch", "--contexts", "1024"], "--contexts is the long-context realistic bench"),
    (["--server-load", "--max-batch", "many"], "--max-batch must be an integer or auto"),
])
def test_mode_errors_are_one_line(tmp_path, capsys, argv, msg):
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


@pytest.mark.server
@pytest.mark.slow
def test_server_load(pairs, tmp_path, capsys):
    d = pairs("qwen3", version=2)
    out = tmp_path / "out"
    assert main(["bench", "--server-load", "--model", str(d / "target"), "--clients", "3", "--seconds", "4",
                 "--max-tokens", "6", "--max-batch", "2", "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["result"]
    assert r["answers"] > 0 and r["http_5xx"] == 0 and r["not_identical_to_alone"] == 0
    assert r["clients"] == 3 and r["max_batch"] == "2" and sum(r["codes"].values()) >= r["answers"]
    assert "| answers |" in (out / "results.md").read_text()
