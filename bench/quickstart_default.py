"""Does the default `generate` draft, and is it at least as fast as plain decoding?

Loads the default model the way `mlx-dflash generate` does (model manager, the
model's settings: dtype auto, drafter.quant_bits auto), then, per GSM8K dev
question (chat template, greedy), runs the default settings and plain decoding
(verify mode off, same compute dtype) back to back, alternating which goes first,
so load that comes and goes on a shared machine hits both alike. Prints one line
per question and the totals (tokens / seconds of generation, summed).

    MLX_DFLASH_HOME=$(mktemp -d) PYTHONPATH=. python bench/quickstart_default.py --prompts 10 --max-tokens 128
"""

import argparse
import time

import mlx_dflash  # noqa: F401  (fast BLAS before mlx)
from app.bench.prompts import load_prompts
from mlx_dflash import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    t0 = time.perf_counter()
    lm = load_model(None, settings_store())
    print(f"loaded {lm.id} + {lm.drafter_id} in {time.perf_counter() - t0:.1f} s; "
          f"{lm.dtype.line() if lm.dtype else ''}; drafter weights {lm.quant_bits or 'full precision'}")
    kw = dict(lm.generation_kwargs(), max_tokens=a.max_tokens)
    tot = {"default": [0, 0.0], "plain": [0, 0.0]}
    cyc = ct = drafted = accepted = 0
    for i, p in enumerate(load_prompts("gsm8k-dev", lm.tokenizer, a.prompts)):
        runs = [("default", kw), ("plain", dict(kw, verify_mode="off"))]
        out = {}
        for name, k in (runs if i % 2 == 0 else runs[::-1]):
            r = generate(lm.model, lm.tokenizer, p["prompt"], lm.drafter, **k)
            out[name] = r
            tot[name][0] += r.stats.generation_tokens
            tot[name][1] += r.stats.generation_time
        d = out["default"].stats
        cyc, ct = cyc + d.cycles, ct + d.cycle_tokens
        drafted, accepted = drafted + d.drafted, accepted + d.accepted
        same = out["default"].token_ids == out["plain"].token_ids
        print(f"{p['id']}: default {d.generation_tps:.1f} tok/s tau {d.tau:.2f} ({d.policy[:60]}); "
              f"plain {out['plain'].stats.generation_tps:.1f} tok/s; same tokens: {same}")
    td, tp = (tot[k][0] / tot[k][1] for k in ("default", "plain"))
    print(f"total: default {td:.1f} tok/s, plain {tp:.1f} tok/s, {td / tp:.2f}x; "
          f"tau {ct / max(cyc, 1):.2f} ({accepted}/{drafted} drafts accepted)")


if __name__ == "__main__":
    main()
