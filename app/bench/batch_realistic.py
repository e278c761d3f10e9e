"""`mlx-dflash bench --realistic --batch`: several streams in the realistic regime
(issue 24, item 6). N streams arrive at once on a target of a published shape
(random weights) with a drafter of the published DFlash 2 shape whose forward
runs for real and whose accuracy is replayed (app/bench/realistic.py: each row
proposes its own target's greedy continuation for an accept length drawn with
the published tau, then wrong tokens). Aggregate tokens/s, per-stream time to first token
and inter-token latency for

- dflash-batched: mlx_dflash.engine.batch.BatchEngine with the batch guard (width per
  cycle from c(w, B) and live acceptance; plain batched where drafting does not
  pay), its batched drafter forward paid, each row's drafts replayed,
- dflash-batched-wW (--batch-widths): the same engine drafting at width W every cycle,
- plain-batched: mlx-lm's BatchGenerator,
- dflash-serial: our single-stream engine (the guard, no lookup), one request
  after another, with the single-stream replay (bench --realistic's).

Greedy; every stream's ids are checked equal to plain-batched's and to the
target's own continuation (plain mlx-lm, one stream). c(w, B) and d(w, B) are
measured once per batch size (batch_costs.measure, in plain batched steps at B
rows) and handed to the engine's guard; the cost model's limit of a batched
run is sum over cycles of (tokens / B) t1(B) over sum of k(w, B) t1(B)
(= tau / (c + d) at a constant B and width), efficiency = decode speedup over
plain-batched at the same B / limit.

    MLX_DFLASH_HOME=$(mktemp -d) mlx-dflash bench --realistic --batch --targets qwen3-0.6b --tau 6.5 \
        --streams 1,2,4 --max-tokens 48 --reps 2 --batch-widths 8 --out bench/batch_realistic

(results and the machine's load: bench/batch_realistic.md)
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import mlx.core as mx

from app.bench.batch import command_line, median_run, run_plain_batched, summarize, write
from app.bench.batch import markdown as batch_table
from app.bench.options import ints
from app.bench.realistic import TARGETS, Replay, ReplayDrafter, alpha_for, build_drafter, build_target, word_tokenizer
from app.bench.report import machine_info
from app.bench.runs import run_mlx_lm as run_single
from app.bench.runs import price_as, run_ours
from app.errors import UserError
from mlx_dflash import DecodeConfig
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.engine.batch_costs import MEASURED_B, BatchCosts, measure
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash.policy.base import DFLASH
from mlx_dflash.policy.fixed import FixedWidth
from mlx_dflash.policy.costs import Costs, interpolate

MAX_TOKENS = 32  # per stream, when --max-tokens is not given


class ReplayBatchEngine(BatchEngine):
    """The batch engine with replayed acceptance: each cycle's batched drafter
    forward runs (its output stays in the graph, so its cost is paid), then each
    row's drafts are its own Replay's (its continuation, its RNG, its position
    from the tokens it has emitted)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.replays = {}  # uid -> Replay

    def submit_replay(self, prompt: list, replay: Replay, config: DecodeConfig) -> int:
        uid = self.submit(prompt, config)
        self.replays[uid] = replay
        return uid

    def propose(self, rows, widths, sources):
        n, toks, qs, confs = super().propose(rows, widths, sources)
        W = toks.shape[1] + 1
        out = [mx.array(self.replays[r.uid].drafts(r.anchor, len(r.emit.tokens), W), mx.int32)
               if src == DFLASH else toks[b] for b, (r, src) in enumerate(zip(rows, sources))]
        return n, mx.stack(out) + 0 * toks, [None] * len(rows), confs


def cycle_log(events, log):
    """Per cycle of one engine step: (rows, width, tokens emitted)."""
    cyc = {}
    for _, r in events:
        if r.cycle is not None:
            cyc.setdefault(id(r.cycle), [r.cycle, 0])[1] += 1
    if cyc:
        log.append((len(cyc), max(c.width for c, _ in cyc.values()), sum(n for _, n in cyc.values())))


def decode_rate(times):
    """Tokens after the last stream's first token, per second after it (prefill out:
    the cost model's speedup is decoding's)."""
    t_first = max(t[0] for t in times)
    n = sum(1 for t in times for x in t if x > t_first)
    t_end = max(t[-1] for t in times)
    return n / (t_end - t_first) if t_end > t_first else 0.0


