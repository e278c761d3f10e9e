"""`mlx-dflash bench`: the cost curves measured in the run, for the cost-model
limits (c(w) verify and d(w) draft costs in 1-token target steps)."""

from __future__ import annotations

import time

from app.bench.report import COSTS_OF


def measure(ctx, methods):
    """Verify / draft cost curves for the cost-model limits, measured now."""
    from mlx_dflash.engine.calibrate import measure_costs, remember

    out = {}
    w2 = max([m.width for m in methods if COSTS_OF.get(m.kind) == "dflash2"], default=0)
    if w2:
        out["dflash2"] = measure_costs(ctx["model"], ctx["dflash2"], max(2, w2))
        remember(ctx["model"], ctx["dflash2"], out["dflash2"])  # adaptive decides on this run's curve
    w1 = max([m.width for m in methods if m.kind == "dflash1"], default=0)
    if w1:
        out["dflash1"] = measure_costs(ctx["model"], ctx["dflash1"], max(2, w1))
    if "draft" in ctx:  # the classic draft model's 1-token step, in target steps
        out["draft_ar"] = _step_ratio(ctx["draft"], ctx["model"])
    # without feature capture: mlx-lm-spec's verify widths k+1 and lookup's (its drafts cost nothing)
    wp = max([m.width + 1 for m in methods if m.kind == "mlx-lm-spec"]
             + [m.width for m in methods if m.kind == "lookup"] + [1])
    plain = measure_costs(ctx["model"], None, wp)
    out["plain_t1"] = plain.t1
    out["plain"] = out["lookup"] = plain
    ctx["costs"] = out
    return out


def _step_ratio(a, b, rounds: int = 15) -> float:
    """t(1-token step of a) / t(1-token step of b), timed alternately so that
    the machine's load cancels in the ratio (median over rounds)."""
    import mlx.core as mx

    from mlx_dflash.target.adapter import Target

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
