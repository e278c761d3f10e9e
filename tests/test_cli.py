"""The `mlx-dflash` CLI as a user runs it: real processes, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=e, timeout=600)


def test_generate_json_matches_python_api(pairs):
    from mlx_dflash import generate, load

    d = pairs("qwen3", version=1)
    r = cli("generate", "--model", str(d / "target"), "--drafter", str(d / "drafter"), "--prompt",
            "hello there", "--max-tokens", "12", "--block-size", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert set(out["stats"]) >= {"tau", "cycles", "drafted", "accepted", "tokens_per_second",
                                 "prompt_tokens", "generation_tokens"}
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)
    ref = generate(model, tok, prompt, drafter, max_tokens=12, block_size=3)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["stats"]["generation_tokens"] == 12 and out["stats"]["prompt_tokens"] == len(prompt)
    s = out["stats"]
    assert s["accepted"] <= s["drafted"] <= 2 * s["cycles"] and s["drafted"] == ref.stats.drafted
    raw = json.loads(cli("generate", "--model", str(d / "target"), "--prompt", "hello there", "--raw",
                         "--max-tokens", "5", "--json").stdout)
    assert raw["stats"]["prompt_tokens"] < out["stats"]["prompt_tokens"]


@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "not a folder here"),
    (["generate", "--prompt", "x", "--verify-mode", "fast"], "unknown verify mode"),
    (["generate", "--prompt", "x", "--block-size", "99"], "block size 99"),
    (["generate", "--prompt", "x", "--temp", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["inspect", "/nonexistent"], "not a folder here"),
])
def test_user_errors_are_one_line(pairs, args, msg):
    d = pairs("qwen3", version=1)
    args = [a for a in args]
    if "--model" not in args and args[0] == "generate":
        args += ["--model", str(d / "target"), "--drafter", str(d / "drafter")]
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr


def test_bad_flag_is_argparse_usage_error():
    r = cli("generate", "--no-such-flag")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_inspect_json(pairs):
    d = pairs("qwen3", version=2)
    out = json.loads(cli("inspect", str(d / "drafter"), "--json").stdout)
    assert out["version"] == 2 and out["block_size"] == 16
    p = out["params"]
    assert p["total"] == p["layers"] + p["fc"] + p["conv"] + p["selector"] and p["conv"] > 0 and p["selector"] > 0


def test_doctor_json():
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"backend", "blas", "verify_cost"} <= set(out)
    assert set(out["verify_cost"]) == {"1", "2", "4", "8", "16"} and out["verify_cost"]["1"] == 1.0
    if sys.platform.startswith("linux"):
        assert "OpenBLAS" in out["blas"], out  # the fast path is really in use