class Curves:
    """c(w, B), d(w, B) measured at the batch sizes the engine's guard uses (in
    plain batched steps at B rows), kept in the guard's cost book, and the cost
    model's prices of a cycle."""

    def __init__(self, model, drafter, sizes, log):
        self.cal = Calibration()
        self.bc = BatchCosts(model, drafter, self.cal.book, drafter.block_size)
        self.at = {}
        for B in sizes:
            log(f"measuring c(w, {B}), d(w, {B}) at widths {self.bc.widths}...")
            got = measure(model, drafter, B, self.bc.widths)
            self.cal.book.keep(model, drafter, got, save=False, batch=B)
            self.at[B] = got

    def k(self, B, w):
        """A cycle's cost in plain batched steps at B rows (linear in B between measured sizes)."""
        return interpolate(self.bc.curve(B), w)

    def t1(self, B):
        lo = max(b for b in self.at if b <= B)
        hi = min(b for b in self.at if b >= B)
        a, b = self.at[lo].t1, self.at[hi].t1
        return a if hi == lo else a + (b - a) * (B - lo) / (hi - lo)

    def limit(self, log):
        """The cost model's speedup over plain batched decoding for a run's cycles."""
        plain = sum(n / B * self.t1(B) for B, w, n in log)
        ours = sum(self.k(B, w) * self.t1(B) for B, w, n in log)
        return plain / ours if ours else None

    def single(self):
        """The B = 1 curve at every width (what the serial runs are priced at)."""
        c1 = self.at[1]
        full = range(1, max(c1.c) + 1)
        return Costs(c1.t1, {w: interpolate(c1.c, w) for w in full}, {w: interpolate(c1.d, w) for w in full},
                     c1.context, c1.measured_at)

    def to_json(self):
        return {str(B): {"t1_ms": 1e3 * c.t1, "c": c.c, "d": c.d} for B, c in self.at.items()}


