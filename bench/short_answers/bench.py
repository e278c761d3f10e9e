"""Short answers that end by a stop well before max_tokens, on raw prompts the
embedded drafter does not predict (the default's worst case: a probe costs a
larger share of a short answer). One process, the guard's state carried from
request to request as a server or a library caller carries it; each pass
sends every prompt once in the default mode and once plainly (verify mode
off), alternating which goes first (`--mode adaptive`: that mode against plain). Prints default / plain in tok/s per prompt
(the median over the passes) and over all prompts per pass, and checks every
output equal to plain's.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/short_answers/bench.py --passes 4 --max-tokens 256
"""

import argparse
import random
import statistics

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from mlx_dflash.engine.generate import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store


def prompts() -> dict:
    rng = random.Random(0)
    words = "apple river stone quantum violet seven market glass thunder orbit pencil maple ocean silver tiger".split()
    return {
        "hex": " ".join("%08x" % rng.getrandbits(32) for _ in range(150)) + "\nContinue the list:",
        "salad": " ".join(rng.choice(words) for _ in range(300)) + "\nWrite a story using these words:",
        "german": "Die Geschichte der Stadt beginnt im zwölften Jahrhundert, als Händler entlang des Flusses "
                  "siedelten. Erzähle weiter, was danach geschah:",
        "poem": "Write a poem about the sea at night, in the style of an old sailor who lost his ship.",
        "hashmap": "Explain how a hash map works.",
        "france": "The capital of France is a city that",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--mode", default="dflash", help="the verify mode set against plain (dflash: the default)")
    args = ap.parse_args()
    m = args.mode
    lm = load_model(None, settings_store())
    model, tok, drafter = lm.model, lm.tokenizer, lm.drafter
    ratios, per = [], {}
    for i in range(args.passes):
        spent = {m: 0.0, "off": 0.0}
        tokens = {m: 0, "off": 0}
        for name, p in prompts().items():
            out = {}
            for mode in (m, "off") if i % 2 == 0 else ("off", m):
                g = generate(model, tok, p, drafter, max_tokens=args.max_tokens, verify_mode=mode)
                spent[mode] += g.stats.generation_tokens / g.stats.generation_tps if g.stats.generation_tps else 0.0
                tokens[mode] += g.stats.generation_tokens
                out[mode] = g
            assert out[m].token_ids == out["off"].token_ids, name
            per.setdefault(name, []).append(out[m].stats.generation_tps / out["off"].stats.generation_tps)
            print(f"pass {i} {name}: {len(out['off'].token_ids)} tokens; {m} {out[m].stats.policy}",
                  flush=True)
        r = (tokens[m] / spent[m]) / (tokens["off"] / spent["off"])
        ratios.append(r)
        print(f"pass {i}: {tokens['off']} tokens; decode s {m} {spent[m]:.3f}, plain {spent['off']:.3f}: "
              f"{m} / plain {r:.3f}", flush=True)
    for name, rs in per.items():
        print(f"{name}: {m} / plain, median {statistics.median(rs):.3f} ({', '.join(f'{r:.2f}' for r in rs)})")
    print(f"all prompts: {m} / plain, median of {args.passes} passes: {statistics.median(ratios):.3f}; "
          f"every output equal to plain's")


if __name__ == "__main__":
    main()
