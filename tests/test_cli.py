"""The `mlx-dflash` CLI as a user runs it: real processes, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A settings home of its own (never the user's), for subprocesses and main() alike."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path / "home"


def cli(*args, env=None, input=None):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=e, timeout=600, input=input)


def main(*argv):
    from app.cli import main as _main

    return _main(list(argv))


@pytest.mark.slow
def test_generate_json_matches_python_api(pairs):
    from mlx_dflash import generate
    from mlx_dflash import load

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


@pytest.mark.slow
@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "model folder /nonexistent/model does not exist"),
    (["generate", "--prompt", "x", "--verify-mode", "fast"], "unknown verify mode"),
    (["generate", "--prompt", "x", "--block-size", "99"], "block size 99"),
    (["generate", "--prompt", "x", "--temp", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["inspect", "/nonexistent"], "/nonexistent does not exist"),
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


@pytest.mark.slow
def test_inspect_json(pairs):
    d = pairs("qwen3", version=2)
    out = json.loads(cli("inspect", str(d / "drafter"), "--json").stdout)
    assert out["version"] == 2 and out["block_size"] == 16
    p = out["params"]
    assert p["total"] == p["layers"] + p["fc"] + p["conv"] + p["selector"] and p["conv"] > 0 and p["selector"] > 0


@pytest.mark.slow
def test_doctor_json():
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"backend", "blas", "verify_cost"} <= set(out)
    assert set(out["verify_cost"]) == {"1", "2", "4", "8", "16"} and out["verify_cost"]["1"] == 1.0
    if sys.platform.startswith("linux"):
        assert "OpenBLAS" in out["blas"], out  # the fast path is really in use


# -- issue 17: names, settings, bad input ---------------------------------------------------


@pytest.fixture
def listed(pairs):
    """The random pair registered as a model folder: listed as `target` and `drafter`."""
    from mlx_dflash.settings.store import SettingsStore

    d = pairs("qwen3", version=1)
    SettingsStore().set_global(model_dirs=[str(d)])
    return d


@pytest.mark.slow
def test_generate_takes_listed_names_and_saved_settings(listed, capsys):
    from mlx_dflash.models.settings_checks import settings_store

    settings_store().set_model("target", max_tokens=4, block_size=3, guard=False)
    assert main("generate", "--model", "TARGET", "--drafter", "drafter", "--prompt", "hi", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "target" and out["drafter"] == "drafter"
    assert out["stats"]["generation_tokens"] == 4 and out["stats"]["max_width"] == 3  # the saved settings
    assert main("generate", "--model", "someorg/target", "--prompt", "hi", "--json", "--max-tokens", "6",
                "--verify-mode", "off") == 0  # flags override
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["generation_tokens"] == 6 and out["stats"]["mode"] == "off" and out["drafter"] is None


@pytest.mark.slow
def test_generate_dtype_flag_and_setting(listed, capsys):
    from mlx_dflash.models.settings_checks import settings_store

    settings_store().set_model("target", dtype="bfloat16")
    assert main("generate", "--model", "target", "--prompt", "hi", "--max-tokens", "2", "--json") == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert main("generate", "--model", "target", "--prompt", "hi", "--max-tokens", "2", "--json",
                "--dtype", "float32") == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert main("generate", "--model", "target", "--prompt", "hi", "--dtype", "f8") == 2
    assert "--dtype: unknown dtype 'f8'" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_embedded_name(capsys):
    assert main("generate", "--model", "embedded/target", "--drafter", "embedded/dflash2", "--prompt", "hi",
                "--max-tokens", "3", "--json") == 0
    assert json.loads(capsys.readouterr().out)["model"] == "embedded/target"


def test_generate_help_lists_every_verify_mode(capsys):
    from mlx_dflash.policy.registry import VERIFY_MODES

    with pytest.raises(SystemExit) as e:
        main("generate", "--help")
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(m in out for m in VERIFY_MODES) and "adaptive" in out


@pytest.mark.parametrize("args,msg", [
    (["--block-size", "0"], "--block-size: block_size must be >= 1"),
    (["--temp", "nan"], "--temp: temperature must be a finite number"),
    (["--top-p", "inf"], "--top-p: top_p must be a finite number"),
    (["--model", "targt"], "unknown model 'targt' (did you mean 'target'?)"),
    (["--drafter", "nope"], "unknown drafter 'nope'"),
    (["--prompt", "-"], "--prompt -: stdin was empty"),
])
def test_generate_refuses_bad_values_in_one_line(listed, capsys, args, msg):
    import io

    argv = ["generate", "--model", "target", "--prompt", "hi", *args]
    if "--prompt" in args:
        argv = ["generate", "--model", "target", *args]
    old = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        assert main(*argv) == 2
    finally:
        sys.stdin = old
    cap = capsys.readouterr()
    assert cap.err.count("\n") == 1 and msg in cap.err and cap.out == "", cap.err


@pytest.mark.slow
def test_generate_reads_the_prompt_from_stdin(listed, capsys):
    assert main("generate", "--model", "target", "--prompt", "hello there", "--max-tokens", "5", "--json") == 0
    ref = json.loads(capsys.readouterr().out)
    got = cli("generate", "--model", "target", "--prompt", "-", "--max-tokens", "5", "--json",
              input="hello there\n")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == ref["token_ids"] and ref["stats"]["prompt_tokens"] > 3


@pytest.mark.slow
def test_generate_into_a_closed_pipe_ends_quietly(listed):
    cmd = (f"'{sys.executable}' -m app.cli generate --model target --verify-mode off --max-tokens 400 "
           "--prompt hi | head -c 1 >/dev/null; echo rc=${PIPESTATUS[0]}")
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "rc=0" in r.stdout and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.slow
def test_drafter_that_accepts_nothing_warns_once(listed, capsys):
    """The random pair fits by shape but its drafts are almost never accepted.
    (A fixed width: the default guard may find drafting cannot pay on this
    machine and never draft at all.)"""
    assert main("generate", "--model", "target", "--prompt", "hello", "--max-tokens", "120", "--json",
                "--block-size", "4") == 0
    err = capsys.readouterr().err
    assert err.count("accepted") == 1 and "drafter 'drafter' accepted" in err and "plain decoding" in err


@pytest.mark.parametrize("damage", ["truncate", "config"])
def test_damaged_model_folder_is_one_line(listed, tmp_path, capsys, damage):
    import shutil

    d = shutil.copytree(listed / "target", tmp_path / "broken")
    if damage == "truncate":
        w = d / "model.safetensors"
        with open(w, "r+b") as f:
            f.truncate(w.stat().st_size // 2)
        want = f"{w} is truncated"
    else:
        (d / "config.json").write_text('{"model_type": "qwen3", ')
        want = f"{d / 'config.json'} is not valid JSON"
    for argv in (["generate", "--model", str(d), "--prompt", "x"], ["chat", "--model", str(d)]):
        assert main(*argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err


def test_settings_cli_refuses_unknown_names(listed, capsys):
    assert main("settings", "set", "default_model", "no/such") == 2
    assert "unknown model 'no/such'" in capsys.readouterr().err
    assert main("settings", "set", "target", "drafter", "drafterr") == 2
    assert "unknown drafter 'drafterr' (did you mean 'drafter'?)" in capsys.readouterr().err
    assert main("settings", "set", "default_model", "TARGET") == 0
    assert main("settings", "set", "Target", "top_k", "3") == 0  # stored under the listed id
    from mlx_dflash.settings.store import SettingsStore

    assert SettingsStore().explicit("target") == {"top_k": 3}


def test_every_shipped_folder_is_a_listed_package():
    """setuptools warns (about 130 lines) for each folder that ships files but is not
    in `packages`; the list in pyproject.toml must cover them all."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})

    def folder(pkg):
        top, *rest = pkg.split(".")
        return ROOT.joinpath(dirs.get(top, top), *rest)

    listed = {folder(p).resolve() for p in cfg["packages"]}
    assert all(p.is_dir() for p in listed)
    for top in {p.split(".")[0] for p in cfg["packages"]}:
        for sub in folder(top).rglob("*"):
            if sub.is_dir() and not sub.name.startswith((".", "__")) and any(f.is_file() for f in sub.iterdir()):
                assert sub.resolve() in listed, f"{sub.relative_to(ROOT)} ships files but is not in packages"


