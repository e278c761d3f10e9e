"""`mlx-dflash bench` results: per-method summary, goals, markdown, chart."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import List, Optional

KINDS = ("mlx-lm", "mlx-lm-spec", "dflash1", "dflash2", "adaptive", "default", "lookup", "lookup-dflash")
OURS = ("dflash1", "dflash2", "adaptive", "default", "lookup", "lookup-dflash")  # mlx_dflash.stream_generate
PER_CYCLE = ("adaptive", "default", "lookup", "lookup-dflash")  # their widths vary from cycle to cycle
COSTS_OF = {"dflash1": "dflash1", "dflash2": "dflash2", "adaptive": "dflash2", "default": "dflash2",
            "lookup-dflash": "dflash2", "lookup": "lookup"}


def _name(p) -> str:
    """A model's short name for titles: its folder (or repo) name."""
    return "-" if not p else Path(str(p).rstrip("/")).name


def title(res: dict) -> str:
    """Model, drafter and machine, for the chart."""
    meta = res["meta"]
    mods, mach = meta.get("models") or {}, meta.get("machine") or {}
    drafter = mods.get("dflash2") or mods.get("dflash1") or mods.get("drafter")
    return (f"model {_name(mods.get('model'))}, drafter {_name(drafter)}; "
            f"{mach.get('machine', '?')} {mach.get('cpus', '?')} cores, {mach.get('device', '')}, "
            f"MLX {mach.get('mlx', '?')}")


def summarize(m, base: Optional[dict], costs: dict, base_tokens: Optional[list]) -> dict:
    runs = m.runs
    n = sum(r.gen_tokens for r in runs)
    gt = sum(r.gen_time for r in runs)
    tps = n / gt if gt > 0 else 0.0
    pt = sum(r.prompt_time for r in runs)
    s = {"method": m.name, "kind": m.kind, "width": m.width, "prompts": len(runs),
         "generated_tokens": sum(len(r.tokens) for r in runs),
         "tok_s": tps, "prefill_tok_s": sum(r.prompt_tokens for r in runs) / pt if pt > 0 else 0.0,
         "ttft_ms": 1e3 * sum(r.ttft for r in runs) / len(runs),
         "peak_memory_gb": max(r.peak_memory for r in runs)}
    cycles = sum(r.cycles for r in runs)
    drafted = sum(r.drafted for r in runs)
    s["tau"] = sum(r.cycle_tokens for r in runs) / cycles if cycles else 1.0
    s["acceptance"] = sum(r.accepted for r in runs) / drafted if drafted else None
    s["ratio"] = tps / base["tok_s"] if base and base["tok_s"] else 1.0
    if m.kind in OURS:
        t = {k: sum(r.t[k] for r in runs) for k in ("draft", "verify", "book")}
        s["shares"] = {k: v / gt for k, v in t.items()} if gt else None
        if s["shares"]:
            s["shares"]["other"] = 1.0 - sum(s["shares"].values())
        s["plain_cycles"] = sum(r.plain_cycles for r in runs)
        s["cycles"] = cycles
        c = costs[COSTS_OF[m.kind]]
        if m.kind in PER_CYCLE:  # widths vary: the cost model's time is summed cycle by cycle
            units = sum(r.cost_units for r in runs)
            s["c"] = s["d"] = None
            s["limit"] = sum(r.cycle_tokens for r in runs) / units if units else None
        else:
            s["c"], s["d"] = c.c[m.width], c.d[m.width]
            s["limit"] = s["tau"] / (s["c"] + s["d"])
        unit = c.t1  # the cost model's unit: one 1-token target step with feature capture
        s["lookup_cycles"] = sum(r.lookup_cycles for r in runs)
        s["policy"] = [r.policy for r in runs]
        if m.kind in ("adaptive", "default"):
            s["adaptive"] = {"fallbacks": sum((r.adaptive or {}).get("fallbacks", 0) for r in runs),
                             "probes": sum((r.adaptive or {}).get("probes", 0) for r in runs),
                             "final_states": [(r.adaptive or {}).get("state") for r in runs]}
    elif m.kind == "mlx-lm-spec":
        s["shares"] = None
        k = m.width
        s["c"], s["d"] = costs["plain"].c[k + 1], k * costs.get("draft_ar", 0.0)
        s["limit"] = s["tau"] / (s["c"] + s["d"])
        unit = costs["plain_t1"]
    else:
        s["shares"], s["c"], s["d"], s["limit"] = None, 1.0, 0.0, 1.0
        unit = costs["plain_t1"]
    s["speedup_vs_step"] = tps * unit  # tokens per 1-token target step timed at start-up (diagnostic)
    # The unit is mlx-lm's own time per token, measured prompt by prompt beside this method,
    # so load drift cancels (a start-up step time does not: it read 35-260% under load).
    s["efficiency"] = s["ratio"] / s["limit"] if s["limit"] else None  # the baseline: 1 / 1
    if base_tokens is not None:  # lossless check: greedy output equals mlx-lm's, prompt by prompt
        s["mismatches"] = sum(r.tokens != b for r, b in zip(runs, base_tokens))
    return s


