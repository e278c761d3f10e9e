"""`mlx-dflash bench`: our decoders against the tools users already have, in
one run, on the same prompts, interleaved prompt by prompt.

Methods: plain decoding with mlx-lm's own `stream_generate` (the baseline),
mlx-lm's draft-model speculative decoding (classic draft model), DFlash 1,
DFlash 2 at fixed verify widths, DFlash 2 with the adaptive width, the default
mode (verify mode dflash at the default width, with its never-slower guard),
and prompt lookup without and with the drafter. All load through
`mlx_dflash.load`, so every method runs the same weights.

Per method: tau, acceptance, generated tok/s after the first token, prefill
tok/s, time to first token, peak memory, where the time goes, the ratio to
mlx-lm, and the cost-model limit tau / (c + d) with efficiency = measured
speedup over mlx-lm / limit, where c and d are the verify and draft costs
measured in this run in units of one 1-token target step (bench_report.py).
Writes results.json, results.md and chart.png to --out. Other modes, each in a
module of its own: `--realistic` (realistic.py; with `--contexts`, long.py),
`--batch` (several streams at once, batch.py; with `--realistic`,
batch_realistic.py) and `--server-load` (server_load.py)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from app.bench import batch as bench_batch
from app.bench import batch_realistic as bench_batch_realistic
from app.bench import long as bench_long
from app.bench import realistic as bench_realistic
from app.bench import server_load
from app.bench.costs import measure
from app.bench.options import ints
from app.bench.prompts import SETS, load_prompts
from app.bench.report import KINDS, goals, machine_info, markdown, summarize, write
from app.bench.runs import Method, fastest_plain
from app.errors import UserError

MAX_TOKENS = 128  # per prompt, unless the mode's module says otherwise
DEFAULT_KINDS = ("mlx-lm", "mlx-lm-spec", "dflash1", "dflash2", "adaptive", "default", "lookup")
SHARED = ("The machine may have been shared with other jobs while this ran: compare the ratios "
          "(measured side by side, prompt by prompt), not the absolute tok/s.")


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark DFlash against mlx-lm (plain and speculative) on a prompt set")
    p.add_argument("--model", default=None, help="target (default: the embedded pair)")
    p.add_argument("--drafter", default=None, help="DFlash drafter (default: the model's own, as `generate` "
                   "resolves it; the embedded one for the embedded target)")
    p.add_argument("--dflash1", default=None, help="DFlash 1 drafter (default: the embedded one)")
    p.add_argument("--draft-model", default=None, help="classic draft model for mlx-lm speculative decoding "
                   "(default: the embedded draft-ar)")
    p.add_argument("--prompts", default=None, help=f"{' | '.join(SETS)} | FILE.jsonl "
                   '(one {"prompt": ...} or {"messages": [...]} per line; default humaneval, --batch gsm8k-dev)')
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=None, help="per prompt (default 128; --batch 64, "
                   "--realistic --batch and --server-load 32)")
    p.add_argument("--methods", default=",".join(DEFAULT_KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--widths", default=None, help="DFlash 2 fixed verify widths, e.g. 2,3,4,5,8 "
                   "(default: 2 to the drafter's block size)")
    p.add_argument("--adaptive-max-width", type=int, default=None, help="widest adaptive verify "
                   "(default: the widest fixed width)")
    p.add_argument("--dflash1-width", type=int, default=5)
    p.add_argument("--lookup-width", type=int, default=None, help="lookup draft length (default: the "
                   "loop's default width)")
    p.add_argument("--num-draft", default="3", help="mlx-lm draft tokens per cycle (comma list)")
    p.add_argument("--out", default=None, help="output folder (default: bench-<prompts>-<time>, ignored by git)")
    p.add_argument("--quick", action="store_true", help="3 prompts, 48 tokens, fewer widths (< 3 min)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    bench_long.add_arguments(bench_realistic.add_arguments(p))
    bench_batch.add_arguments(p)
    server_load.add_arguments(p)


NEEDS_DRAFTER = ("dflash2", "adaptive", "default", "lookup-dflash")


def _exists(p) -> bool:
    return p is not None and (Path(p) / "config.json").exists()


def resolve_drafter(model_ref: str):
    """(folder, how it was found) of the drafter `generate --model X` would use:
    the saved or best compatible one (mlx_dflash.models.manager), else a published one
    found by the registry; or (None, why there is none)."""
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.models.manager import pick_drafter
    from mlx_dflash.models.model_names import model_path, resolve
    from mlx_dflash.models.registry import find_drafter, missing_message
    from mlx_dflash.settings.store import SettingsStore

    try:
        store = SettingsStore()
        entries = discover(store)
        entry = resolve(model_ref, store, entries)
        if entry.kind == "target":
            did, dpath = pick_drafter(entry, store.model(entry.id), entries, store)
            if dpath:
                return dpath, f"{did}, the drafter `generate --model {model_ref}` uses"
    except Exception:  # a name the manager does not list: the registry may still know it
        pass
    path = Path(model_path(model_ref)).expanduser()
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None, f"{model_ref} is not on this machine (no config.json), so no drafter was looked up"
    found = find_drafter(model_ref, path, cfg)
    if found is None:
        return None, f"no DFlash drafter is known for {model_ref}; pass --drafter"
    if found.path is None:
        return None, missing_message(model_ref, found.repo).replace(" (using plain decoding now)", "")
    return str(found.path), found.why


def setup(args, log=lambda s: None):
    """Load the models, decide the methods; returns (ctx, methods, skipped)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dflash import load
    from mlx_dflash.drafting.drafter import load_drafter, validate
    from mlx_dflash.models.discovery import default_pair, models_dir
    from mlx_dflash.target.adapter import Target

    kinds = [k.strip() for k in args.methods.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UserError(f"unknown method {bad[0]!r}; valid: {', '.join(KINDS)}")
    embedded = args.model is None
    if embedded and not _exists(default_pair()[0]):
        raise UserError(f"the embedded target is missing from {default_pair()[0]}; pass --model")
    skipped, why2, note = {}, None, None
    d2 = args.drafter or (str(default_pair()[1]) if embedded else None)
    if d2 is None and any(k in kinds for k in NEEDS_DRAFTER):
        d2, why2 = resolve_drafter(args.model)
        note = f"drafter for {args.model}: {d2} ({why2})" if d2 else f"no drafter: {why2}"
    d1 = args.dflash1 or (str(models_dir() / "dflash1") if embedded else None)
    da = args.draft_model or (str(models_dir() / "draft-ar") if embedded else None)
    explicit = args.methods != ",".join(DEFAULT_KINDS)

    def need(kind, path, flag, why=None):
        if kind not in kinds:
            return False
        if _exists(path):
            return True
        why = why or (f"no model at {path}" if path else f"no {flag} given")
        if explicit:
            raise UserError(f"method {kind} needs {flag}: {why}")
        skipped[kind] = why
        return False

    use2 = any([need(k, d2, "--drafter", why2) for k in NEEDS_DRAFTER])  # each noted if skipped
    use1 = need("dflash1", d1, "--dflash1")
    usea = need("mlx-lm-spec", da, "--draft-model")
    target = args.model or str(default_pair()[0])
    model, tok, drafter2 = load(target, d2 if use2 else None)
    if not use2:
        drafter2 = None  # `load` may have found one by itself; the methods above decided without it
    ctx = {"model": model, "tok": tok, "dflash2": drafter2, "note": note if why2 else None}
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
        for k in ints(args.num_draft, "--num-draft")[: 1 if quick else None]:
            methods.append(Method(f"mlx-lm-spec-k{k}", "mlx-lm-spec", k))
    if use1:
        w1 = min(args.dflash1_width, ctx["dflash1"].block_size)
        methods.append(Method(f"dflash1-w{w1}", "dflash1", w1))
    from mlx_dflash.policy.registry import DEFAULT_BLOCK_SIZE

    wl = args.lookup_width or DEFAULT_BLOCK_SIZE
    if use2:
        B, v = drafter2.block_size, drafter2.version
        if "default" in kinds:
            methods.append(Method(f"default (dflash{v}, guard)", "default", min(DEFAULT_BLOCK_SIZE, B)))
        if args.widths:
            widths = ints(args.widths, "--widths")
            if widths[-1] > B:
                raise UserError(f"width {widths[-1]} exceeds the drafter's block size {B}")
        else:
            widths = [min(3, B), min(5, B)] if quick else list(range(2, min(B, 8) + 1))
        widths = sorted(set(widths))
        if "dflash2" in kinds:
            methods += [Method(f"dflash{v}-w{w}", "dflash2", w) for w in widths]
        if "adaptive" in kinds:
            wa = args.adaptive_max_width or max(widths)
            if not 2 <= wa <= B:
                raise UserError(f"--adaptive-max-width must be between 2 and {B}")
            methods.append(Method(f"dflash{v}-adaptive-w{wa}", "adaptive", wa))
        if "lookup-dflash" in kinds:
            methods.append(Method(f"lookup+dflash{v}-w{min(wl, B)}", "lookup-dflash", min(wl, B)))
    if "lookup" in kinds:
        methods.append(Method(f"lookup-w{wl}", "lookup", wl))
    return ctx, methods, skipped


def bench(args, log=lambda s: None) -> dict:
    if args.quick:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 3), min(args.max_tokens, 48)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise UserError("--num-prompts and --max-tokens must be >= 1")
    t_start = time.time()
    ctx, methods, skipped = setup(args, log)
    prompts = load_prompts(args.prompts, ctx["tok"], args.num_prompts)
    if ctx["note"]:  # after the prompts: a bad prompt file stays a one-line error
        log(ctx["note"])
    log(f"{len(prompts)} prompts x {len(methods)} methods x {args.max_tokens} tokens; skipped: {skipped or 'none'}")
    log("timing the target's 1-token step at the measured kernel threads, 1 and every core...")
    step_threads = fastest_plain(ctx["model"])  # the plain baseline, and every method, at its fastest
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
    cost_json = {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in costs.items() if k != "lookup"}
    # kept in the JSON so that notes and CI can read the verdicts without recomputing them
    return {
        "meta": {"command": "mlx-dflash bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                 if len(sys.argv) > 1 and sys.argv[1] == "bench" else None,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                 "seconds": round(time.time() - t_start, 1), "prompts": args.prompts,
                 "num_prompts": len(prompts), "max_tokens": args.max_tokens, "quick": args.quick,
                 "temperature": 0.0, "batch": 1, "models": ctx["paths"], "skipped": skipped,
                 "machine": machine_info(), "costs": cost_json, "shared_machine": SHARED,
                 "step_threads": step_threads},
        "methods": rows,
        "goals": goals(rows),
        "per_prompt": [{"prompt": p["id"], **{m.name: {"tokens": len(m.runs[i].tokens),
                                                        "tok_s": m.runs[i].gen_tokens / m.runs[i].gen_time
                                                        if m.runs[i].gen_time > 0 else 0.0}
                                               for m in methods}} for i, p in enumerate(prompts)],
    }


def _mode(args):
    """The module that runs the mode the flags ask for (None: this one's `bench`)."""
    if args.batch and args.server_load:
        raise UserError("--batch and --server-load are separate runs; pick one")
    if args.contexts and (args.batch or args.server_load):
        raise UserError("--contexts is the long-context realistic bench: leave out --batch / --server-load")
    if args.server_load:
        return server_load
    if args.batch:
        return bench_batch_realistic if args.realistic else bench_batch
    if args.realistic:
        return bench_long if args.contexts else bench_realistic
    return None


def run(args):
    def log(s):
        sys.stderr.write(f"bench: {s}\n")
        sys.stderr.flush()

    mode = _mode(args)
    if args.max_tokens is None:
        args.max_tokens = getattr(mode, "MAX_TOKENS", MAX_TOKENS)
    if mode is not None:
        return mode.run(args, log)
    args.prompts = args.prompts or "humaneval"
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
