"""Concurrency benchmark (issue 24): N streams arrive at once; aggregate
tokens/s, per-stream time to first token and inter-token latency, for

- dflash-batched: mlx_dflash.engine.batch.BatchEngine (the batch guard picks each
  cycle's width from c(w, B) and live acceptance; plain batched where drafting
  does not pay),
- dflash-batched-w5: the same engine at a fixed width 5 (drafting every cycle),
- plain-batched: mlx-lm's BatchGenerator (continuous batching, no drafts),
- dflash-serial: our single-stream engine (stream_generate, the guard), one
  request after another (stream k waits for streams 1..k-1).

Greedy; every stream's token ids are checked against dflash-serial's (exact).

    python scripts/bench_batch.py [--streams 1 2 4 8] [--max-tokens 64] [--dtype float32] [--out bench/batch.json]

`--lookup-ab`: per-row prompt lookup in the batch, on (dflash-batched) vs
off (dflash-batched-nolookup, DecodeConfig.lookup False), with dflash-serial
for the reference ids. `--prompts`: gsm8k (the default: GSM8K questions),
repeat-function (bench_lookup.py's "repeat this function with one change"
HumanEval prompts) or copy-list ("repeat this list exactly" over 40 random
short ids): contexts that repeat, where lookup hits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from mlx_dflash import DecodeConfig, stream_generate  # noqa: E402
from mlx_dflash.engine.batch import BatchEngine  # noqa: E402
from mlx_dflash.policy.guard import FixedWidth  # noqa: E402
from mlx_dflash.models.loader import load  # noqa: E402
import bench_lookup  # noqa: E402


def prompts(tok, n):
    path = Path("/work/shared/data/gsm8k/train.jsonl")
    if path.exists():  # the last GSM8K train problems (the embedded pair never trained on them)
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][-n:]
        return [list(tok.apply_chat_template([{"role": "user", "content": r["question"]}],
                                             add_generation_prompt=True)) for r in rows]
    return [tok.encode(f"Question {i}: how many apples are left if Tom has {i + 7} and eats 3?") for i in range(n)]


def summarize(name, n, times, t0, wall):
    """times: per stream, the wall times of its tokens."""
    toks = sum(len(t) for t in times)
    ttft = sorted(t[0] - t0 for t in times if t)
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    return {"system": name, "streams": n, "tokens": toks, "wall_s": wall, "aggregate_tps": toks / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "itl_mean_ms": 1000 * statistics.mean(itl) if itl else 0.0,
            "itl_p95_ms": 1000 * sorted(itl)[int(0.95 * (len(itl) - 1))] if itl else 0.0}


def repeat_function_prompts(tok, n):
    """bench_lookup.py's HumanEval "repeat this function with one change" prompts (token ids)."""
    return [list(p["prompt"]) for p in bench_lookup.prompts(tok, n)]


def copy_list_prompts(tok, n, seed=0):
    """"Repeat this list exactly" over 40 random short ids (a text no drafter has seen)."""
    rng = random.Random(seed)

    def ids():
        return " ".join(f"{rng.choice('abcdefghjkmnpqrstuvwxyz')}{rng.randrange(10, 99)}{rng.choice('qwxyz')}"
                        for _ in range(40))
    return [list(tok.apply_chat_template([{"role": "user", "content": "Repeat this list exactly:\n" + ids()}],
                                         add_generation_prompt=True)) for _ in range(n)]


PROMPTS = {"gsm8k": prompts, "repeat-function": repeat_function_prompts, "copy-list": copy_list_prompts}


