"""One benchmark run: one method (mlx-lm, mlx-lm speculative, or one of ours)
on one prompt, timed, with what the loop reported (bench.py and
bench_realistic.py both run them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from app.bench.report import COSTS_OF
from mlx_dflash import stream_generate
from mlx_dflash.engine.calibrate import DEFAULT
from mlx_dflash.engine.cost_source import CostSource
from mlx_dflash.platform import fastblas


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
    t: dict = field(default_factory=dict)  # draft / verify / book seconds (ours)
    cost_units: float = 0.0  # sum over cycles of c(w) + d(w): the cost model's time
    adaptive: Optional[dict] = None
    lookup_cycles: int = 0
    policy: str = ""
    cycle_log: list = field(default_factory=list)  # (width, source) per cycle, to re-price the run

    @property
    def gen_tokens(self) -> int:  # tokens after the first
        return max(0, len(self.tokens) - 1)


def fastest_plain(model, context: int = 64) -> dict:
    """Sets the few-row kernel's threads to the fastest for this model's 1-token
    step (the measured table, 1 thread or every core: fastblas.fastest_threads),
    so that the plain baseline, and every method compared with it, runs at its
    fastest configuration. Returns the step times by configuration ({} where
    there is nothing to choose)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % 1000, cache=cache))

    def step():
        mx.eval(model(mx.array([[1]]), cache=cache))
        trim_prompt_cache(cache, 1)

    return fastblas.fastest_threads(step, apply=True)


def run_mlx_lm(model, tok, prompt, max_tokens, draft=None, k=None, prompt_cache=None) -> Run:
    """mlx-lm's stream_generate (`prompt_cache`: mlx-lm's, holding the prompt's start)."""
    mx.reset_peak_memory()
    kw = dict(draft_model=draft, num_draft_tokens=k) if draft is not None else {}
    if prompt_cache is not None:
        kw["prompt_cache"] = prompt_cache
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


def run_ours(model, tok, prompt, drafter, max_tokens, width, mode, costs, guard=None, on_token=None,
             lookup=True, prompt_cache=None) -> Run:
    """mlx_dflash.stream_generate, the product's own loop; `costs` prices each cycle
    (c(w) + d(w), d only for drafter drafts) for the cost-model limit. `on_token(n)`
    is told the count of tokens received so far (the realistic bench's replay);
    `prompt_cache`: a PromptCache holding the prompt's start."""
    mx.reset_peak_memory()
    eos = set(tok.eos_token_ids)
    toks, seen, units, r, log = [], None, 0.0, None, []
    t0 = time.perf_counter()
    first = None
    for r in stream_generate(model, tok, prompt, drafter, max_tokens=max_tokens, block_size=width,
                             verify_mode=mode, guard=guard, lookup=lookup, prompt_cache=prompt_cache):
        if first is None:
            first = time.perf_counter()
        if not (r.finish_reason == "stop" and r.token in eos):
            toks.append(r.token)
        if on_token is not None:
            on_token(len(toks))
        c = r.cycle
        if c is not None and c is not seen:  # each cycle once: its cost in 1-token steps
            seen = c
            units += costs.c[c.width] + (costs.d[c.width] if c.source == "dflash" else 0.0)
            log.append((c.width, c.source))
    s = r.stats
    run = Run(toks, s.prompt_tokens, first - t0, s.prompt_time, s.generation_time, s.peak_memory,
              s.cycles, s.cycle_tokens, s.drafted, s.accepted, s.plain_cycles,
              {"draft": s.t_draft, "verify": s.t_verify, "book": s.t_book}, units,
              s.adaptive, s.lookup_cycles, s.policy, log)
    return run


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
        k = self.kind
        d = ctx["dflash1"] if k == "dflash1" else None if k == "lookup" else ctx["dflash2"]
        costs = ctx["costs"][COSTS_OF[k]]
        mode = {"adaptive": "adaptive", "lookup": "lookup", "lookup-dflash": "lookup"}.get(k, "dflash")
        guard = {"dflash1": False, "dflash2": False, "default": True}.get(k)  # fixed widths are exactly that
        width = None if k == "default" else self.width
        return run_ours(ctx["model"], ctx["tok"], prompt, d, max_tokens, width, mode, costs, guard)


def price_as(model, wrapper, inner) -> None:
    """The guard prices a drafter that wraps another (the realistic benches'
    replayed acceptance: its proposals replaced, the real forward still paid)
    with the inner drafter's measured costs: what each of its cycles really costs."""
    base = CostSource(model, inner, DEFAULT).cost_model().curve(None)
    DEFAULT.book.keep(model, wrapper, base, save=False)
