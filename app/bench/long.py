"""`mlx-dflash bench --realistic --contexts 1024,8192,32768,65536`: the realistic
regime (bench_realistic.py: published-layout targets with random weights, a real
DFlash 2 drafter forward, replayed acceptance) at long context (issue 23).

Per target and context length n: one random prompt of n tokens is prefilled by
mlx-lm (its time to first token: the reference) and by the product
(stream_generate with the drafter's feature capture, stopped by its progress
callback one token before the end, which leaves a consistent prompt cache).
Every decode run then starts from a copy of that cache: mlx-lm's plain
generate_step (the baseline, and the continuation the drafter replays) and the
product at fixed widths and in the default guarded mode, interleaved,
`--num-prompts` rounds with other replay seeds. c(w) and d(w) are measured at
that length on the same cache (bench_realistic.CostSampler), the guard is given
them (so it prices cycles at this length without a calibration prefill of its
own), and the replayed tau can decay with context (--tau-decay per doubling past
1k). Rows per length: tau, c, d, speedup, the limit tau / (c + d), efficiency,
prefill time against mlx-lm's, peak memory; the issue's goals are checked."""

from __future__ import annotations

import copy
import gc
import json
import math
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from app.bench.realistic import (
    TARGETS,
    CostSampler,
    ReplayDrafter,
    alpha_for,
    build_drafter,
    build_target,
    word_tokenizer,
)
from app.bench.report import fmt_num, machine_info, machine_line, summarize
from app.bench.runs import Method, run_mlx_lm, run_ours
from app.errors import UserError
from mlx_dflash import DecodeConfig, PromptCache, stream_generate
from mlx_dflash.engine.calibrate import DEFAULT, extend_with_random_rows
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.registry import guard_widths, priced_at

DEFAULT_TARGETS = "qwen3-small,hybrid-small"
CONTEXTS = (1024, 8192, 32768, 65536)
WIDTHS = (5, 8, 16)


class _Prefilled(Exception):
    """Stops the product's prefill one token before the end (its progress callback)."""


def tau_at(tau: float, decay: float, n: int) -> float:
    """The replayed tau at n tokens of context: (tau - 1) shrinks by `decay` per doubling past 1k."""
    return 1 + (tau - 1) * decay ** max(0.0, math.log2(n / 1024))


def prefill(model, tok, prompt, drafter):
    """The product's prefill of all but the last prompt token (what a decode run
    then continues from). Returns (PromptCache, seconds, peak GB)."""
    pc = PromptCache()

    def stop(done, total):
        if done == total - 1:
            raise _Prefilled

    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    try:
        for _ in stream_generate(model, tok, prompt, drafter, prompt_cache=pc, max_tokens=1, block_size=5,
                                 guard=False, lookup=False, prefill_progress=stop):
            raise RuntimeError("the prefill was not stopped before the last token")
    except _Prefilled:
        pass
    mx.synchronize()
    return pc, time.perf_counter() - t0, mx.get_peak_memory() / 1e9


def synthetic(model, tok, prompt, drafter, head: int = 64):
    """A prompt cache as a prefill of `prompt[:-1]` would leave it, without the
    prefill: `head` tokens prefilled for real, then every attention layer's K/V and
    the drafter's pending features extended with random rows to the full length
    (a decode step's cost depends on the shapes, not the values; recurrent layers
    keep their fixed-size state). For lengths whose prefill this machine cannot
    afford twice (--synthetic-from)."""
    pc, _, _ = prefill(model, tok, prompt[:head + 1], drafter)
    rest = len(prompt) - 1 - head
    extend_with_random_rows(pc.target, rest)
    f = pc.pending
    pc.pending = mx.concatenate([f, mx.random.normal((1, rest, f.shape[2])).astype(f.dtype)], axis=1)
    pc.tokens = list(prompt[:-1])
    mx.eval(pc.pending)
    return pc


def seed_guard(model, drafter, costs: Costs, n: int, plain) -> None:
    """The guard prices cycles at context `n` with `costs` (sampled on this cache) and the plain run's
    token time, rather than by its own calibration (which would prefill priced_at(n) tokens first)."""
    c = Costs(costs.t1, costs.c, costs.d, n, time.time(), plain.gen_time / max(1, plain.gen_tokens), costs.u)
    DEFAULT.book.keep(model, drafter, c, save=False)
    if priced_at(n) is not None:
        DEFAULT.book.keep(model, drafter, c, save=False, context=priced_at(n))


