"""Host time per decode cycle with model compute excluded (issue 16 item 4).

For each mode, per cycle (a plain step counts as one):
  wall     = generation time / cycles (the consumer does nothing)
  wait     = time blocked in the cycle's one readback (draft + verify compute)
  build    = time building the target's and the drafter's lazy graphs
             (Target.__call__, Drafter.propose incl. the selector walk)
  host     = wall - wait - build: the loop's own work (policy, acceptance
             graph, rollback, lookup, bookkeeping, emit + detokenize)
Goal: host <= 0.3 ms a cycle.

    MLX_DFLASH_BLAS_THREADS=1 PYTHONPATH=. python bench/host_overhead/host_overhead.py --out bench/host_overhead
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


import mlx_dflash  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

import importlib  # noqa: E402

G = importlib.import_module("mlx_dflash.engine.generate")  # the module (the package exports a function of that name)
from mlx_dflash import load  # noqa: E402

BUILD = [0.0]


class TimedTarget(G.Target):
    """Target whose graph building is timed (measurement only: our own class, swapped in this process)."""

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return super().__call__(*a, **k)
        finally:
            BUILD[0] += time.perf_counter() - t


class TimedDrafter:
    """Delegates to a drafter, timing `propose` (lazy: graph building only)."""

    def __init__(self, d):
        self._d = d

    def __getattr__(self, k):
        return getattr(self._d, k)

    def propose(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._d.propose(*a, **k)
        finally:
            BUILD[0] += time.perf_counter() - t


PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/target")
    ap.add_argument("--drafter2", default="models/dflash2")
    ap.add_argument("--drafter1", default="models/dflash1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/host_overhead")
    args = ap.parse_args()
    G.Target = TimedTarget
    model, tok, d2 = load(args.model, args.drafter2)
    _, _, d1 = load(args.model, args.drafter1)
    modes = {
        "plain (verify mode off)": (None, dict(verify_mode="off")),
        "dflash2 w5 fixed": (TimedDrafter(d2), dict(block_size=5, guard=False)),
        "dflash1 w5 fixed": (TimedDrafter(d1), dict(block_size=5, guard=False)),
        "dflash2 default (guard)": (TimedDrafter(d2), dict()),
        "lookup w5 (no drafter)": (None, dict(verify_mode="lookup")),
        "dflash2 adaptive w5": (TimedDrafter(d2), dict(verify_mode="adaptive", block_size=5)),
    }
    for d, kw in modes.values():  # warm-up (and the adaptive cost curve)
        list(G.stream_generate(model, tok, PROMPTS[0], d, max_tokens=16, **kw))
    rows = []
    for name, (d, kw) in modes.items():
        per = {"wall": [], "wait": [], "build": [], "host": []}
        cycles = tokens = 0
        for _ in range(args.repeats):
            for p in PROMPTS:
                waits = []
                BUILD[0] = 0.0
                last = None
                gen = G.stream_generate(model, tok, p, d, max_tokens=args.max_tokens, **kw)
                first = next(gen)
                BUILD[0] = 0.0  # the prefill's own graph is not a cycle's
                r = first
                for r in gen:
                    if r.cycle is not None and r.cycle is not last:
                        waits.append(r.cycle.t_wait)
                        last = r.cycle
                s = r.stats
                n = len(waits)
                if n == 0:  # ended at its first token
                    continue
                wall = s.generation_time / n
                wait = sum(waits) / n
                build = BUILD[0] / n
                for k, v in (("wall", wall), ("wait", wait), ("build", build), ("host", wall - wait - build)):
                    per[k].append(v * 1e3)
                cycles += n
                tokens += s.generation_tokens - 1
                del first
        row = {"mode": name, "cycles": cycles, "tokens_per_cycle": tokens / cycles,
               **{k: statistics.median(v) for k, v in per.items()}}
        rows.append(row)
        print(f"{name:28s} wall {row['wall']:.2f} ms  wait {row['wait']:.2f}  build {row['build']:.2f}  "
              f"host {row['host']:.3f} ms/cycle  ({row['tokens_per_cycle']:.2f} tok/cycle)", flush=True)
    meta = {"command": " ".join(sys.argv), "machine": f"{platform.platform()}, {__import__('os').cpu_count()} CPUs",
            "mlx": mx.__version__, "device": str(mx.default_device()), "max_tokens": args.max_tokens,
            "repeats": args.repeats, "prompts": len(PROMPTS), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| mode | tok/cycle | wall ms | wait ms | graph build ms | host ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['tokens_per_cycle']:.2f} | {r['wall']:.2f} | {r['wait']:.2f} | {r['build']:.2f} | "
              f"**{r['host']:.3f}** |" for r in rows]
    print("\n".join(lines))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
