"""The `mlx-dflash` command. Each subcommand lives in its own module with
`add_parser(subparsers)` and `run(args)`; modules are imported lazily so a
command only pays for what it uses."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import mlx_dflash  # (fast BLAS before anything imports mlx)
from app.errors import UserError
from mlx_dflash.platform import fastblas

# name -> module under app/
COMMANDS = {
    "generate": "app.commands.generate",
    "chat": "app.chat",
    "serve": "app.server",
    "models": "app.commands.models",
    "settings": "app.commands.settings",
    "bench": "app.bench.command",
    "train-drafter": "app.commands.train",
    "inspect": "app.commands.inspect",
    "doctor": "app.commands.doctor",
    "cache": "app.commands.cache",
}


def _user_errors():
    from mlx_dflash.platform.hub import HubError
    from mlx_dflash.target.adapter import TargetError

    return (UserError, HubError, TargetError, ValueError, FileNotFoundError, PermissionError)


broken = {}  # command -> why its parser could not be set up


def build_parser():
    ap = argparse.ArgumentParser(prog="mlx-dflash", description="Lossless DFlash speculative decoding on MLX")
    ap.add_argument("--version", action="version", version=f"mlx-dflash {mlx_dflash.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    mods = {}
    broken.clear()
    for name, modname in COMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:  # command not part of this build
                continue
            sys.stderr.write(f"mlx-dflash: '{name}' unavailable ({e}); reinstall mlx-dflash\n")
            continue
        try:
            mod.add_parser(sub)
        except Exception as e:  # one broken command must not take the others down
            broken[name] = f"{type(e).__name__}: {e}"
            continue
        mods[name] = mod
    return ap, mods


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
    ap, mods = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in broken:
        sys.stderr.write(f"mlx-dflash: '{argv[0]}' unavailable ({broken[argv[0]]}); reinstall mlx-dflash\n")
        return 2
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 0
    try:
        return mods[args.command].run(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlx-dflash models list | head`: the reader has gone; nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere
        return 0
    except _user_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.stderr.write(f"mlx-dflash {args.command}: error: {msg}\n")
        return 2


if __name__ == "__main__":  # `python -m app.cli`: use the module commands import, not __main__
    from app.cli import main as _main

    sys.exit(_main())