def bench_length(name, model, inner, tok, n: int, args, log) -> dict:
    vocab = inner.config.vocab_size
    widths = sorted({int(x) for x in args.realistic_widths.split(",") if x.strip()})
    rng = random.Random(n)
    prompt = [rng.randrange(4, vocab - 1) for _ in range(n)]
    tau = tau_at(args.tau, args.tau_decay, n)
    replay = ReplayDrafter(inner, alpha_for(tau, inner.block_size), vocab)
    ref = t_ours = peak_prefill = None
    if args.synthetic_from and n >= args.synthetic_from:
        log(f"{name} @ {n}: a synthetic context (random K/V rows and features; no prefill timed)...")
        pc = synthetic(model, tok, prompt, replay)
    else:
        log(f"{name} @ {n}: the prefills, mlx-lm's (time to first token) and the product's (features captured)...")
        # a short one of each first (first calls allocate), then the two in turn, mlx-lm first at
        # every other length: a shared machine's load drifts over minutes
        run_mlx_lm(model, tok, prompt[:64], 1)
        prefill(model, tok, prompt[:65], replay)
        if (n // 1024) % 2:
            ref = run_mlx_lm(model, tok, prompt, 1)
        pc, t_ours, peak_prefill = prefill(model, tok, prompt, replay)
        if ref is None:
            ref = run_mlx_lm(model, tok, prompt, 1)
        log(f"{name} @ {n}: prefill mlx-lm {ref.ttft:.1f} s, ours {t_ours:.1f} s; plain continuation and costs...")
    layout = DecodeConfig().drafter_layout
    base = run_mlx_lm(model, tok, prompt[-1:], args.max_tokens, prompt_cache=copy.deepcopy(pc.target))
    cont = base.tokens
    # the guard's own widths too: it is priced at this length as its own calibration would price it
    sampled = sorted(set(widths) | {w for w in guard_widths(inner.block_size) if w > 1})
    sampler = CostSampler(model, inner, sampled, n, cache=copy.deepcopy(pc.target), feats=pc.pending, layout=layout)
    sampler.sample(2)
    costs = sampler.costs()

    methods = [Method("mlx-lm", "mlx-lm"), Method("default (guard)", "default", 5)]
    methods += [Method(f"dflash2-w{w}", "dflash2", w) for w in widths]

    def go(m, i):
        # each run decodes from a fresh copy of the context: the last run's copy and the
        # allocator's cache of its buffers go first (a 0.6B target's K/V at 8k is 2 GB)
        gc.collect()
        mx.clear_cache()
        if m.kind == "mlx-lm":
            return run_mlx_lm(model, tok, prompt[-1:], args.max_tokens, prompt_cache=copy.deepcopy(pc.target))
        # every method sees the same accept-length draws (common random numbers: a fair comparison)
        replay.begin(prompt, cont, seed=1000 * i)
        seed_guard(model, replay, costs, n, base)
        return run_ours(model, tok, prompt, replay, args.max_tokens, None if m.kind == "default" else m.width,
                        "dflash", costs, m.kind == "default", on_token=lambda k: setattr(replay, "emitted", k),
                        lookup=False, prompt_cache=copy.deepcopy(pc))

    for m in methods:  # warm-up at every shape
        go(m, 0)
        m.runs.clear()
    for i in range(args.num_prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            m.runs.append(go(m, i))
        sampler.sample(1)
    costs = sampler.costs()
    for m in methods[1:]:
        for r in m.runs:
            r.cost_units = sum(costs.c[w] + (costs.d[w] if src == "dflash" else 0.0) for w, src in r.cycle_log)
    rows = []
    for m in methods:
        rows.append(summarize(m, rows[0] if rows else None, {"dflash2": costs, "plain_t1": costs.t1},
                              [r.tokens for r in methods[0].runs]))
        if m.kind == "default":  # the widths the guard chose, cycles at each (1: plain steps)
            rows[-1]["widths"] = dict(sorted(Counter(w for r in m.runs for w, _ in r.cycle_log).items()))
    first = next(r for r in methods[1].runs)
    return {"context": n, "tau_replayed": tau, "alpha": replay.alpha,
            "synthetic_context": ref is None,
            "prefill_s": {"mlx-lm": ref.ttft, "ours": t_ours + first.prompt_time} if ref is not None else None,
            "peak_memory_gb": {"mlx-lm prefill": ref.peak_memory if ref is not None else None,
                               "ours prefill": peak_prefill,
                               "ours decode": max(r["peak_memory_gb"] for r in rows[1:])},
            "drafter_context_rows": sum(layout) if layout[0] else n, "costs": costs.to_json(), "methods": rows}


def goals(t: dict) -> list:
    """The issue's goals on one target's lengths: efficiency >= 90% at every length
    (fixed widths), d at 32k within 1.2x of d at 1k, speedup at 32k >= 80% of 1k's."""
    out, by = [], {L["context"]: L for L in t["lengths"]}
    for L in t["lengths"]:
        for r in L["methods"]:
            if r["kind"] == "dflash2" and r["efficiency"] is not None:
                out.append({"goal": f"efficiency >= 90% at {L['context']}, {r['method']}",
                            "value": f"{r['efficiency']:.0%}", "met": r["efficiency"] >= 0.9})
    lo, hi = by.get(1024), by.get(32768)
    if lo and hi:
        for w in ("5", "16"):  # in seconds (d is in units of the 1-token step, which grows with context)
            a, b = (L["costs"]["d"][w] * L["costs"]["t1"] * 1e3 for L in (lo, hi))
            out.append({"goal": f"d({w}) at 32k <= 1.2x d({w}) at 1k", "value": f"{b:.0f} ms / {a:.0f} ms = {b / a:.2f}x",
                        "met": b <= 1.2 * a})
        if hi["tau_replayed"] == lo["tau_replayed"]:
            for a, b in zip(lo["methods"], hi["methods"]):
                if a["kind"] == "dflash2" and a["ratio"]:
                    keep = b["ratio"] / a["ratio"]
                    out.append({"goal": f"speedup at 32k >= 80% of 1k's, {a['method']}",
                                "value": f"{b['ratio']:.2f}x / {a['ratio']:.2f}x = {keep:.0%}", "met": keep >= 0.8})
    return out


def markdown(res: dict) -> str:
    meta = res["meta"]
    lines = ["# mlx-dflash bench --realistic --contexts (long context)", "",
             f"{meta['num_prompts']} replay rounds x {meta['max_tokens']} tokens per length, greedy, batch 1; "
             + machine_line(meta), "",
             "```", meta["command"] or "", "```", ""]
    for t in res["targets"]:
        lines += [f"## {t['label']} ({t['target']}, {t['dtype']}): {t['params'] / 1e6:.0f}M parameters", "",
                  f"Drafter: DFlash 2, {t['drafter_layers']} layers, {t['drafter_params'] / 1e6:.0f}M parameters, "
                  f"context window 1024 + sink 64 (the default). {t['seconds']:.0f} s.", "",
                  "| context | method | tau | x mlx-lm | c | d | limit | efficiency | lossless |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for L in t["lengths"]:
            for r in L["methods"]:
                ok = "-" if r.get("mismatches") is None else ("yes" if r["mismatches"] == 0 else
                                                             f"{r['mismatches']} differ")
                lines.append(f"| {L['context']} | {r['method']} | {fmt_num(r['tau'])} | {fmt_num(r['ratio'])}x "
                             f"| {fmt_num(r.get('c'))} | {fmt_num(r.get('d'))} | {fmt_num(r['limit'])} "
                             f"| {fmt_num(r['efficiency'], '{:.0%}')} | {ok} |")
        lines += ["", "The guard's widths (width: cycles; 1: plain steps): " + "; ".join(
            f"{L['context']}: " + ", ".join(f"{w}: {k}" for w, k in r["widths"].items())
            for L in t["lengths"] for r in L["methods"] if r.get("widths"))]
        lines += ["", "| context | replayed tau (w16) | 1-token step ms | prefill s, mlx-lm | prefill s, ours | ours / mlx-lm "
                  "| peak GB mlx-lm prefill | peak GB ours prefill | peak GB ours decode |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for L in t["lengths"]:
            p, m = L["prefill_s"], L["peak_memory_gb"]
            pre = (f"{p['mlx-lm']:.2f} | {p['ours']:.2f} | {p['ours'] / p['mlx-lm']:.3f}" if p else
                   "synthetic context | - | -")
            lines.append(f"| {L['context']} | {L['tau_replayed']:.2f} | {1e3 * L['costs']['t1']:.1f} | {pre} "
                         f"| {fmt_num(m['mlx-lm prefill'])} | {fmt_num(m['ours prefill'])} | {m['ours decode']:.2f} |")
        lines += ["", "Goals:", ""] + [f"- {g['goal']}: {g['value']} ({'met' if g['met'] else 'NOT met'})"
                                       for g in t["goals"]] + [""]
    for n, msg in (res.get("failed") or {}).items():
        lines += [f"## {n}: failed", "", msg, ""]
    return "\n".join(lines) + "\n"


def save(res: dict, out: Path, t_start: float) -> None:
    res["meta"]["seconds"] = round(time.time() - t_start, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))


def add_arguments(g) -> None:
    """Options of the long-context run, in bench_realistic's argument group."""
    g.add_argument("--contexts", default=None, help="context lengths in tokens (e.g. "
                   f"{','.join(map(str, CONTEXTS))}): the long-context realistic bench (bench_long.py); "
                   f"default targets {DEFAULT_TARGETS}")
    g.add_argument("--synthetic-from", type=int, default=None, help="with --contexts: from this length on, the "
                   "context is synthetic (random K/V rows and drafter features, no prefill timed): decode costs at "
                   "lengths whose prefill a slow machine cannot afford")
    g.add_argument("--tau-decay", type=float, default=1.0, help="with --contexts: the replayed tau - 1 shrinks by "
                   "this factor per doubling of the context past 1k (1: the same tau at every length)")


def run(args, log) -> int:
    try:
        contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 16:
        raise UserError(f"--contexts: '{args.contexts}' is not a list of token counts >= 16; e.g. 1024,8192,32768")
    names = [x.strip() for x in (args.targets or DEFAULT_TARGETS).split(",") if x.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise UserError(f"unknown realistic target {bad[0]!r}; valid: {', '.join(TARGETS)}")
    if args.quick:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 1), min(args.max_tokens, 32)
    t_start = time.time()
    out = Path(args.out or f"bench-long-{time.strftime('%Y%m%d-%H%M%S')}")
    res = {"meta": {"command": "mlx-dflash bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                    if len(sys.argv) > 1 and sys.argv[1] == "bench" else None,
                    "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                    "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "tau": args.tau,
                    "tau_decay": args.tau_decay, "contexts": contexts, "machine": machine_info()},
           "targets": []}
    for name in names:
        t0 = time.time()
        try:
            log(f"{name}: building the target ({TARGETS[name][2]}, {args.dtype}) and its drafter...")
            model = build_target(name, args.dtype)
            inner = build_drafter(model, args.draft_layers, args.dtype)
            tok = word_tokenizer(inner.config.vocab_size)
            t = {"target": name, "label": TARGETS[name][2], "dtype": args.dtype,
                 "params": sum(v.size for _, v in tree_flatten(model.parameters())),
                 "drafter_params": sum(v.size for _, v in tree_flatten(inner.parameters())),
                 "drafter_layers": args.draft_layers, "lengths": [], "goals": [], "seconds": 0.0}
            res["targets"].append(t)
            for n in contexts:
                try:
                    t["lengths"].append(bench_length(name, model, inner, tok, n, args, log))
                except MemoryError as e:
                    log(f"{name} @ {n}: out of memory ({e}); longer lengths skipped")
                    break
                t["goals"], t["seconds"] = goals(t), time.time() - t0
                save(res, out, t_start)  # after every length: a long run killed midway keeps what it measured
                log(f"{name} @ {n}: done")
        except Exception as e:  # one target's failure is reported, the others still run
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"{name}: failed: {msg}")
            res.setdefault("failed", {})[name] = msg
    save(res, out, t_start)
    if args.json:
        print(json.dumps(res))
    else:
        sys.stdout.write(markdown(res))
    log(f"wrote {out / 'results.json'}, results.md")
    return 0
