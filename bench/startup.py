"""Start-up time of light commands (issue 35 item 6): the wall time of a fresh
`python -m app.cli ARGS` process, each command --runs times, the checkouts
interleaved run by run (load that comes and goes hits them alike); median and
range. A scratch MLX_DFLASH_HOME (no settings file: `settings get` prints the
defaults).

    python bench/startup.py --runs 11 [--before DIR]

--before DIR: a checkout to compare with (e.g. `git archive REV | tar -x -C DIR`)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (["--help"], ["settings", "get"], ["settings", "path"], ["--version"])


def once(tree: Path, args, env) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--before", type=Path, default=None)
    a = ap.parse_args()
    env = {**os.environ, "MLX_DFLASH_HOME": tempfile.mkdtemp(prefix="startup-"), "HF_HUB_OFFLINE": "1"}
    trees = {"this tree": ROOT, **({"before": a.before.resolve()} if a.before else {})}
    times = {(t, " ".join(c)): [] for t in trees for c in COMMANDS}
    load0 = os.getloadavg()[0]
    for _ in range(a.runs):
        for c in COMMANDS:
            for t, tree in trees.items():
                times[(t, " ".join(c))].append(once(tree, c, env))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {load0:.1f} -> {os.getloadavg()[0]:.1f}, "
          f"{a.runs} runs each\n")
    print("| command | " + " | ".join(f"{t}: median (min-max) s" for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for c in COMMANDS:
        cells = [times[(t, " ".join(c))] for t in trees]
        print(f"| `mlx-dflash {' '.join(c)}` | " + " | ".join(
            f"{statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f})" for x in cells) + " |")


if __name__ == "__main__":
    main()
