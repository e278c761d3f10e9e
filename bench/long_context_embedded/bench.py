"""Issue 36: the embedded pair at long context. For each length n, one prompt of
n tokens (this repository's own Python source, then a question: a coding
agent's kind of prompt, which repeats itself; `--text docs`: its markdown,
then a question, which repeats itself far less) is prefilled once; every decode
run starts from a copy of that cache: plain decoding (verify mode off), the
default (the guard), and fixed widths, interleaved over `--rounds` rounds.
Reported per length: tok/s (median) and x plain, each method's output equal to
plain's, the guard's reason, and c(w) / d(w) at that length from the guard's
own curves (measured before the runs, as `generate` measures them at load).

    MLX_DFLASH_DTYPE=float32 PYTHONPATH=. python bench/long_context_embedded/bench.py \
        --contexts 1024,4096,8192,16384 --rounds 3 --max-tokens 64 --out bench/long_context_embedded/results.json
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.bench.long import prefill
from app.bench.runs import run_ours
from mlx_dflash.engine.calibrate import DEFAULT
from mlx_dflash.engine.cost_source import prepare_at_load
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.registry import priced_at
import mlx.core as mx

QUESTIONS = {"source": "\n\n# Question: what does the last function above do, and how would you test it?\n",
             "docs": "\n\nQuestion: in two sentences, what is the section above about?\n"}


def source_text() -> str:
    files = sorted(Path("mlx_dflash").rglob("*.py")) + sorted(Path("app").rglob("*.py"))
    return "".join(f"\n# file: {p}\n{p.read_text()}" for p in files)


def docs_text() -> str:
    """This repository's prose (its markdown, bench outputs left out): a long
    document and a question, which repeats itself far less than source does."""
    files = [p for p in sorted(Path(".").rglob("*.md"))
             if not any(x in ("node_modules", "bench") or x.startswith(".") for x in p.parts)]
    return "".join(f"\n\n{p.read_text()}" for p in files)


def prompt_of(tok, n: int, text: str = "source") -> list:
    ids = tok.encode(source_text() if text == "source" else docs_text())
    q = tok.encode(QUESTIONS[text])
    if len(ids) + len(q) < n:
        ids = ids * (n // len(ids) + 1)
    return ids[: n - len(q)] + q


def tps(run) -> float:
    """Decode tokens per second, first token to last (the prefill excluded)."""
    return run.gen_tokens / run.gen_time if run.gen_time > 0 else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,8192,16384")
    ap.add_argument("--widths", default="3,5,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--text", choices=sorted(QUESTIONS), default="source",
                    help="the prompt: this repository's source, or its prose (docs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lm = load_model(None, settings_store())
    model, tok, drafter = lm.model, lm.tokenizer, lm.drafter
    contexts = [int(x) for x in args.contexts.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    t0 = time.perf_counter()
    line = prepare_at_load(model, drafter, DEFAULT, contexts)  # the guard's curves, before any run
    res = {"command": " ".join(sys.argv), "model": lm.id, "dtype": str(model.parameters()["model"]["norm"]["weight"].dtype),
           "calibration": line or "cached", "calibration_s": time.perf_counter() - t0, "lengths": {}}
    zero = Costs(1.0, {w: 0.0 for w in range(1, 17)}, {w: 0.0 for w in range(1, 17)})
    methods = [("plain", dict(mode="off", width=None, guard=None)), ("default", dict(mode="dflash", width=None, guard=None))]
    methods += [(f"w{w}", dict(mode="dflash", width=w, guard=False)) for w in widths]
    for n in contexts:
        ids = prompt_of(tok, n, args.text)
        pc, pre_s, _ = prefill(model, tok, ids, drafter)
        runs = {name: [] for name, _ in methods}
        for r in range(args.rounds):
            order = methods if r % 2 == 0 else methods[::-1]
            for name, m in order:
                out = run_ours(model, tok, ids, drafter, args.max_tokens, m["width"], m["mode"], zero, guard=m["guard"],
                               prompt_cache=copy.deepcopy(pc))
                runs[name].append(out)
                print(f"n={n} round {r} {name}: {tps(out):.1f} tok/s, cycles {out.cycles}, drafted {out.drafted}, "
                      f"accepted {out.accepted}; {out.policy}", flush=True)
        plain_tps = statistics.median(tps(x) for x in runs["plain"])
        cv = DEFAULT.book.curve(model, drafter, 0, (1, min(5, drafter.block_size)), priced_at(n))
        row = {"prompt_tokens": len(ids), "prefill_s": pre_s, "priced_with": priced_at(n),
               "c": cv.c if cv else None, "d": cv.d if cv else None, "t1_ms": cv.t1 * 1e3 if cv else None,
               "t_plain_ms": cv.t_plain * 1e3 if cv else None, "methods": {}}
        ref = runs["plain"][0].tokens
        for name, rs in runs.items():
            med = statistics.median(tps(x) for x in rs)
            row["methods"][name] = {"tps": med, "x_plain": med / plain_tps, "all_tps": [tps(x) for x in rs],
                                    "identical": all(x.tokens == ref for x in rs),
                                    "cycles": rs[-1].cycles, "drafted": rs[-1].drafted, "accepted": rs[-1].accepted,
                                    "lookup_cycles": rs[-1].lookup_cycles, "policy": rs[-1].policy}
        res["lengths"][str(n)] = row
        del pc
        mx.clear_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({n: {k: round(v["x_plain"], 3) for k, v in r["methods"].items()} for n, r in res["lengths"].items()}))


if __name__ == "__main__":
    main()
