"""A fixed-width DFlash cycle, side by side with z-lab's MLX loop (issue 36 item 6).

One process, the same model objects and the same BLAS shim for both loops: the
embedded target (models/target) and DFlash 2 drafter (models/dflash2), loaded by
the project in the compute dtype $MLX_DFLASH_DTYPE asks for; the reference's
drafter is read from the same folder by its own loader (`dflash.model_mlx.load_draft`,
its hub download pointed at the local folder) and cast to the same dtype; both
borrow the same target's embedding and head.

For each round, prompt and width the two loops run back to back (their order
alternating), greedy, `--max-tokens`: the reference's `stream_generate(...,
block_size=w)` and ours (`Decoder`, DecodeConfig(guard=False, block_size=w)).
Decode time runs from the first token (the prefill's) to the last; a cycle is one
draft + verify. Every output is checked against the other loop's and against plain
decoding (mlx-lm's `stream_generate`).

    bench/reference_loop/setup.sh            # the env, once
    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 \\
      PYTHONPATH=. /work/benchenv/refloop/bin/python bench/reference_loop/bench.py --out bench/reference_loop
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # (run from the checkout: PYTHONPATH=.)

import mlx_dflash  # noqa: E402,F401  (the BLAS shim binds before mlx is imported)
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402

from mlx_dflash.engine.decode_config import DecodeConfig  # noqa: E402
from mlx_dflash.engine.decoder import Decoder  # noqa: E402
from mlx_dflash.models.dtype_choice import cast, param_dtype  # noqa: E402
from mlx_dflash.models.loader import load  # noqa: E402
from mlx_dflash.platform import fastblas  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402


def strip_eos(ids, eos):
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


def run_plain(model, tok, prompt, max_tokens):
    return [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens)]


def run_ref(ref, model, draft, tok, prompt, w, max_tokens):
    """(token ids, decode seconds, cycles) of the reference's loop."""
    ids, cycles, t0 = [], 0, None
    for r in ref.stream_generate(model, draft, tok, prompt, block_size=w, max_tokens=max_tokens):
        if t0 is None:
            t0 = time.perf_counter()
        elif r.accepted is not None:
            cycles += 1
        ids += r.tokens
    return ids, time.perf_counter() - t0, cycles


