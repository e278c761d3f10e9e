"""Issue 36: what a plain step costs us against mlx-lm at one context length,
the embedded pair, one process, interleaved rounds, median inter-token time
(the first and last 4 tokens left out):

- the bare loop (one graph per token, the next queued before the last is read,
  as mlx-lm's generate_step): mlx-lm's model, our Target without feature
  capture, our Target capturing the drafter's layers;
- the products: mlx_lm.stream_generate, our stream_generate in verify mode off
  with the drafter (a prompt cache given: its features are captured, as the
  guard's plain steps capture them) and without it.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \
        python bench/plain_step/plain_step.py --context 4096 --tokens 64 --rounds 6
"""

import argparse
import copy
import importlib.util
import statistics
import time

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
import mlx.core as mx
import mlx_lm
from app.bench.long import prefill
from mlx_dflash import stream_generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store
from mlx_dflash.target.adapter import Target

spec = importlib.util.spec_from_file_location("lce", "bench/long_context_embedded/bench.py")
lce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lce)  # (its prompt: this repository's source, then a question)


def itl(ts) -> float:
    d = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(d[4:-4]) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    lm = load_model(None, settings_store())
    model, tok, drafter = lm.model, lm.tokenizer, lm.drafter
    ids = lce.prompt_of(tok, a.context)
    pc, _, _ = prefill(model, tok, ids, drafter)
    target, layers = Target(model), list(drafter.config.target_layer_ids)

    def bare(kind):
        cache = copy.deepcopy(pc).target

        def feed(y):
            if kind == "mlx-lm model":
                logits, f = model(y.reshape(1, 1), cache=cache), None
            else:
                logits, f = target(y.reshape(1, 1), cache, layers if kind == "Target, capture" else ())
            nxt = mx.argmax(logits[:, -1], axis=-1)
            mx.async_eval(nxt, *([f] if f is not None else []))
            return nxt, f

        kept, ts = [], []
        y, f = feed(mx.array([ids[-1]], mx.int32))
        for _ in range(a.tokens):
            y2, f2 = feed(y)
            y.tolist()
            if f is not None:
                kept.append(f)
            y, f = y2, f2
            ts.append(time.perf_counter())
        return itl(ts)

    def product(kind):
        c, ts = copy.deepcopy(pc), []
        if kind == "mlx_lm.stream_generate":
            it = mlx_lm.stream_generate(model, tok, ids[-1:], max_tokens=a.tokens, prompt_cache=c.target)
        else:
            d = drafter if kind == "ours, off, drafter (capture)" else None
            it = stream_generate(model, tok, ids, d, max_tokens=a.tokens, verify_mode="off", prompt_cache=c)
        for _ in it:
            ts.append(time.perf_counter())
        return itl(ts)

    runs = [(k, bare) for k in ("mlx-lm model", "Target", "Target, capture")]
    runs += [(k, product) for k in ("mlx_lm.stream_generate", "ours, off, drafter (capture)", "ours, off, no drafter")]
    got = {k: [] for k, _ in runs}
    for r in range(a.rounds):
        for k, fn in (runs if r % 2 == 0 else runs[::-1]):
            got[k].append(fn(k))
    print(f"context {len(ids)} tokens, {a.tokens} tokens a run, {a.rounds} rounds; median inter-token ms (each round's)")
    for k, v in got.items():
        print(f"  {k:32s} {statistics.median(v):7.3f}   " + " ".join(f"{x:.2f}" for x in v))


if __name__ == "__main__":
    main()