def run_engine(model, tok, drafter, ps, max_tokens, policy=None, lookup=True, stats=None):
    """`stats`: a list that gets each stream's last GenerationStats, then the engine's summary."""
    eng = BatchEngine(model, tok, drafter, max_batch=len(ps), policy=policy)
    eos = set(tok.eos_token_ids)
    t0 = time.perf_counter()
    uids = [eng.submit(p, DecodeConfig(max_tokens=max_tokens, lookup=lookup)) for p in ps]
    times = {u: [] for u in uids}
    ids = {u: [] for u in uids}
    last = {}

    def got(u, r):  # as each token exists (a first token before the next request's prefill)
        times[u].append(time.perf_counter())
        last[u] = r.stats
        if not (r.finish_reason == "stop" and r.token in eos):
            ids[u].append(r.token)

    while len(eng):
        eng.step(got)
    wall = time.perf_counter() - t0
    if stats is not None:
        stats += [last[u] for u in uids] + [eng.summary()]
    return [times[u] for u in uids], [ids[u] for u in uids], t0, wall, eng.policy.reason


def run_serial(model, tok, drafter, ps, max_tokens):
    eos = set(tok.eos_token_ids)
    t0 = time.perf_counter()
    times, ids = [], []
    for p in ps:
        t, i = [], []
        for r in stream_generate(model, tok, p, drafter, max_tokens=max_tokens):
            t.append(time.perf_counter())
            if not (r.finish_reason == "stop" and r.token in eos):
                i.append(r.token)
        times.append(t)
        ids.append(i)
    return times, ids, t0, time.perf_counter() - t0


