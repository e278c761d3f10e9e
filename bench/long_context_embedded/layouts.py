"""At one length: what the embedded target answers plainly, and how many of
the drafter's drafts it accepts at width 5 (guard and lookup off) by the
drafter context's layout (window, sink). The prompt and the prefill are
bench.py's; every run starts from a copy of one prefill and must give plain's
tokens. A layout other than the default's prefills again (a drafter context
of another layout starts over), so each costs a prefill.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/long_context_embedded/layouts.py 24576 [1024:64,1024:0,256:0,none:0]
"""

import copy
import sys

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.bench.long import prefill
from mlx_dflash.engine.generate import stream_generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store

from bench import prompt_of


def layouts(arg: str) -> list:
    """(window, sink) pairs from "1024:64,none:0" (none: every context row)."""
    return [(None if w == "none" else int(w), int(k)) for w, k in (x.split(":") for x in arg.split(","))]


def main():
    n = int(sys.argv[1])
    asked = layouts(sys.argv[2] if len(sys.argv) > 2 else "1024:64")
    lm = load_model(None, settings_store())
    model, tok, drafter = lm.model, lm.tokenizer, lm.drafter
    ids = prompt_of(tok, n)
    pc, secs, _ = prefill(model, tok, ids, drafter)
    print(f"{n} tokens, prefilled in {secs:.0f} s", flush=True)

    def run(**kw):
        rs = list(stream_generate(model, tok, ids, drafter, max_tokens=48, prompt_cache=copy.deepcopy(pc),
                                  lookup=False, **kw))
        return [r.token for r in rs], rs[-1].stats

    plain, _ = run(verify_mode="off")
    print(f"plain answer: {tok.decode(plain)!r}", flush=True)
    for window, sink in asked:
        toks, st = run(block_size=5, guard=False, drafter_window=window, drafter_sink=sink)
        assert toks == plain, (window, sink)
        print(f"window {window}, sink {sink}: {st.accepted} of {st.drafted} drafts accepted", flush=True)


if __name__ == "__main__":
    main()
