"""Does the drafter's own confidence say which cycles will fail? Each prompt of
bench.py at a fixed width 8 (guard and lookup off, so every cycle drafts 7),
every cycle's confidences (the selector's path score per draft) against what
the verify accepted: the share accepted by confidence bin at draft positions
1-3, what the raw confidences predict per prompt against what was accepted,
and each prompt's first three cycles (where a request's text is new).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/short_answers/confidence.py --max-tokens 128
"""

import argparse
import math
import statistics

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
import mlx.core as mx
from bench import prompts
from mlx_dflash.engine.engine import Engine
from mlx_dflash.engine.generate import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store

SEEN = []  # (confidences of the cycle's drafts, drafts accepted), DFlash cycles only


def record(account):
    """Engine._account, also keeping each DFlash cycle's confidences (read
    here, after the cycle: the engine leaves them on the device)."""
    def wrapped(self, rows, results):
        for r in results:
            if r.source == "dflash" and r.conf is not None:
                SEEN.append((r.conf.tolist() if isinstance(r.conf, mx.array) else list(r.conf), r.accepted))
        return account(self, rows, results)
    return wrapped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    Engine._account = record(Engine._account)
    lm = load_model(None, settings_store())
    by_prompt = {}
    for name, p in prompts().items():
        SEEN.clear()
        generate(lm.model, lm.tokenizer, p, lm.drafter, max_tokens=args.max_tokens, verify_mode="dflash",
                 block_size=8, guard=False, lookup=False)
        by_prompt[name] = list(SEEN)
    print("share accepted by confidence, at draft positions 1-3 (of cycles that reached the position):")
    for pos in range(3):
        bins = {}
        for cycles in by_prompt.values():
            for conf, a in cycles:
                if len(conf) > pos and a >= pos:
                    h = bins.setdefault(min(4, int(conf[pos] * 5)), [0, 0])
                    h[0] += a > pos
                    h[1] += 1
        print(f"  position {pos + 1}: " + ", ".join(f"{b / 5:.1f}-{(b + 1) / 5:.1f}: {h[0]}/{h[1]} = {h[0] / h[1]:.2f}"
                                                  for b, h in sorted(bins.items())))
    print("per prompt (cycles; drafts accepted a cycle, as the raw confidences predict and as verified; "
          "first three cycles' position-1 confidence and drafts accepted):")
    for name, cycles in by_prompt.items():
        pred = statistics.mean(sum(math.prod(c[: k + 1]) for k in range(len(c))) for c, _ in cycles)
        got = statistics.mean(a for _, a in cycles)
        first = ", ".join(f"{c[0]:.2f} -> {a}" for c, a in cycles[:3])
        print(f"  {name}: {len(cycles)} cycles; predicted {pred:.2f}, accepted {got:.2f}; first three: {first}")


if __name__ == "__main__":
    main()
