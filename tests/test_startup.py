"""A fast start: `--help` and `settings` import none of the heavy libraries, the
lazy command listing prints what every command module says of itself, and
`import mlx_dflash` resolves its public API on first use (times: bench/startup.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import fast_first

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("mlx", "mlx_lm", "fastapi", "textual")

# runs the CLI in a fresh interpreter, then says which heavy libraries it imported
PROBE = """import sys
from app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("\\nLOADED", sorted(m for m in {heavy} if m in sys.modules), code)
""".format(heavy=HEAVY)


def run_cli(home, *args):
    env = {**os.environ, "MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    out, _, last = r.stdout.rpartition("\nLOADED ")
    assert r.returncode == 0 and last, r.stderr
    loaded, code = last.strip().rsplit(" ", 1)
    return out, loaded, int(code or 0), r.stderr


@pytest.mark.parametrize("args", fast_first([["--help"], ["settings", "get"], ["-h"], [], ["settings", "get", "--json"],
                                             ["settings", "get", "port"], ["settings", "path"], ["settings", "--help"],
                                             ["--version"]], keep=2))
def test_light_commands_import_no_heavy_library(tmp_path, args):
    out, loaded, code, err = run_cli(tmp_path / "home", *args)
    assert loaded == "[]", (args, loaded)
    assert code == 0 and "Traceback" not in err and out.strip()


def test_settings_get_reads_what_set_wrote(tmp_path, monkeypatch):
    from mlx_dflash.settings.store import SettingsStore

    home = tmp_path / "home"
    monkeypatch.setenv("MLX_DFLASH_HOME", str(home))
    SettingsStore().set_global(port=8123)
    SettingsStore().set_model("org/m", block_size=3)
    out, loaded, code, _ = run_cli(home, "settings", "get")
    assert loaded == "[]" and code == 0
    assert "port = 8123" in out and "[org/m]" in out and "block_size = 3" in out


def test_help_is_what_every_command_module_says():
    """The lazy listing (the table's help lines) prints exactly what the eager
    parser, every command module's own add_parser, prints."""
    from app.cli import COMMANDS, build_parser

    lazy, mod = build_parser()
    eager, _ = build_parser(eager=True)
    assert mod is None and lazy.format_help() == eager.format_help()
    for name in COMMANDS:
        assert name in lazy.format_help()


def test_only_the_chosen_command_is_imported():
    probe = "import sys; from app.cli import build_parser; build_parser('settings'); " \
            "print(sorted(m for m in sys.modules if m.startswith('app.')))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(sorted(["app.cli", "app.errors", "app.commands", "app.commands.settings"]))


def test_a_broken_command_is_one_line(monkeypatch, capsys):
    from app import cli

    monkeypatch.setitem(cli.COMMANDS, "doctor", cli.Command("app.commands.no_such_module", "x"))
    assert cli.main(["doctor"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'doctor' unavailable" in err[0] and "reinstall" in err[0]
    assert cli.main(["settings", "path"]) == 0  # the others still run


def test_unknown_command_is_a_usage_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "app.cli", "nope"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "MLX_DFLASH_HOME": str(tmp_path)}, timeout=300)
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_public_api_resolves_lazily_after_the_fast_blas():
    probe = """import sys
import mlx_dflash
before = sorted(m for m in ("mlx", "mlx_lm") if m in sys.modules)
from mlx_dflash import load, generate, stream_generate, Decoder, DecodeConfig, PromptCache
from mlx_dflash.engine.generate import generate as g
from mlx_dflash.models.manager import load as l
from mlx_dflash.platform import fastblas
print(before, generate is g and load is l and mlx_dflash.generate is g, "mlx" in sys.modules,
      set(mlx_dflash.__all__) <= set(dir(mlx_dflash)), fastblas.ready(), fastblas.STATE["shim"] is not None)
try:
    mlx_dflash.no_such_name
except AttributeError as e:
    print("AttributeError", e)
"""
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    before, rest = first.split("] ", 1)
    assert before == "[" and rest.startswith("True True True")
    ready, shim = rest.split()[-2:]
    if sys.platform.startswith("linux") and ready == "True":
        assert shim == "True"  # loaded by the package import, before the API pulled mlx in
    assert second == "AttributeError module 'mlx_dflash' has no attribute 'no_such_name'"


def test_verify_mode_names_agree_with_the_registry():
    from mlx_dflash.policy.modes import VERIFY_MODES
    from mlx_dflash.policy.registry import MODES
    from mlx_dflash.settings.schema import verify_modes

    assert tuple(MODES) == VERIFY_MODES == verify_modes()
