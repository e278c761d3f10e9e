"""Logits processors inside DFlash's verify (mlx_dflash/engine/logits.py) on the
embedded pair (target + DFlash 2 drafter), greedy: per processor (none,
logit_bias + repetition penalty, a constrained JSON schema), plain decoding
with the processors vs DFlash with them at a fixed width (guard off, so the
numbers do not depend on the guard's calibration), tokens compared one by one
(lossless), tau, decode tokens/s, and the host time of the processors' calls
(per call: DFlash calls them once per verify row, plain once per token).

    PYTHONPATH=. python bench/processors_verify/processors.py --out bench/processors_verify.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlx_lm.sample_utils import make_logits_processors

from app.server.structured import Constrained, parse_format
from mlx_dflash import generate
from mlx_dflash import load
from mlx_dflash.models.discovery import default_pair

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "List three uses of the sort command.",
    "Give the JSON for a person named Ada, aged 36, from London.",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}


def processors(kind, tok, model, n_prompt):
    if kind == "none":
        return []
    if kind == "bias+penalty":
        return make_logits_processors({tok.encode(" the", add_special_tokens=False)[0]: -2.0}, 1.2, 20)
    return [Constrained(parse_format("json_schema", SCHEMA, "response_format"), tok, model.args.vocab_size,
                        n_prompt)]


class Timed:
    """A processor with its calls counted and their host time summed."""

    def __init__(self, p, clock):
        self.p, self.clock = p, clock

    def __call__(self, tokens, logits):
        t = time.perf_counter()
        out = self.p(tokens, logits)
        self.clock[0] += 1
        self.clock[1] += time.perf_counter() - t
        return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t, d = default_pair()
    model, tok, drafter = load(str(t), str(d))
    rows = []
    for kind in ("none", "bias+penalty", "json"):
        agg = {"plain": [0, 0.0], "dflash": [0, 0.0]}
        clocks = {"plain": [0, 0.0], "dflash": [0, 0.0]}  # processor calls, their host seconds
        acc = [0, 0]
        same = True
        for p in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            outs = {}
            for mode in ("plain", "dflash"):
                kw = dict(verify_mode="off") if mode == "plain" else dict(block_size=a.width, guard=False)
                tic = time.perf_counter()
                r = generate(model, tok, ids, drafter, max_tokens=a.max_tokens,
                             logits_processors=[Timed(x, clocks[mode]) for x in processors(kind, tok, model, len(ids))],
                             **kw)
                wall = time.perf_counter() - tic
                outs[mode] = r.token_ids
                agg[mode][0] += r.stats.generation_tokens
                agg[mode][1] += r.stats.generation_time
                if mode == "dflash":
                    acc[0] += r.stats.accepted + r.stats.cycles
                    acc[1] += r.stats.cycles
                print(f"{kind:13s} {mode:6s} {r.stats.generation_tokens:4d} tok {wall:6.2f}s "
                      f"tau {r.stats.tau:.2f} {r.text[:60]!r}", flush=True)
            same &= outs["plain"] == outs["dflash"]
        row = dict(processors=kind, identical=same, tau=acc[0] / max(1, acc[1]),
                   plain_tok_s=agg["plain"][0] / agg["plain"][1], dflash_tok_s=agg["dflash"][0] / agg["dflash"][1])
        row["speedup"] = row["dflash_tok_s"] / row["plain_tok_s"]
        for mode, (n, sec) in clocks.items():
            row[f"{mode}_processor_calls"] = n
            row[f"{mode}_processor_ms_per_call"] = 1e3 * sec / n if n else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(dict(width=a.width, max_tokens=a.max_tokens, prompts=PROMPTS, rows=rows),
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()
