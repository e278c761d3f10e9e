#!/usr/bin/env python
"""Where the time of a decode step goes on this machine (mlx CPU backend).

Times, in interleaved rounds (medians, so load drift cancels): a 1-token target
step, verify forwards of w tokens with the shim's few-row gemm kernel on and
off, the drafter's proposal, and single ops; counts the primitive ops in each
graph (mlx-cpu runs `mx.fast` norms, RoPE and attention as op graphs).

  PYTHONPATH=. python bench/step_profile/profile_step.py [--model M --drafter D] --out bench/step_profile
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
from mlx_dflash.platform import fastblas
from mlx_dflash import load  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402

import mlx.core as mx  # noqa: E402


def ops(*outs) -> Counter:
    s = io.StringIO()
    mx.export_to_dot(s, *outs)
    return Counter(re.findall(r'label ="?([A-Za-z_]+)', s.getvalue()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default="bench/step_profile")
    args = ap.parse_args()
    model, tok, drafter = load(args.model, args.drafter)
    T = Target(model)
    cap = list(drafter.config.target_layer_ids)
    cache = T.make_cache()
    ids = (mx.arange(args.context) * 7919 + 11) % T.vocab_size
    _, f = T(ids[None], cache, cap)
    mx.eval(f)
    dc = drafter.make_cache()
    mx.eval(drafter.propose(T, 5, f, dc, 2).tokens)
    B = drafter.block_size

    def verify(w):
        lg, ff = T(mx.array([[5] * w]), cache, cap)
        mx.argmax(lg[0], axis=-1).tolist()
        mx.eval(ff)
        T.trim(cache, w)

    x = mx.random.normal((1, 1, model.args.hidden_size))
    wt = mx.random.normal((model.args.intermediate_size, model.args.hidden_size))
    mx.eval(x, wt)
    probes = {
        "target step, 1 token": lambda: verify(1),
        **{f"verify w={w}, kernel {k}": (lambda w=w, k=k: (fastblas.set_small_gemm(k == "on"), verify(w)))
           for w in (2, 4, B) for k in ("on", "off")},
        f"drafter proposal w={B}": lambda: mx.eval(drafter.propose(T, 5, None, dc, B).tokens),
        "one elementwise op (x + 1)": lambda: mx.eval(x + 1),
        "one 1-row linear (H -> I)": lambda: mx.eval(x @ wt.T),
    }
    for fn in probes.values():  # warm-up: first calls at a shape are slow
        fn()
    times = {k: [] for k in probes}
    for _ in range(args.rounds):
        for k, fn in probes.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    fastblas.set_small_gemm(True)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    lg, ff = T(mx.array([[5]]), cache, cap)
    step_ops = ops(lg, ff)
    mx.eval(lg, ff)
    T.trim(cache, 1)
    h = drafter(T.embed(mx.array([[5] + [drafter.config.mask_token_id] * (B - 1)])), None, dc)
    draft_ops = ops(T.head(h[0, 1:]))
    res = {"ms": med, "step_ops": sum(step_ops.values()), "step_ops_top": step_ops.most_common(12),
           "draft_forward_ops": sum(draft_ops.values()), "blas": fastblas.STATE["blas"],
           "context": args.context, "rounds": args.rounds,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    t1 = med["target step, 1 token"]
    lines = [f"# Where a decode step's time goes ({res['date_utc']} UTC)", "",
             f"Embedded pair, context {args.context}, {args.rounds} interleaved rounds (medians); {res['blas']}.", "",
             "```", "PYTHONPATH=. python " + " ".join(sys.argv), "```", "",
             "| probe | ms | / target step |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {v / t1:.2f} |" for k, v in med.items()]
    lines += ["", f"Graph nodes (arrays, incl. weights) in a 1-token target step: {res['step_ops']}; "
              f"most common: {', '.join(f'{k} {n}' for k, n in res['step_ops_top'])}.",
              f"Drafter block forward + head (w={B}): {res['draft_forward_ops']} nodes."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
