"""Prompt lookup (verify mode `lookup`) on HumanEval "repeat this function with
one change" prompts.

Two measurements, side by side:
- replay: what lookup drafting gives when the target writes the requested
  edit. The expected answer (the function with the change applied) is fed
  token by token as the target's output; each cycle proposes w-1 tokens from
  the n-gram index (prompt + answer so far), accepts the prefix that matches
  the answer, plus the bonus. No model: this measures the drafting, and is
  what a target that follows the instruction would see.
- model: the embedded target itself, greedy, verify mode lookup vs plain
  mlx-lm in the same run (tokens compared one by one: lossless), tau and
  speed. The embedded 11M target does not reliably copy code, so its tau is
  far lower than the replay's.

    MLX_DFLASH_BLAS_THREADS=1 PYTHONPATH=. python bench/lookup/lookup.py --out bench/lookup
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx

from app.bench.prompts import repeat_function as prompts  # (the prompt set is a bench set now)
from mlx_dflash.drafting.lookup import NgramIndex


def replay(prompt_ids, answer_ids, width):
    """Cycles of lookup drafting against a known answer: (tokens, cycles, lookup cycles)."""
    idx = NgramIndex(prompt_ids)
    i = cycles = looked = 0
    while i < len(answer_ids):
        drafts = idx.propose(min(width - 1, len(answer_ids) - i - 1))
        a = 0
        while a < len(drafts) and drafts[a] == answer_ids[i + a]:
            a += 1
        out = answer_ids[i: i + a + 1]  # accepted drafts + the target's own token
        idx.extend(out)
        i += len(out)
        cycles += 1
        looked += bool(drafts)
    return len(answer_ids), cycles, looked


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/target")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="5,8,16")
    ap.add_argument("--out", default="bench/lookup")
    args = ap.parse_args()
    import mlx_lm

    from mlx_dflash import load, stream_generate

    model, tok, _ = load(args.model)
    widths = [int(w) for w in args.widths.split(",")]
    ps = prompts(tok, args.num_prompts)
    rows = []
    for w in widths:  # replay
        tot = cyc = look = 0
        for p in ps:
            pid = p["prompt"] if isinstance(p["prompt"], list) else tok.encode(p["prompt"], add_special_tokens=False)
            t, c, lk = replay(pid, tok.encode(p["expected"], add_special_tokens=False), w)
            tot, cyc, look = tot + t, cyc + c, look + lk
        rows.append({"kind": "replay", "width": w, "tau": tot / cyc, "lookup_share": look / cyc, "tokens": tot})
        print(f"replay  w={w:2d}  tau {tot / cyc:.2f}  ({look}/{cyc} cycles drafted)", flush=True)

    def timed(gen):
        ids, t0, last = [], None, None
        for r in gen:
            if t0 is None:
                t0 = time.perf_counter()
            ids.append(r.token)
            last = r
        return ids, len(ids) - 1, time.perf_counter() - t0, last

    def plain(p):
        return timed(mlx_lm.stream_generate(model, tok, p, max_tokens=args.max_tokens))

    def ours(p, w):
        return timed(stream_generate(model, tok, p, None, max_tokens=args.max_tokens, verify_mode="lookup", block_size=w))

    plain(ps[0]["prompt"])
    for w in widths:
        ours(ps[0]["prompt"], w)
    acc = {w: {"n": 0, "t": 0.0, "cycles": 0, "ctok": 0, "looked": 0, "same": 0} for w in widths}
    base = {"n": 0, "t": 0.0}
    eos = set(tok.eos_token_ids)
    for i, p in enumerate(ps):  # the methods in turn, the order rotating from prompt to prompt
        methods = [None] + widths
        methods = methods[i % len(methods):] + methods[: i % len(methods)]
        res = {}
        for m in methods:
            res[m] = plain(p["prompt"]) if m is None else ours(p["prompt"], m)
        ref = [t for t in res[None][0] if t not in eos]
        base["n"] += res[None][1]
        base["t"] += res[None][2]
        for w in widths:
            ids, n, t, last = res[w]
            s = last.stats
            a = acc[w]
            a["n"] += n
            a["t"] += t
            a["cycles"] += s.cycles
            a["ctok"] += s.cycle_tokens
            a["looked"] += s.lookup_cycles
            a["same"] += [x for x in ids if x not in eos] == ref
    tps0 = base["n"] / base["t"]
    rows.append({"kind": "mlx-lm", "width": 1, "tok_s": tps0, "x_mlx_lm": 1.0})
    for w in widths:
        a = acc[w]
        tps = a["n"] / a["t"]
        rows.append({"kind": "model", "width": w, "tau": a["ctok"] / a["cycles"], "tok_s": tps,
                     "x_mlx_lm": tps / tps0, "lookup_share": a["looked"] / a["cycles"],
                     "lossless": f"{a['same']}/{len(ps)}"})
        print(f"model   w={w:2d}  tau {rows[-1]['tau']:.2f}  {tps:.1f} tok/s  {tps / tps0:.2f}x mlx-lm  "
              f"lossless {a['same']}/{len(ps)}", flush=True)
    meta = {"command": " ".join(sys.argv), "machine": f"{platform.platform()}, {__import__('os').cpu_count()} CPUs "
            "(shared with other jobs during the run)", "mlx": mx.__version__, "device": str(mx.default_device()),
            "prompts": len(ps), "max_tokens": args.max_tokens, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "mlx_lm_tok_s": tps0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "prompts": [
        {"id": p["id"], "expected": p["expected"]} for p in ps]}, indent=1))
    md = ["| measurement | width | tau | drafted cycles | tok/s | x mlx-lm | lossless |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['kind']} | {r['width']} | {r.get('tau', 1.0):.2f} | "
                  f"{r.get('lookup_share', 0):.0%} | {r.get('tok_s', float('nan')):.1f} | "
                  f"{r.get('x_mlx_lm', float('nan')):.2f} | {r.get('lossless', '-')} |")
    (out / "results.md").write_text("\n".join(md) + "\n\n```\n" + json.dumps(meta, indent=1) + "\n```\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
