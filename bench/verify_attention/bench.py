"""c(w), a verify's cost in one-token steps, against context length: mlx-lm's
attention (`Target.__call__`, today's verify) against the split form
(`Target.verify_forward`, target/verify_attention.py); bench/verify_attention.md.

Per model and context length: a cache holding `n` tokens (the first 1024
prefilled, the rest random K/V rows as calibrate.SYNTHETIC_FROM does: a step's
cost depends on shapes, not values), then in each round, interleaved: a
one-token step (mlx-lm's own forward: what plain decoding pays), and for each
width w a w-token forward through each form, each evaluated with its argmax
(what a verify reads back) and the cache restored after it. c(w) is the median
over rounds of T(w) / T(1) within the round (load drift cancels within a
round); c_cpu the same with this process's CPU time, which another process's
load does not inflate (it counts every thread: a product on two threads counts
twice). Also the largest |logit difference| between the two forms, whether
their argmaxes agree on every row, and how far each is from the logits of w
one-token steps on the same tokens (plain decoding): the tolerance a verify has
today.

    PYTHONPATH=. python bench/verify_attention/bench.py --models embedded:float32,qwen3-0.6b:float32 \\
        --contexts 1024,4096,8192,16384,32768 --widths 2,3,5,8,16 --rounds 5 --out bench/verify_attention
    PYTHONPATH=. python bench/verify_attention/bench.py --sweep "4,2,96;16,8,128;4,2,96:bfloat16" \\
        --contexts 256,512,1024,2048,4096 --widths 2,5,16 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: E402,F401 (first: it binds mlx-cpu to the fast BLAS, fastblas.py)
import mlx.core as mx  # noqa: E402

from app.bench.realistic import build_target  # noqa: E402
from mlx_dflash.engine.calibrate import extend_with_random_rows  # noqa: E402
from mlx_dflash.models.discovery import default_pair  # noqa: E402
from mlx_dflash.models.loader import load as load_pair  # noqa: E402
from mlx_dflash.target import verify_attention as va  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402

REAL_ROWS = 1024


def load(spec: str):
    """'embedded:float32' (the embedded target) or a realistic target name ('qwen3-0.6b:float32')."""
    name, _, dtype = spec.partition(":")
    dtype = dtype or "float32"
    if name == "embedded":
        return load_pair(str(default_pair()[0]), None, dtype=dtype, auto_drafter=False)[0]
    return build_target(name, dtype)


def filled(target: Target, n: int):
    cache = target.make_cache()
    real = min(n, REAL_ROWS)
    ids = ((mx.arange(real) * 7919 + 11) % target.vocab_size)[None]
    for a in range(0, real, 512):
        mx.eval(target(ids[:, a: a + 512], cache)[0])
    if n > real:
        extend_with_random_rows(cache, n - real)
    mx.eval([c.state for c in cache])
    return cache


def timed(fn, tokens, cache, restore):
    """(wall seconds, CPU seconds of this process, logits) of one forward read back as a verify is."""
    t, c = time.perf_counter(), time.process_time()
    logits, _ = fn(tokens, cache)
    mx.eval(mx.argmax(logits, axis=-1))
    dt, dc = time.perf_counter() - t, time.process_time() - c
    restore()
    return dt, dc, logits


def measure(target: Target, n: int, widths, rounds: int) -> dict:
    cache = filled(target, n)
    restore = target.checkpoint(cache)
    toks = {w: ((mx.arange(w) * 31 + 5) % target.vocab_size)[None] for w in [1, *widths]}
    forms = {"mlx": target.__call__, "split": target.verify_forward}
    err, agree, off_plain = {}, {}, {}
    for w in widths:  # warm-up (first calls at a shape) and the exactness check
        a = timed(forms["mlx"], toks[w], cache, restore)[2]
        b = timed(forms["split"], toks[w], cache, restore)[2]
        err[w] = mx.abs(a - b).max().item()
        agree[w] = bool(mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item())
        plain = mx.concatenate([target(toks[w][:, i: i + 1], cache)[0] for i in range(w)], axis=1)  # w steps
        mx.eval(plain)
        restore()
        off_plain[w] = {f: mx.abs(x - plain).max().item() for f, x in (("mlx", a), ("split", b))}
    timed(forms["mlx"], toks[1], cache, restore)
    t1, c1 = [], []
    wall = {f: {w: [] for w in widths} for f in forms}
    cpu = {f: {w: [] for w in widths} for f in forms}
    for _ in range(rounds):
        one, one_cpu, _ = timed(forms["mlx"], toks[1], cache, restore)
        t1.append(one)
        c1.append(one_cpu)
        for w in widths:
            for f, fn in forms.items():
                dt, dc, _ = timed(fn, toks[w], cache, restore)
                wall[f][w].append(dt / one)
                cpu[f][w].append(dc / one_cpu)

    def med(per):
        return {f: {w: statistics.median(r) for w, r in x.items()} for f, x in per.items()}

    return {"context": n, "t1_ms": 1e3 * statistics.median(t1), "t1_cpu_ms": 1e3 * statistics.median(c1),
            "c": med(wall), "c_cpu": med(cpu), "max_abs_logit_diff": err, "argmax_equal": agree,
            "max_abs_logit_diff_from_plain_steps": off_plain}


def sweep(shape: str, prefixes, widths, reps: int) -> list:
    """Where the split form pays (verify_attention.MIN_SCORES): one layer's
    attention alone, mlx-lm's (mx.fast, causal) against the split form, for
    `shape` 'heads,kv_heads,head_dim[:dtype]' over each prefix length and width;
    medians of `reps` interleaved runs (wall clock). Returns rows of
    (prefix, width, mlx ms, split ms)."""
    dims, _, dtype = shape.partition(":")
    H, G, D = (int(x) for x in dims.split(","))
    dt = getattr(mx, dtype or "float32")
    out = []
    for S in prefixes:
        for w in widths:
            ks = mx.random.split(mx.random.key(S + w), 3)
            q = mx.random.normal((1, H, w, D), key=ks[0]).astype(dt)
            k = mx.random.normal((1, G, S + w, D), key=ks[1]).astype(dt)
            v = mx.random.normal((1, G, S + w, D), key=ks[2]).astype(dt)
            mx.eval(q, k, v)
            fns = {"mlx": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal"),
                   "split": lambda: va.split_attention(q, k, v, D ** -0.5, "causal")}
            times = {f: [] for f in fns}
            for i in range(reps + 2):
                for f, fn in fns.items():
                    t = time.perf_counter()
                    mx.eval(fn())
                    if i >= 2:
                        times[f].append(time.perf_counter() - t)
            out.append((S, w, 1e3 * statistics.median(times["mlx"]), 1e3 * statistics.median(times["split"])))
            print(f"{shape} prefix {S} width {w}: mlx {out[-1][2]:.2f} ms, split {out[-1][3]:.2f} ms, "
                  f"ratio {out[-1][3] / out[-1][2]:.2f}", flush=True)
    return out


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    return r.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="embedded:float32")
    ap.add_argument("--contexts", default="1024,4096,8192,16384,32768")
    ap.add_argument("--widths", default="2,3,5,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for one JSON per model")
    ap.add_argument("--sweep", default=None, help="instead: one layer's attention alone, split against mlx-lm's, "
                    "for shapes 'heads,kv_heads,head_dim[:dtype]' separated by ';', at --contexts x --widths")
    a = ap.parse_args(argv)
    widths = [int(x) for x in a.widths.split(",")]
    code = commit()  # the code this process runs (HEAD may move while it does)
    if a.sweep:
        rows = {shape: sweep(shape, [int(x) for x in a.contexts.split(",")], widths, a.rounds)
                for shape in a.sweep.split(";")}
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, "sweep.json").write_text(json.dumps({"argv": sys.argv, "commit": code, "rows": rows}))
        return 0
    for spec in a.models.split(","):
        target = Target(load(spec))
        rows = []
        load_before = os.getloadavg()
        for n in (int(x) for x in a.contexts.split(",")):
            r = measure(target, n, widths, a.rounds)
            rows.append(r)
            print(f"{spec} context {n}: t1 {r['t1_ms']:.1f} ms  "
                  + "  ".join(f"c({w}) {r['c']['mlx'][w]:.2f} -> {r['c']['split'][w]:.2f}" for w in widths)
                  + "  | CPU time: "
                  + "  ".join(f"{r['c_cpu']['mlx'][w]:.2f} -> {r['c_cpu']['split'][w]:.2f}" for w in widths)
                  + f"  max |dlogit| {max(r['max_abs_logit_diff'].values()):.2e}"
                  + "  from plain steps: today {:.2e}, split {:.2e}".format(
                      *(max(d[f] for d in r["max_abs_logit_diff_from_plain_steps"].values()) for f in ("mlx", "split")))
                  + f"  argmax equal {all(r['argmax_equal'].values())}", flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, spec.replace(":", "-") + ".json").write_text(json.dumps(
                {"model": spec, "argv": sys.argv, "rounds": a.rounds, "commit": code,
                 "load_average": {"start": load_before, "end": os.getloadavg()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
