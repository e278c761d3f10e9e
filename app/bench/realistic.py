"""`mlx-dflash bench --realistic`: the regime a user with a real model meets.

The embedded pair is tiny and dispatch-bound, so its figures say little about
a real target. Here the targets have published shapes (random weights: cost
does not depend on them), the drafter has the published DFlash 2 shape for that
target (its real forward runs every cycle, so its cost is real), and only the
drafter's *accuracy* is simulated: each cycle proposes the target's own greedy
continuation (precomputed with plain mlx-lm decoding) for an accept length
drawn from a published distribution, then a wrong token. Acceptance per
position is geometric, P(length >= i) = alpha^i, with alpha set so that the mean
tau at block 16 is the published figure (default 6.5, DFlash on Qwen3 in the
papers' tables); a verify of width w then accepts min(length, w - 1).

Everything else is the product: `mlx_dflash.stream_generate` (fixed widths and
the default guarded mode), the verify, the bookkeeping, against plain mlx-lm on
the same weights, prompt by prompt, interleaved. Rows: tau, c(w), d(w), the
limit tau / (c + d) and efficiency = speedup / limit (bench_report.summarize)."""

from __future__ import annotations

import json
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

from app.bench.report import fmt_num, machine_info, machine_line, summarize, threads_text
from app.bench.runs import Method, fastest_plain, price_as, run_mlx_lm, run_ours
from mlx_dflash.drafting.proposers import propose_rows
from app.errors import UserError