def run_mlx_lm(model, tok, ps, max_tokens):
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[t] for t in tok.eos_token_ids],
                         completion_batch_size=len(ps), prefill_batch_size=len(ps))
    t0 = time.perf_counter()
    uids = gen.insert(ps, max_tokens=[max_tokens] * len(ps))
    times = {u: [] for u in uids}
    ids = {u: [] for u in uids}
    left = set(uids)
    while left:
        for r in gen.next_generated():
            times[r.uid].append(time.perf_counter())
            if r.finish_reason != "stop":
                ids[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
    wall = time.perf_counter() - t0
    gen.close()
    return [times[u] for u in uids], [ids[u] for u in uids], t0, wall


def rollback_cost(model, B: int, context: int, w: int, rounds: int = 5) -> dict:
    """The ragged rollback's price: a [B, w] verify, its rollback and the next
    1-token step, when every row drops the same count (the caches' own trim)
    vs when rows drop different counts (rows rolled right by the difference)."""
    import random

    from mlx_dflash.engine import batch_cache as bc
    from mlx_dflash.target.adapter import Target

    t = Target(model)
    ids = ((mx.arange(context) * 7919 + 11) % t.vocab_size).tolist()
    cache = None
    for _ in range(B):
        c = t.make_cache()
        t(mx.array(ids)[None], c)
        mx.eval([x.state for x in c])
        cache = bc.join(cache, bc.to_batch(c))
    rng = random.Random(0)

    def one(ragged):
        drop = [rng.randrange(w) for _ in range(B)] if ragged else [w // 2] * B
        t0 = time.perf_counter()
        logits, _ = t(mx.zeros((B, w), mx.int32), cache)
        mx.eval(logits)
        bc.ragged_trim(cache, drop)
        logits, _ = t(mx.zeros((B, 1), mx.int32), cache)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        bc.ragged_trim(cache, [w - d for d in drop])  # back to the same length (keeps the test stationary)
        bc.ragged_trim(cache, [1] * B)
        return dt

    one(False), one(True)
    same, ragged = [], []
    for _ in range(rounds):
        same.append(one(False))
        ragged.append(one(True))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"B": B, "context": context, "w": w, "uniform_ms": 1000 * med(same), "ragged_ms": 1000 * med(ragged),
            "slots": bc.size(cache)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3, help="runs per system and concurrency; the median run is kept")
    ap.add_argument("--out", default="bench/batch.json")
    ap.add_argument("--lookup-ab", action="store_true", help="per-row prompt lookup in the batch, on vs off")
    ap.add_argument("--prompts", choices=list(PROMPTS), default="gsm8k")
    ap.add_argument("--rollback", action="store_true",
                    help="only the ragged rollback's cost (B 8, w 5, contexts 256..4096)")
    a = ap.parse_args()
    model, tok, drafter = load(dtype=a.dtype)
    if a.rollback:
        for ctx in (256, 1024, 4096):
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                              for k, v in rollback_cost(model, 8, ctx, 5).items()}), flush=True)
        return
    all_ps = PROMPTS[a.prompts](tok, max(a.streams))
    if a.lookup_ab:
        return lookup_ab(a, model, tok, drafter, all_ps)
    # warm-up: shapes, the batch guard's c(w, B) curves (measured once, cached), the serial guard's costs
    for n in a.streams:
        run_engine(model, tok, drafter, all_ps[:n], 4)
    run_serial(model, tok, drafter, all_ps[:1], 4)
    run_mlx_lm(model, tok, all_ps[:2], 4)
    rows = []
    for n in a.streams:
        ps = all_ps[:n]
        runs = {}  # system -> rows of its reps (interleaved: the machine's load drifts)
        for _ in range(a.reps):
            times, ref, t0, wall = run_serial(model, tok, drafter, ps, a.max_tokens)
            runs.setdefault("dflash-serial", []).append(summarize("dflash-serial", n, times, t0, wall))
            times, ids, t0, wall, why = run_engine(model, tok, drafter, ps, a.max_tokens)
            runs.setdefault("dflash-batched", []).append(
                dict(summarize("dflash-batched", n, times, t0, wall), exact=ids == ref, policy=why))
            times, ids, t0, wall, _ = run_engine(model, tok, drafter, ps, a.max_tokens, FixedWidth(5))
            runs.setdefault("dflash-batched-w5", []).append(
                dict(summarize("dflash-batched-w5", n, times, t0, wall), exact=ids == ref))
            times, ids, t0, wall = run_mlx_lm(model, tok, ps, a.max_tokens)
            runs.setdefault("plain-batched", []).append(
                dict(summarize("plain-batched (mlx-lm)", n, times, t0, wall), exact=ids == ref))
        for name, rs in runs.items():
            r = sorted(rs, key=lambda x: x["aggregate_tps"])[len(rs) // 2]
            r["exact"] = all(x.get("exact", True) for x in rs) if name != "dflash-serial" else None
            r["aggregate_tps_runs"] = [round(x["aggregate_tps"], 2) for x in rs]
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    Path(a.out).write_text(json.dumps({"device": str(mx.default_device()), "dtype": a.dtype,
                                       "max_tokens": a.max_tokens, "rows": rows}, indent=1))


def lookup_ab(a, model, tok, drafter, all_ps):
    """dflash-batched with per-row lookup vs without, at each stream count."""
    for n in a.streams:  # warm-up: shapes, the batch guard's curves
        run_engine(model, tok, drafter, all_ps[:n], 4)
    rows = []
    for n in a.streams:
        ps = all_ps[:n]
        _, ref, _, _ = run_serial(model, tok, drafter, ps, a.max_tokens)
        runs = {}
        for _ in range(a.reps):  # interleaved: the machine's load drifts
            for name, look in (("dflash-batched", True), ("dflash-batched-nolookup", False)):
                st = []
                times, ids, t0, wall, why = run_engine(model, tok, drafter, ps, a.max_tokens, lookup=look, stats=st)
                eng = st.pop()
                cyc = sum(s.cycles for s in st)
                runs.setdefault(name, []).append(dict(
                    summarize(name, n, times, t0, wall), exact=ids == ref, policy=why,
                    batch_cycles=eng["cycles"], drafter_forwards=eng["drafter_forwards"],
                    row_cycles=cyc, lookup_cycles=sum(s.lookup_cycles for s in st),
                    plain_cycles=sum(s.plain_cycles for s in st), tau=sum(s.cycle_tokens for s in st) / max(1, cyc)))
        for name, rs in runs.items():
            r = sorted(rs, key=lambda x: x["aggregate_tps"])[len(rs) // 2]
            r["exact"] = all(x["exact"] for x in rs)
            r["aggregate_tps_runs"] = [round(x["aggregate_tps"], 2) for x in rs]
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    Path(a.out).write_text(json.dumps({"device": str(mx.default_device()), "dtype": a.dtype, "max_tokens": a.max_tokens,
                                       "prompts": a.prompts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