def goals(rows: List[dict]) -> dict:
    """The issue's goals, checked on this run (batch 1, greedy)."""
    by = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
    out = {}
    if by["default"]:  # the guard's promise: never slower than plain decoding
        worst = min(r["ratio"] for r in by["default"])
        out["default_vs_mlx_lm"] = {"value": worst, "goal": 0.97, "met": worst >= 0.97}
    ours2 = by["dflash2"] + by["adaptive"]
    if ours2:
        best = max(ours2, key=lambda r: r["tok_s"])
        out["best_dflash2"] = best["method"]
        out["dflash2_vs_mlx_lm"] = {"value": best["ratio"], "goal": 3.5, "met": best["ratio"] >= 3.5}
        if by["mlx-lm-spec"]:
            spec = max(by["mlx-lm-spec"], key=lambda r: r["tok_s"])
            v = best["tok_s"] / spec["tok_s"] if spec["tok_s"] else None
            out["dflash2_vs_mlx_lm_spec"] = {"value": v, "goal": 2.0, "met": v is not None and v >= 2.0,
                                             "against": spec["method"]}
        if best["efficiency"] is not None:
            out["efficiency"] = {"value": best["efficiency"], "goal": 0.85, "met": best["efficiency"] >= 0.85}
    if by["dflash2"] and by["adaptive"]:
        fixed = max(by["dflash2"], key=lambda r: r["tok_s"])
        v = by["adaptive"][0]["tok_s"] / fixed["tok_s"] if fixed["tok_s"] else None
        out["adaptive_vs_best_fixed"] = {"value": v, "against": fixed["method"],
                                         "better": v is not None and v > 1.0,
                                         "within_3pct": v is not None and v >= 0.97}
    return out


def machine_info() -> dict:
    import mlx.core as mx

    from mlx_dflash.platform import fastblas

    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "mlx": mx.__version__, "device": str(mx.default_device()), "blas": fastblas.STATE["blas"]}


# -- output ---------------------------------------------------------------------------------


def machine_line(meta: dict) -> str:
    """'2026-12-01 20:05:27 UTC; Linux-..., 2 cores, MLX 0.32.4 (Device(cpu, 0)), BLAS: ...' for a
    report's header."""
    m = meta["machine"]
    return f"{meta['date_utc']} UTC; {m['platform']}, {m['cpus']} cores, MLX {m['mlx']} ({m['device']}), BLAS: {m['blas']}."


def threads_text(st: dict) -> str:
    """'1-token step 93.4 ms at the measured kernel threads (1 thread 95.0 ms, 2 threads 131.0 ms)'."""
    if not st:
        return ""
    ms = st["ms"]
    return (f"plain 1-token step {ms[st['fastest']]:.1f} ms at the {st['fastest']} kernel thread"
            f"{'s' if st['fastest'] != '1 thread' else ''} used for every method ("
            + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items() if k != st["fastest"]) + ")")


