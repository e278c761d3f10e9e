"""The `mlx-dflash` command. Each subcommand lives in its own module with
`add_parser(subparsers)` and `run(args)`. Only the chosen command's module is
imported: `--help` lists the commands from the table below, so it and the light
commands (`settings`) start without mlx, mlx-lm, fastapi or textual."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from typing import NamedTuple

import mlx_dflash  # (fast BLAS before anything imports mlx; the package itself imports no mlx)
from app.errors import UserError
from mlx_dflash.platform import fastblas


class Command(NamedTuple):
    module: str  # under app/: add_parser(sub), run(args)
    help: str  # the line `--help` shows (the module's add_parser says the same: tests/test_cli.py checks it)


COMMANDS = {
    "generate": Command("app.commands.generate", "generate text for one prompt"),
    "chat": Command("app.chat", "chat in the terminal (Textual), with live DFlash stats"),
    "serve": Command("app.server", "run a local OpenAI-compatible server"),
    "models": Command("app.commands.models", "list, inspect, download and remove models"),
    "settings": Command("app.commands.settings", "per-model and global settings"),
    "bench": Command("app.bench.command", "benchmark DFlash against mlx-lm (plain and speculative) on a prompt set"),
    "train-drafter": Command("app.commands.train", "train a DFlash / DFlash 2 drafter for a target model"),
    "inspect": Command("app.commands.inspect", "show every field a drafter's config sets and what it does"),
    "doctor": Command("app.commands.doctor", "check the backend, BLAS and verify cost on this machine"),
    "cache": Command("app.commands.cache", "the prompt cache on disk: list, du, clear"),
}

# what a command may raise for a user's mistake: one line, exit 2 (HubError,
# TargetError and SettingsError are ValueErrors)
USER_ERRORS = (UserError, ValueError, FileNotFoundError, PermissionError)


class Unavailable(Exception):
    """The chosen command's module could not be imported or set up."""


def chosen(argv) -> str | None:
    """The command named in `argv`: its first word that is not an option (the
    top-level parser has only -h and --version, which take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None, eager: bool = False):
    """The parser, and the module of `command` (None when it names none). The
    other commands are listed by their help line alone; `eager`: every module
    sets up its own parser (what the lazy listing must print the same as)."""
    ap = argparse.ArgumentParser(prog="mlx-dflash", description="Lossless DFlash speculative decoding on MLX")
    ap.add_argument("--version", action="version", version=f"mlx-dflash {mlx_dflash.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    mod = None
    for name, c in COMMANDS.items():
        if name != command and not eager:
            sub.add_parser(name, help=c.help)
            continue
        try:
            m = importlib.import_module(c.module)
            m.add_parser(sub)
        except Exception as e:  # a broken command must not take the others down
            raise Unavailable(f"'{name}' unavailable ({type(e).__name__}: {e}); reinstall mlx-dflash") from e
        if name == command:
            mod = m
    return ap, mod


def _first_start(argv) -> None:
    """The first start on a machine (Linux): build the fast BLAS shim and measure
    it in a child, then start again so that mlx binds to it (it must be loaded
    before mlx, and importing mlx_dflash never builds or measures)."""
    if fastblas.ready() or os.environ.get("MLX_DFLASH_PREPARED") == "1":
        return
    sys.stderr.write("mlx-dflash: preparing the fast BLAS for this machine (once, about a minute)...\n")
    r = subprocess.run([sys.executable, "-c", "from mlx_dflash.platform import fastblas; fastblas.prepare()"])
    os.environ["MLX_DFLASH_PREPARED"] = "1"  # whatever happened: never a loop of restarts
    if r.returncode == 0:
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "app.cli", *argv])


def main(argv=None) -> int:
    if argv is None:  # the command itself (not a caller in this process): it may restart
        _first_start(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else list(argv)
    command = chosen(argv)
    try:
        ap, mod = build_parser(command if command in COMMANDS else None)
    except Unavailable as e:
        sys.stderr.write(f"mlx-dflash: {e}\n")
        return 2
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 0
    try:
        return mod.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlx-dflash models list | head`: the reader has gone; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere
        return 0
    except USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.stderr.write(f"mlx-dflash {args.command}: error: {msg}\n")
        return 2


if __name__ == "__main__":  # `python -m app.cli`: use the module commands import, not __main__
    from app.cli import main as _main

    sys.exit(_main())
