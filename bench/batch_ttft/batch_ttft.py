"""Time to first token in the batch engine when N requests arrive at once: new
prompts prefilled together (`prefill_together`: one left-padded batched
forward, for targets with only KV layers) vs one after another (the default),
on the embedded pair. The prompts of the batch bench of the time (the last GSM8K
train problems); also checks every stream's
token ids are the same both ways."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (fast BLAS before mlx)
from app.bench.batch import summarize
from mlx_dflash import DecodeConfig
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.models.loader import load


def prompts(tok, n):
    """The last n GSM8K train problems (the embedded pair never trained on them), chat-templated."""
    path = Path("/work/shared/data/gsm8k/train.jsonl")
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][-n:]
        return [list(tok.apply_chat_template([{"role": "user", "content": r["question"]}],
                                             add_generation_prompt=True)) for r in rows]
    return [tok.encode(f"Question {i}: how many apples are left if Tom has {i + 7} and eats 3?") for i in range(n)]


def run(model, tok, drafter, ps, max_tokens, together):
    eng = BatchEngine(model, tok, drafter, max_batch=len(ps), prefill_together=together)
    t0 = time.perf_counter()
    uids = [eng.submit(p, DecodeConfig(max_tokens=max_tokens)) for p in ps]
    times = {u: [] for u in uids}
    ids = {u: [] for u in uids}

    def got(u, r):
        times[u].append(time.perf_counter())
        ids[u].append(r.token)

    while len(eng):
        eng.step(got)
    wall = time.perf_counter() - t0
    return [times[u] for u in uids], [ids[u] for u in uids], t0, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    model, tok, drafter = load(dtype=a.dtype)
    ps = prompts(tok, max(a.streams))
    run(model, tok, drafter, ps[:2], 4, True)  # warm-up (shapes, the guard's curves)
    for rep in range(a.reps):
        for n in a.streams:
            base = None
            for together in (False, True):
                times, ids, t0, wall = run(model, tok, drafter, ps[:n], a.max_tokens, together)
                s = summarize("together" if together else "one-by-one", n, times, t0, wall)
                s["rep"] = rep
                if base is None:
                    base = ids
                else:
                    s["same_ids_as_one_by_one"] = ids == base
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}), flush=True)


if __name__ == "__main__":
    main()