def fmt_num(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    meta = res["meta"]
    lines = [f"# mlx-dflash bench: {meta['prompts']}", "",
             f"{meta['num_prompts']} prompts x {meta['max_tokens']} tokens, greedy, batch 1; "
             f"{meta['date_utc']} UTC; {meta['machine']['platform']}, MLX {meta['machine']['mlx']} "
             f"({meta['machine']['device']}), BLAS: {meta['machine']['blas']}."
             + (f" {threads_text(meta['step_threads'])}." if meta.get("step_threads") else ""), ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    lines += ["| method | tau | accept | tok/s | x mlx-lm | prefill tok/s | TTFT ms | peak GB "
              "| draft / verify / book / other % | c + d | limit | efficiency | lossless |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["methods"]:
        sh = r.get("shares")
        shares = " / ".join(f"{100 * sh[k]:.0f}" for k in ("draft", "verify", "book", "other")) if sh else "-"
        cd = (r["c"] or 0) + (r["d"] or 0) if r.get("c") is not None else None
        ok = "-" if r.get("mismatches") is None else ("yes" if r["mismatches"] == 0 else f"{r['mismatches']} differ")
        lines.append(f"| {r['method']} | {fmt_num(r['tau'])} | {fmt_num(r['acceptance'], '{:.0%}')} | {fmt_num(r['tok_s'], '{:.1f}')} "
                     f"| {fmt_num(r['ratio'])}x | {fmt_num(r['prefill_tok_s'], '{:.0f}')} | {fmt_num(r['ttft_ms'], '{:.1f}')} "
                     f"| {fmt_num(r['peak_memory_gb'], '{:.3f}')} | {shares} | {fmt_num(cd)} | {fmt_num(r['limit'])} "
                     f"| {fmt_num(r['efficiency'], '{:.0%}')} | {ok} |")
    c = meta["costs"]
    lines += ["", "tau: tokens per verify; limit = tau / (c + d), c = verify cost at that width and d = draft cost, "
              "both in 1-token target steps measured in this run; efficiency = (x mlx-lm) / limit, i.e. the share of the "
              "cost model's speed-up over plain decoding that was realised. "
              "Adaptive, default (guarded), lookup and mlx-lm-spec limits use their per-cycle widths (lookup drafts cost "
              "nothing, plain steps 1) and the draft model's measured step."]
    if meta.get("shared_machine"):
        lines += ["", meta["shared_machine"]]
    if "dflash2" in c:
        cc = c["dflash2"]
        base = next((r for r in res["methods"] if r["kind"] == "mlx-lm"), None)
        per_tok = f" (mlx-lm in the run: {1e3 / base['tok_s']:.2f} ms a token)" if base and base["tok_s"] else ""
        lines += ["", f"Measured at {cc['context']} tokens of context: target step {1e3 * cc['t1']:.2f} ms{per_tok}; "
                  "c(w): " + ", ".join(f"{w}:{v:.2f}" for w, v in cc["c"].items()) + "; d(w): "
                  + ", ".join(f"{w}:{v:.2f}" for w, v in cc["d"].items() if w != "1")]
    for r in res["methods"]:
        if r["kind"] in ("adaptive", "default", "lookup", "lookup-dflash"):
            lines += ["", f"{r['method']}: {r['plain_cycles']} of {r['cycles']} cycles were plain steps, "
                      f"{r.get('lookup_cycles', 0)} lookup drafts; policy at the end: "
                      + "; ".join(sorted(set(p for p in r.get("policy", []) if p)))[:300] + "."]
    g = res.get("goals") or {}

    def verdict(met: bool) -> str:  # 3 prompts of 48 tokens time mostly the prefill and the first cycles
        if meta.get("quick"):
            return "not judged by a quick run (bench without --quick measures it)"
        return "met" if met else "NOT met"

    if g:
        lines += ["", "Goals (this run):"]
        if "default_vs_mlx_lm" in g:
            v = g["default_vs_mlx_lm"]
            lines.append(f"- default mode vs mlx-lm: {fmt_num(v['value'])}x, goal >= 0.97x: " + verdict(v["met"]))
        names = {"dflash2_vs_mlx_lm": "DFlash 2 vs mlx-lm", "dflash2_vs_mlx_lm_spec": "DFlash 2 vs mlx-lm speculative",
                 "efficiency": "efficiency"}
        for k, label in names.items():
            if k in g and "best_dflash2" in g:
                v = g[k]
                val = fmt_num(v["value"], "{:.0%}") if k == "efficiency" else fmt_num(v["value"]) + "x"
                goal = f"{v['goal']:.0%}" if k == "efficiency" else f"{v['goal']}x"
                lines.append(f"- {label} ({g['best_dflash2']}): {val}, goal >= {goal}: " + verdict(v["met"]))
        if "adaptive_vs_best_fixed" in g:
            v = g["adaptive_vs_best_fixed"]
            lines.append(f"- adaptive vs best fixed width ({v['against']}): {fmt_num(v['value'])}x "
                         + ("(better)" if v["better"] else "(within 3%)" if v["within_3pct"] else "(more than 3% slower)"))
    if meta.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items())]
    return "\n".join(lines) + "\n"


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["methods"]
    names = [r["method"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True)
    y = range(len(rows))
    colors = ["#888" if r["kind"].startswith("mlx-lm") else "#2a7" if r["kind"] in ("adaptive", "default")
              else "#c83" if r["kind"].startswith("lookup") else "#27b" for r in rows]
    a.barh(y, [r["tok_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        a.text(r["tok_s"], i, f" {r['ratio']:.2f}x  tau {r['tau']:.2f}", va="center", fontsize=8)
    a.set_yticks(list(y), names)
    a.invert_yaxis()
    a.set_xlabel("generated tok/s (after the first token)")
    fig.suptitle(title(res), fontsize=10)
    a.set_title(f"{res['meta']['prompts']}: {res['meta']['num_prompts']} prompts x {res['meta']['max_tokens']} tokens",
                fontsize=9)
    left = [0.0] * len(rows)
    for k, col in zip(("draft", "verify", "book", "other"), ("#e93", "#27b", "#999", "#ddd")):
        vals = [(r["shares"] or {}).get(k, 0.0) if r.get("shares") else 0.0 for r in rows]
        b.barh(y, vals, left=left, color=col, label=k)
        left = [l + v for l, v in zip(left, vals)]
    b.set_xlim(0, 1)
    b.set_xlabel("share of generation time (DFlash methods)")
    b.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    chart(res, out / "chart.png")