@pytest.mark.slow
def test_inspect_refuses_truncated_weights_and_takes_listed_names(pairs, tmp_path):
    """`inspect` names a truncated .safetensors in one line (it said all was fine), and
    accepts the names `models list` prints (embedded/dflash2), not only folders."""
    import shutil

    d = tmp_path / "cut"
    shutil.copytree(pairs("qwen3", version=2) / "drafter", d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    r = cli("inspect", str(d))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "model.safetensors" in lines[0], r.stderr
    r = cli("inspect", "embedded/dflash2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 2


def test_settings_set_without_a_value_says_the_value_is_missing(listed, capsys):
    from mlx_dflash.settings.store import SettingsStore

    for argv, want in ((("settings", "set", "target", "block_size"), "settings set target block_size VALUE"),
                       (("settings", "set", "port"), "settings set port VALUE")):
        assert main(*argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the value is missing" in err and want in err, err
    assert SettingsStore().explicit("target") == {}


def test_an_unknown_model_gets_one_message_everywhere(listed, capsys, monkeypatch):
    """generate (which may download) and serve / settings (which do not) name the
    mistake with the same words: model_names.unknown_model."""
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.models.model_names import resolve
    from mlx_dflash.models.settings_checks import settings_store
    from mlx_dflash.models.model_names import unknown_model
    from mlx_dflash.settings.schema import SettingsError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = settings_store()
    want = unknown_model("nope/none", discover(store))
    with pytest.raises(SettingsError) as e:  # what `serve --model` and the chat call
        resolve("nope/none", store)
    assert str(e.value) == want and want.startswith("unknown model 'nope/none'")
    assert main("generate", "--model", "nope/none", "--prompt", "hi") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err, err


def test_every_package_folder_is_listed_and_the_models_are_top_level():
    """Each package listed in pyproject.toml is a folder (package-dir: the checkout's
    root, and `mlx_dflash_models` -> the top-level `models/` the design card names),
    every folder with Python modules is listed, and the embedded pair is found there."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"": ".", "mlx_dflash_models": "models"}

    def folder(pkg):
        head, *rest = pkg.split(".")
        return ROOT.joinpath(cfg["package-dir"].get(head, head), *rest)

    for pkg in cfg["packages"]:
        assert folder(pkg).is_dir(), pkg
    for top in ("mlx_dflash", "app"):
        for init in (ROOT / top).rglob("__init__.py"):
            assert ".".join(init.parent.relative_to(ROOT).parts) in cfg["packages"], init.parent
    from mlx_dflash.models.discovery import default_pair, models_dir

    assert models_dir() == ROOT / "models" and (default_pair()[0] / "config.json").exists()


def test_bootstrap_explains_its_own_modes_and_installs_nothing_for_help(tmp_path):
    """`scripts/bootstrap.sh --help` is the script's help (not mlx-dflash's), and
    touches nothing: run from a copy with no .venv, none is made."""
    import shutil

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh"), flag], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == ""
        for mode in ("usage: scripts/bootstrap.sh", " run ", " test ", " install ", ".bootstrap-stamp"):
            assert mode in r.stdout, mode
    assert not (tmp_path / ".venv").exists()
