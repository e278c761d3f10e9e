"""Is a request's first DFlash cycle weaker than the same text's later ones (every answer's
first cycles fail in this bench: confidence.log)? Each prompt plus the first k tokens of its
plain answer, as a new request at a fixed width (default 8), guard and lookup off: the
drafts accepted in its first two cycles, beside the run from k = 0 (position:accepted per cycle).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/short_answers/first_cycle.py 8
"""

import sys

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from bench import prompts
from mlx_dflash.engine.generate import generate, stream_generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store


def cycles(model, tok, drafter, ids, width):
    """(position in the answer, drafts accepted) of each cycle of a fixed-width run from `ids`."""
    out, seen = [], None
    for pos, r in enumerate(stream_generate(model, tok, ids, drafter, max_tokens=40, block_size=width,
                                            guard=False, lookup=False)):
        if r.cycle is not None and r.cycle is not seen:
            out.append((pos, r.cycle.accepted))
            seen = r.cycle
    return out


def main(width: int) -> None:
    lm = load_model(None, settings_store())
    model, tok, drafter = lm.model, lm.tokenizer, lm.drafter
    for name, p in prompts().items():
        ids = tok.encode(p)
        plain = generate(model, tok, ids, drafter, max_tokens=128, verify_mode="off").token_ids
        base = cycles(model, tok, drafter, ids, width)
        firsts = []
        for k in (4, 8, 12, 16, 20, 24):
            if k >= len(plain) - 10:
                break
            f = cycles(model, tok, drafter, ids + plain[:k], width)[:2]
            firsts.append(f"k={k}: first {f[0][1]}, second {f[1][1] if len(f) > 1 else '-'}")
        print(f"{name}: full run (pos:acc) " + " ".join(f"{a}:{b}" for a, b in base[:10]))
        print("   ", "; ".join(firsts))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