# published shapes (config.json of the Hugging Face repos), vocab included
_QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
_QWEN3_17B = dict(_QWEN3_06B, hidden_size=2048, intermediate_size=6144)
_QWEN3_4B = dict(_QWEN3_06B, hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32)
_QWEN3_8B = dict(_QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
# a Qwen3.5 / Qwen3-Next style hybrid (gated delta net 3 : 1 full attention), dense, at 0.6B scale
_HYBRID = dict(model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, intermediate_size=3072,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=151936,
               tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
               linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               rope_parameters={"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]})
# the long-context bench's targets (bench_long.py): shapes small enough that a 2-core CPU
# prefills 32k-64k tokens twice per length in minutes; Qwen3 / Qwen3.5 layouts at hidden 512
_QWEN3_SMALL = dict(_QWEN3_06B, hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, vocab_size=32768)
_HYBRID_SMALL = dict(_HYBRID, hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64, vocab_size=32768, linear_num_value_heads=8,
                     linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
TARGETS = {  # name -> (config, quantization bits or 0, label)
    "qwen3-0.6b": (_QWEN3_06B, 0, "Qwen3-0.6B shape"),
    "qwen3-0.6b-4bit": (_QWEN3_06B, 4, "Qwen3-0.6B shape, 4-bit (group 64)"),
    "hybrid-0.6b": (_HYBRID, 0, "Qwen3.5-style gated-delta hybrid, 0.6B scale"),
    "qwen3-1.7b": (_QWEN3_17B, 0, "Qwen3-1.7B shape"),
    "qwen3-1.7b-4bit": (_QWEN3_17B, 4, "Qwen3-1.7B shape, 4-bit (group 64)"),
    "qwen3-small": (_QWEN3_SMALL, 0, "Qwen3 layout at hidden 512, 8 layers (8 heads of 64, 4 KV), vocab 32768"),
    "hybrid-small": (_HYBRID_SMALL, 0, "Qwen3.5-style gated-delta hybrid (3 : 1) at hidden 512, 8 layers, "
                                       "vocab 32768"),
    "qwen3-4b": (_QWEN3_4B, 0, "Qwen3-4B shape"),  # (GPU sizes: scripts/gpu_check.sh)
    "qwen3-8b": (_QWEN3_8B, 0, "Qwen3-8B shape"),
}
DEFAULT_TARGETS = "qwen3-0.6b,hybrid-0.6b"
WIDTHS = (5, 8, 16)


def add_arguments(p):
    g = p.add_argument_group("realistic regime (--realistic)")
    g.add_argument("--realistic", action="store_true", help="published-shape targets and drafters (random "
                   "weights), replayed acceptance, the product's loop against mlx-lm (bench_realistic.py)")
    g.add_argument("--targets", default=None, help=f"comma list of {', '.join(TARGETS)} (default {DEFAULT_TARGETS})")
    g.add_argument("--tau", type=float, default=6.5, help="published mean tau at block 16 to replay")
    g.add_argument("--draft-layers", type=int, default=5, help="drafter depth (published DFlash drafters: 5)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (CPU: float32; mlx-cpu "
                   "runs half-precision matmuls outside BLAS, ~10x slower)")
    g.add_argument("--realistic-widths", default=",".join(map(str, WIDTHS)))
    return g


def alpha_for(tau: float, block: int = 16) -> float:
    """Per-position acceptance alpha with 1 + sum_{i < block} alpha^i = tau (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if 1 + sum(a ** i for i in range(1, block)) < tau:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


class Replay:
    """One stream's replayed acceptance: the prompt and the target's own greedy
    continuation, and its own RNG. Each cycle draws an accept length (geometric:
    P(length >= i) = alpha^i, at most block - 1) and proposes the continuation's
    next tokens up to it, then tokens that each differ from the target's."""

    def __init__(self, prompt: list, continuation: list, alpha: float, block_size: int, vocab: int, seed: int,
                 lengths: Optional[list] = None):
        self.seq, self.start = list(prompt) + list(continuation), len(prompt)
        self.alpha, self.block_size, self.vocab = alpha, block_size, vocab
        self.rng = random.Random(seed)
        self.lengths = lengths if lengths is not None else []  # every accept length drawn

    def drafts(self, anchor: int, emitted: int, width: int) -> list:
        """The `width - 1` drafts after `anchor`, the stream's `emitted`-th token."""
        pos = self.start + emitted  # the first draft's index in seq
        if self.seq[pos - 1] != anchor:
            raise RuntimeError(f"replay lost track: anchor {anchor} != continuation token {self.seq[pos - 1]}")
        n = 0
        while n < self.block_size - 1 and self.rng.random() < self.alpha:
            n += 1
        self.lengths.append(n)
        true = self.seq[pos:pos + width - 1]
        true += [0] * (width - 1 - len(true))  # past the precomputed end: never verified
        k = min(n, width - 1)
        return true[:k] + [(t + 1) % self.vocab for t in true[k:]]  # each one differs from the target's token


class ReplayDrafter:
    """A real drafter whose proposal is replaced by the target's own continuation
    for a sampled accept length, then a wrong token (Replay). The real forward
    stays in the graph (the drafts depend on its output), so the cycle pays its
    cost. `emitted`: the caller's count of the stream's tokens so far."""

    def __init__(self, inner, alpha: float, vocab: int):
        self.inner, self.alpha, self.vocab = inner, alpha, vocab
        self.config, self.block_size, self.version = inner.config, inner.block_size, inner.version
        self.emitted, self.stream = 0, None
        self.lengths = []

    def make_cache(self, window=None, sink=0):
        return self.inner.make_cache(window, sink)

    def propose_batch(self, target, anchors, feats, caches, width, temperatures, keys):
        return propose_rows(self, target, anchors, feats, caches, width, temperatures, keys)

    def begin(self, prompt: list, continuation: list, seed: int) -> None:
        self.stream = Replay(prompt, continuation, self.alpha, self.block_size, self.vocab, seed, self.lengths)
        self.emitted = 0

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        import mlx.core as mx

        prop = self.inner.propose(target, anchor, new_feats, cache, width, temperature, key)
        drafts = self.stream.drafts(anchor, self.emitted, width)
        tokens = mx.array(drafts, mx.int32) + 0 * prop.tokens.astype(mx.int32)  # keeps the real forward
        return type(prop)(tokens, None, prop.conf)


def word_tokenizer(vocab: int):
    """A word-level tokenizer with `vocab` ids and no EOS: generations run to max_tokens."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tk))


def build_target(name: str, dtype: str, seed: int = 0):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    cfg, bits, _ = TARGETS[name]
    cfg = dict(cfg)
    if cfg["model_type"] == "qwen3_5_text":
        cfg = {"model_type": "qwen3_5", "text_config": cfg}
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(getattr(mx, dtype))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def build_drafter(model, layers: int, dtype: str, seed: int = 1):
    """A DFlash 2 drafter of the published shape for this target: the target's
    hidden size, its MLP width, 5 layers, 5 taps, block 16."""
    import mlx.core as mx

    from mlx_dflash.drafting.drafter import Drafter
    from mlx_dflash.drafting.drafter_config import DrafterConfig, default_target_layer_ids
    from mlx_dflash.target.adapter import Target

    t = Target(model)
    args = getattr(model, "args", None)
    a = getattr(args, "text_config", None) or vars(args)
    a = a if isinstance(a, dict) else vars(a)
    L = t.num_layers
    cfg = DrafterConfig(hidden_size=t.hidden_size, intermediate_size=a["intermediate_size"], num_hidden_layers=layers,
                        num_attention_heads=a["num_attention_heads"], num_key_value_heads=a["num_key_value_heads"],
                        head_dim=a.get("head_dim") or t.hidden_size // a["num_attention_heads"],
                        vocab_size=t.vocab_size, mask_token_id=t.vocab_size - 1,
                        target_layer_ids=default_target_layer_ids(L, min(5, L)), block_size=16, num_target_layers=L,
                        rope_theta=1e6, version=2, selector_rank=256, conv_group_size=16)
    mx.random.seed(seed)
    d = Drafter(cfg)
    d.set_dtype(getattr(mx, dtype))
    mx.eval(d.parameters())
    return d


class CostSampler:
    """c(w) and d(w) at the widths used. Each sample times a 1-token verify right
    before each w-token verify and each w-position draft, so a ratio never spans
    more than two forwards of drift; samples are taken before the runs and after
    every prompt, and the median over all of them is kept (a shared machine's
    load comes and goes over minutes). Interpolated to every width up to the
    widest: the loop shortens the last cycle to the tokens left."""

    def __init__(self, model, drafter, widths, context: int = 96, cache=None, feats=None, layout=(None, 0)):
        """`cache` and `feats` (the long-context bench): a target cache already
        holding `context` tokens and their features, for a drafter context of
        `layout` (window, sink); else `context` tokens are prefilled here."""
        import mlx.core as mx

        from mlx_dflash.target.adapter import Target

        self.mx, self.t, self.drafter = mx, Target(model), drafter
        self.capture = list(drafter.config.target_layer_ids)
        self.cache = cache if cache is not None else self.t.make_cache()
        self.dcache = drafter.make_cache(*layout)
        self.ids = (mx.arange(96 if cache is not None else context) * 7919 + 11) % self.t.vocab_size
        if cache is None:
            _, feats = self.t(self.ids[None], self.cache, self.capture)
        mx.eval(drafter.propose(self.t, 1, feats, self.dcache, 2).tokens)
        self.layout, self.rows = layout, feats[:, -256:]  # (the rows a catch-up takes in: Costs.u)
        self.restore = self.t.checkpoint(self.cache)
        self.ws, self.context = sorted({1, *widths}), context
        self.t1, self.c, self.d, self.u = [], {w: [] for w in self.ws}, {w: [] for w in self.ws if w > 1}, []
        for w in self.ws:  # warm-up: first calls at a new shape are slow
            self._verify(w), self._draft(w) if w > 1 else None

    def _verify(self, w):
        mx = self.mx
        run = self.t if w == 1 else self.t.verify_forward  # (the product's verify: its attention form)
        t0 = time.perf_counter()
        logits, f = run(self.ids[-w:][None], self.cache, self.capture)
        mx.eval(mx.argmax(logits[0], axis=-1), f)
        dt = time.perf_counter() - t0
        self.restore()
        return dt

    def _draft(self, w, cache=None):
        t0 = time.perf_counter()
        self.mx.eval(self.drafter.propose(self.t, 1, None, self.dcache if cache is None else cache, w).tokens)
        return time.perf_counter() - t0

    def _catch_up(self):
        """Per context row, what a draft pays beyond d(2) to take rows in first
        (the product's Costs.u), on a drafter context of its own."""
        mx, n = self.mx, self.rows.shape[1]
        cache = self.drafter.make_cache(*self.layout)
        mx.eval(self.drafter.propose(self.t, 1, self.rows, cache, 2).tokens)
        base = self._draft(2, cache)
        t0 = time.perf_counter()
        mx.eval(self.drafter.propose(self.t, 1, self.rows, cache, 2).tokens)
        return max(0.0, time.perf_counter() - t0 - base) / n

    def sample(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            self.u.append(self._catch_up() / self._verify(1))
            for w in self.ws[1:]:
                t1 = self._verify(1)
                self.t1.append(t1)
                self.c[w].append(self._verify(w) / t1)
                t1 = self._verify(1)
                self.d[w].append(self._draft(w) / t1)

    def costs(self):
        from mlx_dflash.policy.costs import Costs, interpolate, median

        c = {1: 1.0, **{w: median(v) for w, v in self.c.items() if v}}
        d = {1: 0.0, **{w: median(v) for w, v in self.d.items()}}
        full = range(1, max(self.ws) + 1)
        return Costs(median(self.t1), {w: interpolate(c, w) for w in full}, {w: interpolate(d, w) for w in full},
                     self.context, time.time(), u=median(self.u) if self.u else 0.0)


def bench_target(name, args, log) -> dict:

    widths = sorted({int(x) for x in args.realistic_widths.split(",") if x.strip()})
    t0 = time.time()
    log(f"{name}: building the target ({TARGETS[name][2]}, {args.dtype}) and its drafter...")
    model = build_target(name, args.dtype)
    inner = build_drafter(model, args.draft_layers, args.dtype)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    bits = TARGETS[name][1]  # quantized weights are packed 32 // bits to a uint32; scales are not parameters
    n_params = sum(v.size * (32 // bits if bits and v.dtype == mx.uint32 else 1)
                   for k, v in tree_flatten(model.parameters()) if not (bits and k.endswith((".scales", ".biases"))))
    d_params = sum(v.size for _, v in tree_flatten(inner.parameters()))
    vocab = inner.config.vocab_size
    tok = word_tokenizer(vocab)
    rng = random.Random(1234)
    prompts = [[rng.randrange(4, vocab - 1) for _ in range(64)] for _ in range(args.num_prompts)]
    alpha = alpha_for(args.tau, inner.block_size)
    replay = ReplayDrafter(inner, alpha, vocab)
    price_as(model, replay, inner)
    log(f"{name}: timing the 1-token step at the measured kernel threads, 1 and every core...")
    step_threads = fastest_plain(model)  # every method runs at the plain step's fastest threads
    log(f"{name}: the target's greedy continuations (plain mlx-lm, {args.max_tokens} tokens)...")
    conts = [run_mlx_lm(model, tok, p, args.max_tokens).tokens for p in prompts]
    log(f"{name}: measuring c(w), d(w) at widths 1, {', '.join(map(str, widths))} (again after every prompt)...")
    sampler = CostSampler(model, inner, widths)
    sampler.sample(2)
    costs = sampler.costs()  # per-cycle prices for the runs; the final figures use every sample
    # the guard's lookup drafts stay out: they would be judged on a random-weight
    # target's text, not on the replayed acceptance this bench is about
    methods = [Method("mlx-lm", "mlx-lm"), Method("default (dflash2, guard, no lookup)", "default", 5)]
    methods += [Method(f"dflash2-w{w}", "dflash2", w) for w in widths]

    def go(m, i, max_tokens):
        if m.kind == "mlx-lm":
            return run_mlx_lm(model, tok, prompts[i], max_tokens)
        # every method sees the same accept-length draws (common random numbers: a fair comparison)
        replay.begin(prompts[i], conts[i], seed=1000 * i)
        width = None if m.kind == "default" else m.width
        guard = True if m.kind == "default" else False
        return run_ours(model, tok, prompts[i], replay, max_tokens, width, "dflash", costs, guard,
                        on_token=lambda n: setattr(replay, "emitted", n), lookup=False)

    for m in methods:  # warm-up at every shape
        go(m, 0, 8)
    for i in range(len(prompts)):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            m.runs.append(go(m, i, args.max_tokens))
        sampler.sample(1)
        log(f"{name}: prompt {i + 1}/{len(prompts)} done")
    costs = sampler.costs()
    costs_all = {"dflash2": costs, "plain_t1": costs.t1}
    for m in methods[1:]:  # the cost model's time of the varying-width runs, at the final prices
        for r in m.runs:
            r.cost_units = sum(costs.c[w] + (costs.d[w] if src == "dflash" else 0.0) for w, src in r.cycle_log)
    base = [r.tokens for r in methods[0].runs]
    rows = []
    for m in methods:
        rows.append(summarize(m, rows[0] if rows else None, costs_all, base))
    mean_len = sum(replay.lengths) / len(replay.lengths) if replay.lengths else None
    return {"target": name, "label": TARGETS[name][2], "dtype": args.dtype, "bits": TARGETS[name][1],
            "params": n_params, "drafter_params": d_params, "drafter_layers": args.draft_layers,
            "alpha": alpha, "replayed_mean_accept_len": mean_len, "costs": costs.to_json(),
            "cost_samples": len(sampler.t1), "step_threads": step_threads,
            "seconds": round(time.time() - t0, 1), "methods": rows}


def goals(targets: list) -> list:
    out = []
    for t in targets:
        for r in t["methods"]:
            if r["kind"] == "dflash2" and r["width"] in WIDTHS and r["efficiency"] is not None:
                out.append({"target": t["target"], "method": r["method"], "efficiency": r["efficiency"],
                            "met": r["efficiency"] >= 0.9})
    return out


def markdown(res: dict) -> str:

    meta = res["meta"]
    lines = ["# mlx-dflash bench --realistic", "",
             f"{meta['num_prompts']} prompts x {meta['max_tokens']} tokens (64-token random prompts), greedy, batch 1; "
             + machine_line(meta), "",
             "```", meta["command"] or "", "```", "", meta["note"], "", meta["shared_machine"], ""]
    for t in res["targets"]:
        lines += [f"## {t['label']} ({t['target']}, {t['dtype']}"
                  + (f", {t['bits']}-bit" if t["bits"] else "") + f"): {t['params'] / 1e6:.0f}M parameters", "",
                  f"Drafter: DFlash 2, {t['drafter_layers']} layers, {t['drafter_params'] / 1e6:.0f}M parameters "
                  f"(+ the target's embedding and head); replayed alpha {t['alpha']:.3f} (mean accept length drawn "
                  f"{fmt_num(t['replayed_mean_accept_len'])} of 15); 1-token step {1e3 * t['costs']['t1']:.1f} ms; "
                  f"{t['seconds']:.0f} s." + (f" {threads_text(t['step_threads'])}." if t.get("step_threads") else ""), "",
                  "| method | tau | tok/s | x mlx-lm | c | d | limit | efficiency | lossless |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in t["methods"]:
            ok = "-" if r.get("mismatches") is None else ("yes" if r["mismatches"] == 0 else f"{r['mismatches']} differ")
            lines.append(f"| {r['method']} | {fmt_num(r['tau'])} | {fmt_num(r['tok_s'], '{:.2f}')} | {fmt_num(r['ratio'])}x "
                         f"| {fmt_num(r.get('c'))} | {fmt_num(r.get('d'))} | {fmt_num(r['limit'])} | {fmt_num(r['efficiency'], '{:.0%}')} "
                         f"| {ok} |")
        lines.append("")
    for n, msg in (res.get("failed") or {}).items():
        lines += [f"## {n}: failed", "", msg, ""]
    lines += ["Goal: efficiency >= 90% at widths 5, 8 and 16:", ""]
    for g in res["goals"]:
        lines.append(f"- {g['target']} {g['method']}: {g['efficiency']:.0%} ({'met' if g['met'] else 'NOT met'})")
    return "\n".join(lines) + "\n"


def run(args, log) -> int:
    names = [x.strip() for x in (args.targets or DEFAULT_TARGETS).split(",") if x.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise UserError(f"unknown realistic target {bad[0]!r}; valid: {', '.join(TARGETS)}")
    if args.num_prompts < 1 or args.max_tokens < 2:
        raise UserError("--num-prompts must be >= 1 and --max-tokens >= 2")
    if args.quick:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 1), min(args.max_tokens, 32)
    t_start = time.time()
    res = {"meta": {"command": "mlx-dflash bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                    if len(sys.argv) > 1 and sys.argv[1] == "bench" else None,
                    "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                    "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "tau": args.tau,
                    "machine": machine_info(),
                    "note": "Random weights of published shapes; the drafter's forward is real, its accuracy is "
                            "replayed (geometric acceptance with the published mean tau at block 16) against the "
                            "target's own greedy continuation. On this CPU, sizes were chosen to finish in minutes: "
                            "a 0.6B-scale float32 step is ~0.1-0.3 s; 4-bit (mlx-cpu's quantized matmul is "
                            "compute-bound, c(w) ~ w) and 1.7B targets are opt-in via --targets.",
                    "shared_machine": "The machine was shared with other jobs while this ran: compare the ratios "
                                      "(side by side, prompt by prompt), not the absolute tok/s."},
           "targets": []}
    for n in names:
        try:
            res["targets"].append(bench_target(n, args, log))
        except Exception as e:  # one target's failure is reported, the others still run
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"{n}: failed: {msg}")
            res.setdefault("failed", {})[n] = msg
    res["goals"] = goals(res["targets"])
    res["meta"]["seconds"] = round(time.time() - t_start, 1)
    out = Path(args.out or f"bench-realistic-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    if args.json:
        print(json.dumps(res))
    else:
        sys.stdout.write(markdown(res))
    log(f"wrote {out / 'results.json'}, results.md")
    return 0
