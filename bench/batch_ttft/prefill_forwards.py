"""The prefill forwards behind bench/batch_ttft.md: 8 prompts each prefilled
alone (all but the last token, then the last) vs one left-padded batched
forward over all of them (then one [8, 1] forward), on the embedded pair."""

from __future__ import annotations

import argparse
import time

from batch_ttft import prompts  # (this folder; imports mlx_dflash first: the fast BLAS)

import mlx.core as mx
from mlx_dflash.engine import batch_cache as bc
from mlx_dflash.models.loader import load
from mlx_dflash.target.adapter import Target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model, tok, drafter = load(dtype="float32")
    ps = prompts(tok, a.streams)
    print("prompt tokens:", [len(p) for p in ps])
    t = Target(model)
    cap = list(drafter.config.target_layer_ids)
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for p in ps:
            c = t.make_cache()
            _, f = t(mx.array(p[:-1])[None], c, cap)
            mx.eval(f, [x.state for x in c])
            logits, f = t(mx.array(p[-1:])[None], c, cap)
            mx.eval(logits, f)
        t1 = time.perf_counter()
        heads = [p[:-1] for p in ps]
        m = max(map(len, heads))
        pad = [m - len(h) for h in heads]
        c = bc.padded(t, pad)
        _, f = t(mx.array([[0] * q + h for q, h in zip(pad, heads)]), c, cap)
        mx.eval(f, [x.state for x in c])
        t2 = time.perf_counter()
        logits, f2 = t(mx.array([[p[-1]] for p in ps]), c, cap)
        mx.eval(logits, f2)
        t3 = time.perf_counter()
        print(f"alone {t1 - t0:.3f} s; together: padded forward {t2 - t1:.3f} s, last tokens {t3 - t2:.3f} s",
              flush=True)


if __name__ == "__main__":
    main()
