"""`mlx-dflash bench --batch`: several streams at once (issue 24). N requests
arrive together; aggregate tokens/s, each stream's time to first token and
inter-token latency, for

- dflash-batched: the batch engine (mlx_dflash.engine.batch.BatchEngine), its
  batch guard picking each cycle's width from c(w, B) and live acceptance
  (plain batched where drafting does not pay),
- dflash-batched-wW (--batch-widths, default 5): the same engine drafting at width W every cycle,
- plain-batched: mlx-lm's BatchGenerator (continuous batching, no drafts),
- dflash-serial: our single-stream engine (stream_generate, the guard), one
  request after another (stream k waits for streams 1..k-1).

Greedy; every stream's token ids are checked against dflash-serial's (exact).
The median of --reps runs is kept (systems interleaved: the machine's load drifts).
`--lookup-ab`: per-row prompt lookup in the batch on (dflash-batched) vs off
(dflash-batched-nolookup), at the repeat prompt sets where lookup hits
(`--prompts repeat-function` or `copy-list`). `--realistic` runs the same
comparison in the realistic regime (batch_realistic.py)."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from app.bench.options import ints
from app.bench.prompts import load_prompts
from app.bench.report import machine_info
from app.errors import UserError
from mlx_dflash import DecodeConfig, load, stream_generate
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.models.discovery import default_pair
from mlx_dflash.policy.fixed import FixedWidth

MAX_TOKENS = 64  # per stream, when --max-tokens is not given


def add_arguments(p) -> None:
    g = p.add_argument_group("several streams at once (--batch)")
    g.add_argument("--batch", action="store_true", help="N requests at once: the batch engine against mlx-lm's "
                   "BatchGenerator and our single-stream engine one request after another (batch.py)")
    g.add_argument("--streams", default="1,2,4,8", help="comma list of stream counts")
    g.add_argument("--reps", type=int, default=3, help="runs per system and stream count; the median run is kept")
    g.add_argument("--batch-widths", default=None, help="comma list: the batch engine also at these fixed widths "
                   "(default 5; --realistic: none)")
    g.add_argument("--lookup-ab", action="store_true", help="per-row prompt lookup in the batch, on vs off")
    g.add_argument("--no-serial", action="store_true", help="leave dflash-serial out")
    g.add_argument("--prompt-len", type=int, default=64, help="--realistic --batch: prompt length in tokens")


def summarize(name, n, times, t0, wall) -> dict:
    """One run of `n` streams; `times`: per stream, the wall times of its tokens."""
    toks = sum(len(t) for t in times)
    ttft = sorted(t[0] - t0 for t in times if t)
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    return {"system": name, "streams": n, "tokens": toks, "wall_s": wall, "aggregate_tps": toks / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "itl_mean_ms": 1000 * statistics.mean(itl) if itl else 0.0,
            "itl_p95_ms": 1000 * sorted(itl)[int(0.95 * (len(itl) - 1))] if itl else 0.0}


def median_run(rs: list) -> dict:
    """The run of median aggregate tok/s, with every run's figure beside it."""
    r = dict(sorted(rs, key=lambda x: x["aggregate_tps"])[len(rs) // 2])
    r["aggregate_tps_runs"] = [round(x["aggregate_tps"], 2) for x in rs]
    return r


def run_plain_batched(model, tok, ps, max_tokens):
    """mlx-lm's BatchGenerator over the prompts at once: (times, ids, t0, wall)."""
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


def run_engine(model, tok, drafter, ps, max_tokens, policy=None, lookup=True, stats=None):
    """The batch engine over the prompts at once: (times, ids, t0, wall, the policy's
    reason). `stats`: a list that gets each stream's last GenerationStats, then the engine's summary."""
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
    return [times[u] for u in uids], [ids[u] for u in uids], t0, wall, last[uids[-1]].policy


def run_serial(model, tok, drafter, ps, max_tokens):
    """Our single-stream engine, one request after another: (times, ids, t0, wall)."""
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


def compare(model, tok, drafter, ps, a, widths, log) -> list:
    """dflash-serial, dflash-batched (+ fixed widths) and plain-batched at each stream count."""
    log("warm-up: shapes, the batch guard's c(w, B) curves (measured once, cached), the serial guard's costs...")
    for n in a.streams:
        run_engine(model, tok, drafter, ps[:n], 4)
    if not a.no_serial:
        run_serial(model, tok, drafter, ps[:1], 4)
    run_plain_batched(model, tok, ps[:2], 4)
    rows = []
    for n in a.streams:
        sub, runs = ps[:n], {}  # system -> its reps' rows
        for rep in range(a.reps):
            log(f"{n} streams, rep {rep + 1}/{a.reps}")
            ref = None
            if not a.no_serial:
                times, ref, t0, wall = run_serial(model, tok, drafter, sub, a.max_tokens)
                runs.setdefault("dflash-serial", []).append(summarize("dflash-serial", n, times, t0, wall))
            systems = [("dflash-batched", None)] + [(f"dflash-batched-w{w}", FixedWidth(w)) for w in widths]
            for name, policy in systems:
                times, ids, t0, wall, why = run_engine(model, tok, drafter, sub, a.max_tokens, policy)
                ref = ids if ref is None else ref
                runs.setdefault(name, []).append(dict(summarize(name, n, times, t0, wall), exact=ids == ref,
                                                      **({"policy": why} if policy is None else {})))
            times, ids, t0, wall = run_plain_batched(model, tok, sub, a.max_tokens)
            runs.setdefault("plain-batched", []).append(
                dict(summarize("plain-batched (mlx-lm)", n, times, t0, wall), exact=ids == ref))
        for name, rs in runs.items():
            r = median_run(rs)
            r["exact"] = all(x.get("exact", True) for x in rs) if name != "dflash-serial" else None
            rows.append(r)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return rows


def lookup_ab(model, tok, drafter, ps, a, log) -> list:
    """dflash-batched with per-row lookup vs without, at each stream count."""
    for n in a.streams:  # warm-up: shapes, the batch guard's curves
        run_engine(model, tok, drafter, ps[:n], 4)
    rows = []
    for n in a.streams:
        sub, runs = ps[:n], {}
        _, ref, _, _ = run_serial(model, tok, drafter, sub, a.max_tokens)
        for rep in range(a.reps):  # interleaved: the machine's load drifts
            log(f"{n} streams, rep {rep + 1}/{a.reps}")
            for name, look in (("dflash-batched", True), ("dflash-batched-nolookup", False)):
                st = []
                times, ids, t0, wall, why = run_engine(model, tok, drafter, sub, a.max_tokens, lookup=look, stats=st)
                eng = st.pop()
                cyc = sum(s.cycles for s in st)
                runs.setdefault(name, []).append(dict(
                    summarize(name, n, times, t0, wall), exact=ids == ref, policy=why,
                    batch_cycles=eng["cycles"], drafter_forwards=eng["drafter_forwards"],
                    row_cycles=cyc, lookup_cycles=sum(s.lookup_cycles for s in st),
                    plain_cycles=sum(s.plain_cycles for s in st), tau=sum(s.cycle_tokens for s in st) / max(1, cyc)))
        for name, rs in runs.items():
            r = median_run(rs)
            r["exact"] = all(x["exact"] for x in rs)
            rows.append(r)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return rows


def markdown(res: dict) -> str:
    m = res["meta"]
    out = [f"# Several streams at once: {m['model']}", "",
           f"`{m['command']}`" if m["command"] else "", "",
           f"{m['prompts']} prompts, {m['max_tokens']} tokens per stream, greedy, {m['dtype']}; the median of "
           f"{m['reps']} runs (every run's aggregate in brackets). {m['date_utc']} UTC, load "
           f"{m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}.", "",
           "| streams | system | aggregate tok/s | TTFT p50 / p95 s | ITL mean ms | exact | policy |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        runs = ", ".join(f"{x:.1f}" for x in r["aggregate_tps_runs"])
        exact = {True: "yes", False: "NO", None: "(reference)"}[r.get("exact")]
        out.append(f"| {r['streams']} | {r['system']} | {r['aggregate_tps']:.1f} ({runs}) | "
                   f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['itl_mean_ms']:.0f} | {exact} | "
                   f"{r.get('policy') or ''} |")
    return "\n".join(out) + "\n"


def command_line() -> str | None:
    return ("mlx-dflash bench " + " ".join(shlex.quote(x) for x in sys.argv[2:])
            if len(sys.argv) > 1 and sys.argv[1] == "bench" else None)


def write(res: dict, md: str, out: Path, as_json: bool, log) -> None:
    """results.json and results.md in `out`; the table (or the JSON) on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(md)
    sys.stdout.write(json.dumps(res) + "\n" if as_json else md)
    log(f"wrote {out / 'results.json'}, results.md")


def run(args, log) -> int:
    args.streams = ints(args.streams, "--streams")
    widths = ints(args.batch_widths, "--batch-widths") if args.batch_widths else [5]
    if args.reps < 1 or args.max_tokens < 1:
        raise UserError("--reps and --max-tokens must be >= 1")
    if args.lookup_ab and args.no_serial:
        raise UserError("--lookup-ab checks every stream against dflash-serial; leave out --no-serial")
    t_start, load0 = time.time(), os.getloadavg()
    target = args.model or str(default_pair()[0])
    drafter_ref = args.drafter or (str(default_pair()[1]) if args.model is None else None)
    model, tok, drafter = load(target, drafter_ref, dtype=args.dtype)
    if drafter is None:
        raise UserError(f"no DFlash drafter for {target}; pass --drafter")
    prompts = args.prompts or "gsm8k-dev"
    ps = [p["prompt"] if isinstance(p["prompt"], list) else tok.encode(p["prompt"])
          for p in load_prompts(prompts, tok, max(args.streams))]
    if len(ps) < max(args.streams):
        raise UserError(f"{prompts} holds {len(ps)} prompts; --streams asks for {max(args.streams)}")
    if args.lookup_ab:
        rows = lookup_ab(model, tok, drafter, ps, args, log)
    else:
        rows = compare(model, tok, drafter, ps, args, widths, log)
    res = {"meta": {"command": command_line(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                    "seconds": round(time.time() - t_start, 1), "model": target, "drafter": drafter_ref,
                    "prompts": prompts, "max_tokens": args.max_tokens, "dtype": args.dtype, "reps": args.reps,
                    "device": str(mx.default_device()), "machine": machine_info(), "loadavg_start": load0,
                    "loadavg_end": os.getloadavg(), "lookup_ab": args.lookup_ab},
           "rows": rows}
    write(res, markdown(res), Path(args.out or f"bench-batch-{time.strftime('%Y%m%d-%H%M%S')}"), args.json, log)
    return 0
