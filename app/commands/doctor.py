"""`mlx-dflash doctor`: backend, BLAS in use (threads, few-row kernel), kernel
path, the measured verify-cost curve c(w) = t(w tokens) / t(1 token) on a
small (~30M) and a large (~400M-parameter) Qwen3-shaped target, and the cost
curves the guard prices a cycle with at each context length (c(w), d(w), t1
of the default model and its drafter at modes.LONG_CONTEXTS: measured and
cached now, or with --quick only those already cached)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

from app.errors import UserError
from mlx_dflash.platform.paths import cache_dir
from mlx_dflash.policy.costs import COST_METHOD, Costs
from mlx_dflash.engine.cost_source import CostSource
from mlx_dflash.policy.registry import GUARD_CALIBRATION, LONG_CONTEXTS, priced_at

WIDTHS = (1, 2, 4, 8, 16)
# (label, qwen3 ModelArgs overrides, repetitions): random weights, cost does not depend on them
PROBES = {
    "small": ("~30M-parameter Qwen3 (hidden 512, 8 layers, vocab 8192)",
              dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192), 15),
    "large": ("~400M-parameter Qwen3 (hidden 1024, 24 layers, 16 heads of 128, vocab 32768, float32)",
              dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3072, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, vocab_size=32768), 5),
}
IMPOSSIBLE = 0.6  # a w-token forward cannot cost much less than a 1-token one
CONTEXTS = (1024, 4096, 16384)  # guard curves doctor measures by default (65536 on request: a long prefill)
SHOWN_WIDTHS = (2, 5, 8, 16)  # of a guard curve's widths, the columns shown


def add_parser(sub):
    p = sub.add_parser("doctor", help="check the backend, BLAS and verify cost on this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="skip the verify-cost measurement")
    p.add_argument("--size", choices=("small", "large", "both"), default="both",
                   help="probe target(s) for c(w): ~30M, ~300M parameters, or both (default)")
    p.add_argument("--kernel-ab", action="store_true",
                   help="measure c(w) with the few-row gemm kernel on and off (Linux CPU)")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the BLAS thread count and the kernel's routing again (cached per machine)")
    p.add_argument("--context", type=int, default=256, help="tokens of context for c(w)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="context lengths at which to measure the guard's cost curves for the default model "
                        f"(comma-separated; the guard's lengths are {', '.join(map(str, LONG_CONTEXTS))})")


def _progress(msg: str) -> None:
    sys.stderr.write(f"doctor: {msg}\n")
    sys.stderr.flush()


def probe_model(size: str = "small"):
    """A Qwen3 of the given probe size, random weights, float32."""
    import mlx.core as mx
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1e6,
                           tie_word_embeddings=True, **PROBES[size][1])
    mx.random.seed(0)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def n_params(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def verify_cost(model=None, context: int = 256, widths=WIDTHS, reps: int = 15, log=None) -> dict:
    """c(w) over `context` cached tokens. Widths are timed round-robin and each
    round gives its own ratios t(w) / t(1), so load that comes and goes hits
    all widths alike; c(w) is the median ratio, ms the median time."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model = model or probe_model()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % 1000, cache=cache))

    def t(w):
        x = mx.arange(w)[None]
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        dt = time.perf_counter() - t0
        trim_prompt_cache(cache, w)
        return dt

    for w in widths:  # warm up every shape
        t(w)
    rounds = []
    for i in range(reps):
        rounds.append({w: t(w) for w in widths})
        if log and (i + 1) % max(1, reps // 3) == 0:
            log(f"  round {i + 1}/{reps}")

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    def half_iqr(xs):
        xs = sorted(xs)
        return (xs[(3 * len(xs)) // 4] - xs[len(xs) // 4]) / 2

    t1 = [r[1] for r in rounds]
    return {"ms": {w: med([r[w] for r in rounds]) * 1e3 for w in widths},
            "ratio": {w: med([r[w] / r[1] for r in rounds]) for w in widths},
            "noise": {w: half_iqr([r[w] / r[1] for r in rounds]) for w in widths},
            "spread_t1": (max(t1) - min(t1)) / med(t1)}


NOISE_FLOOR = 0.05  # ratios closer than this are equal: timer and scheduler jitter on a 1-token step


def cost_check(ratio: dict, noise: dict) -> list:
    """What is wrong with a measured c(w): a w-token forward cannot cost less than
    a 1-token one, nor a wider one less than a narrower one, beyond the noise of
    the rounds (half their interquartile range). [] when c(w) >= 1 and
    non-decreasing in w. Seen before the kernel's threads were chosen per weight
    size: c(2) = 0.76 and c(4) = 0.68 on a 0.5B target, i.e. a slowed 1-token step."""
    ws = sorted(int(w) for w in ratio)
    tol = {w: max(NOISE_FLOOR, noise.get(w, noise.get(str(w), 0.0))) for w in ws}

    def c(w):
        return ratio.get(w, ratio.get(str(w)))

    out = [f"c({w}) = {c(w):.2f} < 1: the 1-token step is slower than it should be"
           for w in ws[1:] if c(w) < 1 - tol[w]]
    out += [f"c({b}) = {c(b):.2f} < c({a}) = {c(a):.2f}: a wider verify measured cheaper"
            for a, b in zip(ws[1:], ws[2:]) if c(b) < c(a) - tol[a] - tol[b]]
    return out


def step_threads(model, context: int = 256, reps: int = 7) -> dict:
    """The 1-token step at the kernel threads measured for this machine, on 1
    thread and on every core (fastblas.fastest_threads): the measured choice
    should be the fastest or close to it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_dflash.platform import fastblas

    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % 1000, cache=cache))

    def step():
        mx.eval(model(mx.array([[1]]), cache=cache))
        trim_prompt_cache(cache, 1)

    return fastblas.fastest_threads(step, reps)


def _embedded_target():
    """The embedded target, loaded in its checkpoint's dtype, and its folder (None if missing)."""
    import mlx_lm

    from mlx_dflash.models.discovery import default_pair

    path = default_pair()[0]
    if not (path / "config.json").exists():
        return None, path
    return mlx_lm.load(str(path))[0], path


def dtype_step_cost(model=None) -> dict:
    """1-token step of the embedded target in float32 and in bfloat16, timed
    round-robin (median; dtype_choice.step_times, what `dtype auto` measures): on a
    CPU backend bf16 matmuls run outside BLAS."""
    import mlx.core as mx

    from mlx_dflash.models.dtype_choice import cast, param_dtype, step_times

    if model is None:
        model = _embedded_target()[0]
        if model is None:
            return {}
    was = param_dtype(model)
    ms = step_times(model, (mx.float32, mx.bfloat16))
    cast(model, was)
    return {"float32_ms": round(ms["float32"], 2), "bfloat16_ms": round(ms["bfloat16"], 2),
            "ratio": round(ms["bfloat16"] / ms["float32"], 2)}


def compute_dtype_report(quick: bool) -> dict:
    """What the default model computes in under the default `dtype` setting (auto),
    and why: $MLX_DFLASH_DTYPE, Metal, or the choice measured on this machine
    (cached; measured now unless `quick`)."""
    from mlx_dflash.models import dtype_choice

    try:
        setting, src = dtype_choice.requested("auto")
    except ValueError as e:  # a bad $MLX_DFLASH_DTYPE: say so, do not fail the whole check
        return {"dtype": "invalid", "source": str(e), "why": str(e)}
    if setting != "auto":
        return {"dtype": setting, "source": src, "why": f"set by {src} for every model"}
    model, path = (None, None) if quick else _embedded_target()
    if model is not None:
        c = dtype_choice.choose(model, "auto", "setting", path)
        return {"dtype": c.name, "source": "auto", "why": c.why, "model": "embedded/target"}
    from mlx_dflash.models.discovery import default_pair

    hit = dtype_choice.cached(default_pair()[0])
    if hit:
        return {"dtype": hit["name"], "source": "auto", "why": hit["why"], "model": "embedded/target"}
    if dtype_choice.backend() != "cpu":
        return {"dtype": "checkpoint", "source": "auto", "why": "auto: the checkpoint's; Metal runs it natively"}
    return {"dtype": "auto", "source": "auto", "why": "the faster of the checkpoint's and float32, measured at "
            "a model's first load on this machine (doctor without --quick measures the embedded target now)"}


def _describe(cfg) -> str:
    """A model or drafter config (a cost key's) in a few words."""
    if not isinstance(cfg, dict):
        return "none"
    arch = cfg.get("model_type") or "/".join(cfg.get("architectures") or []) or cfg.get("type", "?")
    h, n = cfg.get("hidden_size"), cfg.get("num_hidden_layers")
    return f"{arch} hidden {h} x {n} layers" if h and n else str(arch)


def _measured_with(key: dict) -> str:
    """What tells cached curves of one model + drafter shape apart: the BLAS they were
    measured with and which weights (two drafters of one shape, another precision)."""
    blas = str((key.get("machine") or {}).get("blas") or "?").split(" (")[0].split(" ")[0]
    weights = "/".join(str(key.get(k) or "-")[:4] for k in ("model_params", "drafter_params"))
    return f"{blas}, weights {weights}"


def _curve_row(context: int, c: Costs) -> dict:
    return {"context": context, "t1_ms": round(c.t1 * 1e3, 3), "plain_ms": round(c.t_plain * 1e3, 3),
            "catch_up_ms_1k": round(c.u * c.t1 * 1e6, 2),  # the drafter taking in 1,000 context rows
            "c": {str(w): round(v, 3) for w, v in sorted(c.c.items())},
            "d": {str(w): round(v, 3) for w, v in sorted(c.d.items())}}


def cached_guard_costs() -> list:
    """The guard's cost curves cached on this machine (by the guard, `bench` or a
    doctor run), grouped by model + drafter: reads files, measures nothing."""
    groups = {}
    for p in sorted((cache_dir() / "calibration").glob("costs-*.json")):
        try:
            j = json.loads(p.read_text())
            key, c = j["key"], Costs.from_json(j["costs"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(key, dict) or key.get("method") != COST_METHOD or not c.t_plain:
            continue  # another measuring method, or not a guard's curve (no plain token)
        if key.get("batch") is not None or not isinstance(key.get("context") or 0, int):
            continue  # a batch engine's curve (keyed by its batch size; before, tagged "batch<B>"), not a length
        g = groups.setdefault((_describe(key.get("model")), _describe(key.get("drafter"))), [])
        g.append({**_curve_row(int(key.get("context") or c.context), c), "with": _measured_with(key)})
    return [{"model": m, "drafter": d, "curves": sorted(rows, key=lambda r: r["context"])}
            for (m, d), rows in groups.items()]


def measure_guard_costs(contexts, log) -> dict:
    """The curves the guard prices a cycle with for the default model and its
    drafter (the one `chat` loads): at its base length and at the lengths it
    prices `contexts` at (modes.priced_at), measured as the guard measures them
    (and cached where it reads them), or read from that cache. {} without a drafter."""
    from mlx_dflash.engine.calibrate import DEFAULT, SYNTHETIC_FROM
    from mlx_dflash.models.manager import load_model

    log("loading the default model and its drafter for the guard's cost curves...")
    lm = load_model(None, dflash=True)
    if lm.drafter is None:
        return {}
    rows = []
    model = CostSource(lm.model, lm.drafter, DEFAULT).cost_model()  # (the base curve: measured or read now)
    for n in (0, *sorted({priced_at(n) for n in contexts} - {None})):  # 0: the base curve
        if n:
            log(f"  the guard's cost curve at {n} tokens of context (once per machine"
                + (f"; random K/V rows past {SYNTHETIC_FROM} tokens" if n > SYNTHETIC_FROM else "") + ")...")
            model.k(1, n)
        c = DEFAULT.book.curve(lm.model, lm.drafter, 0, (), priced_at(n))
        rows.append(_curve_row(n or GUARD_CALIBRATION["context"], c))
    return {"model": lm.id, "drafter": lm.drafter_id or "", "curves": rows}


def _load():
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _warnings(out: dict) -> list:
    """Figures that cannot be right, and a machine too busy for them to be."""
    w = []
    loads = [x for x in out.get("load_average", []) if x is not None]
    if loads and max(loads) > 0.75 * out["cpus"] and out.get("probes"):
        w.append(f"machine busy: load average up to {max(loads):.1f} on {out['cpus']} cores while measuring; "
                 "the figures below are unreliable (run again when the machine is idle)")
    for key, probe in out.get("probes", {}).items():
        st = probe.get("step_threads") or {}
        if st and st["ms"][st["fastest"]] < 0.9 * st["ms"]["measured"]:
            w.append(f"{key} target: the 1-token step is {st['ms']['measured']:.1f} ms at the measured kernel threads "
                     f"but {st['ms'][st['fastest']]:.1f} ms on {st['fastest']}: run `mlx-dflash doctor --recalibrate` "
                     "on a quiet machine")
        for mode, r in probe["runs"].items():
            bad = {wd: c for wd, c in r["verify_cost"].items() if wd != "1" and c < IMPOSSIBLE}
            if bad:
                wd, c = next(iter(bad.items()))
                w.append(f"{key} target, kernel {mode}: c({wd}) = {c:.2f} is impossible (a {wd}-token forward "
                         f"below {IMPOSSIBLE} of a 1-token one): the machine's load changed during the measurement")
            if key == "large" or len(out["probes"]) == 1:  # the check the issue asks of the >= 300M probe
                w += [f"{key} target, kernel {mode}: {x}" for x in r.get("check", [])]
            if r["spread_t1"] > 0.5:
                w.append(f"{key} target, kernel {mode}: 1-token step times varied by {100 * r['spread_t1']:.0f}% "
                         "between rounds: noisy")
    return w


def report(quick: bool = False, context: int = 256, size: str = "both", kernel_ab: bool = False,
           recalibrate: bool = False, log=None, contexts=CONTEXTS) -> dict:
    import mlx.core as mx

    from mlx_dflash.platform import fastblas

    log = log or (lambda s: None)
    if recalibrate and fastblas.STATE["shim"]:
        log("measuring BLAS threads and the few-row kernel's routing...")
        fastblas.calibrate(force=True)
    try:
        from mlx_dflash.drafting.conv import kernel_backend

        kernel = kernel_backend()
    except ImportError:
        kernel = "unavailable"
    backend = "metal" if mx.metal.is_available() else ("cuda" if getattr(mx, "cuda", None) and mx.cuda.is_available() else "cpu")
    cal = fastblas.STATE.get("calibration") or {}
    out = {
        "mlx": mx.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "backend": backend,
        "device": str(mx.default_device()),
        "blas": fastblas.STATE["blas"],
        "blas_note": fastblas.STATE["error"],
        "blas_threads": fastblas.STATE["threads"],
        "blas_threads_from": fastblas.STATE.get("threads_from"),
        "blas_thread_scores_ms": cal.get("thread_scores_ms"),
        "kernel_threads": fastblas.STATE.get("kernel_threads"),
        "small_gemm": fastblas.STATE["small_gemm"],
        "cpus": _cpus(),
        "load_average": [_load()],
        "sgemm_gflops": round(fastblas.gemm_gflops(), 1),
        "fused_kernels": kernel in ("metal", "cuda"),
        "conv_kernel": kernel,
    }
    from mlx_dflash.models.dtype_choice import DTYPE_ENV

    if not quick:
        log("choosing the embedded target's compute dtype (measured once per machine)...")
    out["compute_dtype"] = compute_dtype_report(quick)
    if backend == "cpu" and not quick:
        log("timing the embedded target's 1-token step in float32 and bfloat16...")
        out["dtype_step"] = dtype_step_cost()
        r = out["dtype_step"].get("ratio")
        if r and r > 1.3 and out["compute_dtype"]["dtype"] in ("checkpoint", "bfloat16", "float16", "auto"):
            out["dtype_hint"] = (f"bfloat16 steps cost {r:.1f}x float32 on this CPU: set {DTYPE_ENV}=float32 "
                                 "or `mlx-dflash settings set MODEL dtype float32` (or auto)")
    if not quick:
        out["verify_context"] = context
        out["probes"] = {}
        modes = [True, False] if kernel_ab and fastblas.STATE["shim"] else [fastblas.STATE["small_gemm"]]
        for key in (("small", "large") if size == "both" else (size,)):
            label, _, reps = PROBES[key]
            log(f"building the {key} probe target ({label})...")
            model = probe_model(key)
            probe = {"label": label, "params": n_params(model), "runs": {}}
            for mode in modes:
                prev = fastblas.set_small_gemm(mode)
                name = "on" if mode else "off"
                log(f"measuring c(w), w = {', '.join(map(str, WIDTHS))}, on the {key} target"
                    + (f" with the few-row kernel {name}" if len(modes) > 1 else "") + f" ({reps} rounds)...")
                try:
                    vc = verify_cost(model, context=context, reps=reps, log=log)
                finally:
                    fastblas.set_small_gemm(prev)
                probe["runs"][name] = {"verify_cost": {str(w): round(r, 3) for w, r in vc["ratio"].items()},
                                       "verify_ms": {str(w): round(v, 2) for w, v in vc["ms"].items()},
                                       "noise": {str(w): round(v, 3) for w, v in vc["noise"].items()},
                                       "spread_t1": round(vc["spread_t1"], 3),
                                       "check": cost_check(vc["ratio"], vc["noise"])}
                out["load_average"].append(_load())
            if key == "large" and fastblas.STATE["small_gemm"]:
                log("timing the large target's 1-token step at the measured kernel threads, 1 and every core...")
                probe["step_threads"] = step_threads(model, context)
            out["probes"][key] = probe
            del model
        first = next(iter(out["probes"].values()))["runs"]
        cur = first.get("on" if fastblas.STATE["small_gemm"] else "off") or next(iter(first.values()))
        out["verify_cost"], out["verify_ms"] = cur["verify_cost"], cur["verify_ms"]  # the first probe, as before
    if quick:
        out["guard_costs"] = cached_guard_costs()
    else:
        got = measure_guard_costs(contexts, log)
        out["guard_costs"] = [got] if got else []
    out["warnings"] = _warnings(out)
    return out


def run(args):
    # progress goes to stderr, so that with --json stdout stays one JSON object
    try:
        contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        raise UserError(f"--contexts: '{args.contexts}' is not a list of positive token counts; e.g. 1024,4096,16384")
    r = report(args.quick, args.context, args.size, args.kernel_ab, args.recalibrate, _progress, contexts)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"MLX {r['mlx']} on {r['platform']}, backend {r['backend']} ({r['device']}), {r['cpus']} cores")
    print(f"BLAS: {r['blas']}  [{r['sgemm_gflops']} GFLOP/s sgemm]" + (f"  note: {r['blas_note']}" if r["blas_note"] else ""))
    if r["blas_threads"]:
        scores = r.get("blas_thread_scores_ms")
        print(f"BLAS threads: {r['blas_threads']} ({r['blas_threads_from']}"
              + ("; slowest test round, ms: " + "; ".join(
                  f"{what} " + ", ".join(f"{t} thread(s) {v}" for t, v in per.items()) for what, per in scores.items())
                  if scores else "")
              + ")")
    # warnings first: they qualify the figures below them
    for w in r["warnings"]:
        print(f"warning: {w}")
    if r.get("kernel_threads"):
        from mlx_dflash.platform.fastblas import kernel_threads_text

        print(f"few-row kernel threads: {kernel_threads_text(r['kernel_threads'])}")
    print(f"DFlash 2 conv: {r['conv_kernel']}" + (" (fused kernel)" if r["fused_kernels"] else " (MLX ops, compiled)"))
    cd = r["compute_dtype"]
    what = f" for {cd['model']}" if cd.get("model") else ""
    print(f"compute dtype: {cd['dtype']} ({cd['source']}){what}: {cd['why']}" + (
        f"; embedded target 1-token step: float32 {r['dtype_step']['float32_ms']:.1f} ms, bfloat16 "
        f"{r['dtype_step']['bfloat16_ms']:.1f} ms" if r.get("dtype_step") else ""))
    if r.get("dtype_hint"):
        print(f"hint: {r['dtype_hint']}")
    for key, p in r.get("probes", {}).items():
        print(f"verify cost c(w) at {r['verify_context']} tokens of context, {p['label']}, "
              f"{p['params'] / 1e6:.0f}M parameters:")
        for mode, run_ in p["runs"].items():
            vc, ms = run_["verify_cost"], run_["verify_ms"]
            tag = f"  kernel {mode}:" if len(p["runs"]) > 1 else " "
            print(f"{tag} " + "  ".join(f"c({w})={c:.2f}" for w, c in vc.items()) + f"   (1-token step {ms['1']:.1f} ms)"
                  + ("" if run_.get("check") else "   c(w) >= 1, non-decreasing: ok"))
        st = p.get("step_threads")
        if st:
            print("  1-token step by kernel threads: " + ", ".join(f"{k} {v:.1f} ms" for k, v in st["ms"].items())
                  + f" (fastest: {st['fastest']})")
    for line in guard_cost_lines(r.get("guard_costs", []), r.get("probes") is None):
        print(line)
    return 0


def guard_cost_lines(groups: list, quick: bool) -> list:
    """The guard's cost curves as a table per model + drafter."""
    if not groups:
        return ["guard cost by context: " + ("none cached yet (the guard measures them at a model's first "
                                             "long request; doctor without --quick measures them now)"
                                             if quick else "the default model has no drafter")]
    out = []
    for g in groups:
        widths = sorted({int(w) for r in g["curves"] for w in r["c"]} & set(SHOWN_WIDTHS)
                        | {max(int(w) for r in g["curves"] for w in r["c"])})
        out.append(f"guard cost by context, {g['model']} + drafter {g['drafter']}"
                   + (" (cached)" if quick else "") + ": c(w) verify, d(w) draft, in 1-token steps t1; "
                   "catch-up: the drafter taking in 1k context rows (a probe's first draft after a prompt)")
        out.append("  context   t1 ms  plain ms  catch-up ms  " + "  ".join(f"c({w:>2})" for w in widths) + "  "
                   + "  ".join(f"d({w:>2})" for w in widths) + "  measured with")
        for r in g["curves"]:
            cell = lambda curve, w: f"{curve[str(w)]:5.2f}" if str(w) in curve else "    -"  # noqa: E731
            out.append(f"  {r['context']:>7}  {r['t1_ms']:6.2f}  {r['plain_ms']:8.2f}  "
                       f"{r.get('catch_up_ms_1k', 0.0):11.2f}  " + "  ".join(cell(r["c"], w) for w in widths) + "  "
                       + "  ".join(cell(r["d"], w) for w in widths) + f"  {r.get('with', '')}")
    return out