def run(args, log) -> int:
    names = [x.strip() for x in (args.targets or "qwen3-0.6b").split(",") if x.strip()]
    if len(names) != 1 or names[0] not in TARGETS:
        raise UserError(f"--realistic --batch runs one target at a time: --targets one of {', '.join(TARGETS)}")
    a = args
    a.target, a.streams = names[0], ints(a.streams, "--streams")
    a.fixed_widths = ints(a.batch_widths, "--batch-widths") if a.batch_widths else []
    if a.reps < 1 or a.max_tokens < 1 or a.prompt_len < 1:
        raise UserError("--reps, --max-tokens and --prompt-len must be >= 1")
    t_start = time.time()

    load0 = os.getloadavg()
    log(f"building {a.target} ({TARGETS[a.target][2]}, {a.dtype}) and its drafter...")
    model = build_target(a.target, a.dtype)
    inner = build_drafter(model, a.draft_layers, a.dtype)
    vocab, block = inner.config.vocab_size, inner.block_size
    tok = word_tokenizer(vocab)
    alpha = alpha_for(a.tau, block)
    rng = random.Random(1234)
    N = max(a.streams)
    ps = [[rng.randrange(4, vocab - 1) for _ in range(a.prompt_len)] for _ in range(N)]
    log(f"the target's greedy continuations (plain mlx-lm, one stream, {a.max_tokens} tokens)...")
    conts = [run_single(model, tok, p, a.max_tokens).tokens for p in ps]
    sizes = sorted({b for b in MEASURED_B if b <= N} | {1} | {min([b for b in MEASURED_B if b >= N] or [N])})
    curves = Curves(model, inner, sizes, log)
    single = curves.single()
    serial_drafter = ReplayDrafter(inner, alpha, vocab)
    price_as(model, serial_drafter, inner)
    lengths = serial_drafter.lengths  # every accept length drawn, serial and batched

    def serial(ps_, rep):
        times, ids, units, cycles, toks = [], [], 0.0, 0, 0
        t0 = time.perf_counter()
        gen_t, gen_n = 0.0, 0
        for i, p in enumerate(ps_):
            serial_drafter.begin(p, conts[i], seed=1000 * rep + i)
            t = []

            def on_token(n, t=t):
                serial_drafter.emitted = n
                t.append(time.perf_counter())

            r = run_ours(model, tok, p, serial_drafter, a.max_tokens, None, "dflash", single, True,
                         on_token=on_token, lookup=False)
            times.append(t)
            ids.append(r.tokens)
            units += r.cost_units
            cycles += r.cycles
            toks += r.cycle_tokens
            gen_t += r.gen_time
            gen_n += r.gen_tokens
        wall = time.perf_counter() - t0
        extra = {"decode_tps": gen_n / gen_t if gen_t else 0.0, "tau": toks / cycles if cycles else 1.0,
                 "limit_vs_plain_1": toks / units if units else None}
        return times, ids, t0, wall, extra

    def batched(ps_, rep, policy=None):
        eng = ReplayBatchEngine(model, tok, inner, max_batch=len(ps_), policy=policy, calibration=curves.cal)
        t0 = time.perf_counter()
        uids = [eng.submit_replay(p, Replay(p, conts[i], alpha, block, vocab, 1000 * rep + i, lengths),
                                  DecodeConfig(max_tokens=a.max_tokens, lookup=False)) for i, p in enumerate(ps_)]
        times = {u: [] for u in uids}
        ids = {u: [] for u in uids}

        policy = []

        def got(u, r):
            times[u].append(time.perf_counter())
            ids[u].append(r.token)
            policy[:] = [r.stats.policy]

        clog = []
        while len(eng):
            cycle_log(eng.step(got), clog)
        wall = time.perf_counter() - t0
        rc = sum(B for B, _, _ in clog)
        widths = sorted({w for _, w, _ in clog})
        extra = {"tau": sum(n for _, _, n in clog) / rc if rc else 1.0, "cycles": len(clog),
                 "draft_cycles": sum(w > 1 for _, w, _ in clog), "widths": widths,
                 "limit": curves.limit(clog), "policy": policy[0] if policy else ""}
        return [times[u] for u in uids], [ids[u] for u in uids], t0, wall, extra

    systems = ["dflash-serial"] * (not a.no_serial) + ["dflash-batched"] + [f"dflash-batched-w{w}" for w in a.fixed_widths] + ["plain-batched"]
    log("warm-up (every system at every concurrency, 4 tokens)...")
    for n in a.streams:
        mt, a.max_tokens = a.max_tokens, 4
        batched(ps[:n], 99)
        for w in a.fixed_widths:
            batched(ps[:n], 99, FixedWidth(w))
        run_plain_batched(model, tok, ps[:n], 4)
        a.max_tokens = mt
    if not a.no_serial:
        mt, a.max_tokens = a.max_tokens, 4
        serial(ps[:1], 99)
        a.max_tokens = mt
    del lengths[:]
    rows = []
    for n in a.streams:
        sub = ps[:n]
        runs = {s: [] for s in systems}
        for rep in range(a.reps):  # interleaved: the machine's load drifts
            for s in systems[rep % len(systems):] + systems[: rep % len(systems)]:
                log(f"{n} streams, rep {rep + 1}/{a.reps}: {s}...")
                if s == "plain-batched":
                    times, ids, t0, wall = run_plain_batched(model, tok, sub, a.max_tokens)
                    extra = {}
                elif s == "dflash-serial":
                    times, ids, t0, wall, extra = serial(sub, rep)
                else:
                    w = int(s.rsplit("w", 1)[1]) if s != "dflash-batched" else None
                    times, ids, t0, wall, extra = batched(sub, rep, FixedWidth(w) if w else None)
                row = dict(summarize(s, n, times, t0, wall), **extra)
                row.setdefault("decode_tps", decode_rate(times))  # (serial: its runs' own, first token to last)
                row["exact"] = ids == [c[: a.max_tokens] for c in conts[:n]]
                runs[s].append(row)
        plain = median_run(runs["plain-batched"])
        for s, rs in runs.items():
            r = median_run(rs)
            r["exact"] = all(x["exact"] for x in rs)
            r["decode_tps_runs"] = [round(x["decode_tps"], 2) for x in rs]
            if s.startswith("dflash-batched"):
                r["speedup"] = r["decode_tps"] / plain["decode_tps"] if plain["decode_tps"] else None
                r["efficiency"] = r["speedup"] / r["limit"] if r["speedup"] and r["limit"] else None
            rows.append(r)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    # serial at 1 stream against plain at 1 stream: the single-stream efficiency
    p1 = next((r for r in rows if r["system"] == "plain-batched" and r["streams"] == 1), None)
    for r in rows:
        if r["system"] == "dflash-serial" and r["streams"] == 1 and p1 and p1["decode_tps"]:
            r["speedup"] = r["decode_tps"] / p1["decode_tps"]
            r["efficiency"] = r["speedup"] / r["limit_vs_plain_1"] if r["limit_vs_plain_1"] else None
    res = {"meta": {"command": command_line(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                    "seconds": round(time.time() - t_start, 1), "model": f"{a.target} ({TARGETS[a.target][2]})",
                    "prompts": f"{a.prompt_len}-token random", "max_tokens": a.max_tokens, "dtype": a.dtype,
                    "reps": a.reps, "machine": machine_info(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                    "tau": a.tau, "alpha": alpha,
                    "replayed_mean_accept_len": sum(lengths) / len(lengths) if lengths else None},
           "target": a.target, "curves": curves.to_json(), "rows": rows}
    write(res, markdown(res), Path(a.out or f"bench-batch-realistic-{time.strftime('%Y%m%d-%H%M%S')}"), a.json, log)
    return 0


def markdown(res: dict) -> str:
    """batch.markdown's table, with the cost model's columns."""
    lines = batch_table(res).splitlines()
    lines[4] += (f" Replayed tau {res['meta']['tau']} (alpha {res['meta']['alpha']:.3f}); decode speedup over "
                 "plain-batched at the same B / the cost model's limit = efficiency.")
    extra = ["", "| streams | system | decode tok/s | tau | widths | speedup | limit | efficiency |",
             "|---|---|---|---|---|---|---|---|"]
    def f(x):
        return "" if x is None else f"{x:.2f}"

    for r in res["rows"]:
        extra.append(f"| {r['streams']} | {r['system']} | {f(r.get('decode_tps'))} | {f(r.get('tau'))} | "
                     f"{','.join(map(str, r.get('widths') or []))} | {f(r.get('speedup'))} | "
                     f"{f(r.get('limit') or r.get('limit_vs_plain_1'))} | {f(r.get('efficiency'))} |")
    return "\n".join(lines + extra) + "\n"