def load_base(path: str):
    """The package as of another commit (`git archive COMMIT mlx_dflash | tar -x -C DIR`),
    imported as `mlx_dflash_base` (its imports are relative): an A/B in one process."""
    import importlib.util

    init = Path(path) / "mlx_dflash" / "__init__.py"
    spec = importlib.util.spec_from_file_location("mlx_dflash_base", init,
                                                  submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mlx_dflash_base"] = mod
    spec.loader.exec_module(mod)
    import importlib as il

    return {k: il.import_module(f"mlx_dflash_base.{m}") for k, m in
            (("cfg", "engine.decode_config"), ("dec", "engine.decoder"), ("drafter", "drafting.drafter"),
             ("adapter", "target.adapter"))}


def run_ours(model, tok, drafter, target, prompt, w, max_tokens, mods=None):
    DC, Dec = (mods["cfg"].DecodeConfig, mods["dec"].Decoder) if mods else (DecodeConfig, Decoder)
    cfg = DC(max_tokens=max_tokens, block_size=w, guard=False, verify_mode="dflash")
    dec = Dec(model, tok, drafter, cfg, target=target)
    ids, t0 = [], None
    for r in dec.run(prompt):
        if t0 is None:
            t0 = time.perf_counter()
        ids.append(r.token)
    dt = time.perf_counter() - t0
    st = dec.stats
    assert st.plain_cycles == 0, "a fixed width must draft on every cycle"
    return ids, dt, st.cycles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="gsm8k-dev")
    ap.add_argument("--num-prompts", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="5,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--base", default=None, help="a folder holding mlx_dflash/ as of another commit: run it too")
    a = ap.parse_args()
    widths = [int(x) for x in a.widths.split(",")]

    import dflash.model_mlx as ref

    model, tok, drafter = load(str(ROOT / "models/target"), str(ROOT / "models/dflash2"))
    tok = tok if isinstance(tok, TokenizerWrapper) else TokenizerWrapper(tok)
    target = Target(model)  # built before the reference wraps the model's layers in its hooks
    loops = ["ref", "ours"]
    if a.base:
        mods = load_base(a.base)
        bdrafter = mods["drafter"].load_drafter(str(ROOT / "models/dflash2"))
        cast(bdrafter, param_dtype(model))
        btarget = mods["adapter"].Target(model)
        loops.append("base")
    ref.snapshot_download = lambda path, **kw: path  # its loader, reading the local folder
    rdraft = ref.load_draft(str(ROOT / "models/dflash2"))
    cast(rdraft, param_dtype(model))  # the compute dtype the project chose for both of its models
    eos = set(tok.eos_token_ids)

    from app.bench.prompts import load_prompts

    prompts = load_prompts(a.prompts, tok, a.num_prompts)
    plain = [strip_eos(run_plain(model, tok, p["prompt"], a.max_tokens), eos) for p in prompts]

    # warm-up: both loops once at each width (graph caches, the shim's pool)
    def run(who, prompt, w):
        if who == "ref":
            return run_ref(ref, model, rdraft, tok, prompt, w, a.max_tokens)
        if who == "base":
            return run_ours(model, tok, bdrafter, btarget, prompt, w, a.max_tokens, mods)
        return run_ours(model, tok, drafter, target, prompt, w, a.max_tokens)

    for w in widths:
        for who in loops:
            run(who, prompts[0]["prompt"], w)

    load0 = os.getloadavg()
    rec = {w: {who: [] for who in loops} for w in widths}
    mismatches = []
    k = 0
    for rnd in range(a.rounds):
        for i, p in enumerate(prompts):
            for w in widths:
                k += 1
                order = loops[k % len(loops):] + loops[: k % len(loops)]  # each loop first in turn
                if k % 2:
                    order = order[::-1]
                for who in order:
                    ids, dt, cyc = run(who, p["prompt"], w)
                    ids = strip_eos(ids, eos)
                    if ids != plain[i]:
                        mismatches.append({"who": who, "width": w, "prompt": p["id"], "round": rnd})
                    rec[w][who].append({"prompt": i, "round": rnd, "tokens": len(ids), "time": dt, "cycles": cyc})
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)

    def agg(runs):
        per_cycle = [r["time"] / r["cycles"] * 1e3 for r in runs if r["cycles"]]
        cycles = sum(r["cycles"] for r in runs)
        toks = sum(r["tokens"] - 1 for r in runs)
        return {"per_cycle_ms_median": statistics.median(per_cycle),
                "per_cycle_ms_pooled": sum(r["time"] for r in runs) / cycles * 1e3,
                "tok_s_pooled": toks / sum(r["time"] for r in runs),
                "tau": sum(r["tokens"] - 1 for r in runs) / cycles, "cycles": cycles, "runs": len(runs)}

    summary = {}
    for w in widths:
        R, O = agg(rec[w]["ref"]), agg(rec[w]["ours"])
        # per (prompt, round) pair: the reference's per-cycle time over ours (> 1: ours faster)
        pairs = [r["time"] / r["cycles"] / (o["time"] / o["cycles"])
                 for r, o in zip(rec[w]["ref"], rec[w]["ours"]) if r["cycles"] and o["cycles"]]
        summary[w] = {"ref": R, "ours": O, "speedup_per_cycle_median_of_pairs": statistics.median(pairs),
                      "speedup_per_cycle_pooled": R["per_cycle_ms_pooled"] / O["per_cycle_ms_pooled"],
                      "speedup_tok_s_pooled": O["tok_s_pooled"] / R["tok_s_pooled"]}
        if "base" in rec[w]:
            Bs = agg(rec[w]["base"])
            bp = [r["time"] / r["cycles"] / (o["time"] / o["cycles"])
                  for r, o in zip(rec[w]["ref"], rec[w]["base"]) if r["cycles"] and o["cycles"]]
            ob = [b["time"] / b["cycles"] / (o["time"] / o["cycles"])
                  for b, o in zip(rec[w]["base"], rec[w]["ours"]) if b["cycles"] and o["cycles"]]
            summary[w].update(base=Bs, base_speedup_per_cycle_median_of_pairs=statistics.median(bp),
                              base_speedup_per_cycle_pooled=R["per_cycle_ms_pooled"] / Bs["per_cycle_ms_pooled"],
                              ours_over_base_per_cycle_median_of_pairs=statistics.median(ob))

    cmd = " ".join(["MLX_DFLASH_DTYPE=" + os.environ.get("MLX_DFLASH_DTYPE", ""),
                    "MLX_DFLASH_BLAS_THREADS=" + os.environ.get("MLX_DFLASH_BLAS_THREADS", ""),
                    "MLX_DFLASH_KERNEL_THREADS=" + os.environ.get("MLX_DFLASH_KERNEL_THREADS", ""),
                    "PYTHONPATH=. " + sys.executable, "bench/reference_loop/bench.py"] + sys.argv[1:])
    meta = {"command": cmd, "label": a.label, "load_average_start": load0,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "blas": fastblas.STATE["blas"], "dtype": str(param_dtype(model)), "prompts": a.prompts,
            "num_prompts": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds,
            "python": platform.python_version(), "mlx": mx.__version__, "load_average": os.getloadavg(),
            "outputs_identical": not mismatches, "mismatches": mismatches}
    lines = [f"{a.label or 'run'} ({meta['when']}; load average {load0[0]:.2f} -> {meta['load_average'][0]:.2f}; "
             f"{meta['blas']}; {meta['dtype']}; "
             f"{len(prompts)} {a.prompts} prompts x {a.rounds} rounds, {a.max_tokens} tokens)",
             "| width | ref ms/cycle | ours ms/cycle | ref/ours per cycle (median of pairs) | pooled | tok/s ref | "
             "tok/s ours | tau ref | tau ours |", "|---|---|---|---|---|---|---|---|---|"]
    for w, s in summary.items():
        R, O = s["ref"], s["ours"]
        lines.append(f"| {w} | {R['per_cycle_ms_median']:.2f} | {O['per_cycle_ms_median']:.2f} | "
                     f"{s['speedup_per_cycle_median_of_pairs']:.3f}x | {s['speedup_per_cycle_pooled']:.3f}x | "
                     f"{R['tok_s_pooled']:.1f} | {O['tok_s_pooled']:.1f} | {R['tau']:.2f} | {O['tau']:.2f} |")
    for w, s in summary.items():
        if "base" in s:
            lines.append(f"base (--base {a.base}) at width {w}: {s['base']['per_cycle_ms_median']:.2f} ms/cycle, "
                         f"ref/base {s['base_speedup_per_cycle_median_of_pairs']:.3f}x (median of pairs), "
                         f"{s['base_speedup_per_cycle_pooled']:.3f}x pooled; tau {s['base']['tau']:.2f}; "
                         f"base/ours {s['ours_over_base_per_cycle_median_of_pairs']:.3f}x (median of pairs)")
    lines.append(f"every output identical to plain decoding (mlx-lm) and to the other loop's: "
                 f"{'yes' if not mismatches else 'NO: ' + json.dumps(mismatches[:5])}")
    lines.append(f"command: {cmd}")
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"results{('_' + a.label) if a.label else ''}.json"
        (out / name).write_text(json.dumps({"meta": meta, "summary": summary, "runs": rec}, indent=1) + "\n")


if __name__ == "__main__":
    main()
