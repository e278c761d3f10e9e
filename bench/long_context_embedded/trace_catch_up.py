"""The guard's own timing of each cycle against its price, for one default answer at 1k (the
embedded pair, the source prompt): how the outlier excess of the first DFlash cycle after a
lookup cycle was found (narrowed_curve/trace_catch_up.log).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/long_context_embedded/trace_catch_up.py
"""
import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from bench import prompt_of
from mlx_dflash.engine.generate import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store
from mlx_dflash.policy.guard import Guard
prev = {"src": "start"}
orig_time = Guard._time
def t(self, rows, results, drafted):
    r = results[0]
    src = r.source or "plain"
    if r.width > 1:
        price = self.priced[0 if drafted else 1].get(r.width)
        ps = self.plain_s.get(1)
        unit = sorted(ps)[len(ps)//2] if ps else None
        print(f"{src} w{r.width} after {prev['src']}: {r.t_step*1e3:.1f} ms, price {price:.2f} plain steps"
              + (f", {r.t_step/unit - price:+.2f} beyond (unit {unit*1e3:.1f} ms)" if unit else ""))
    prev["src"] = src
    return orig_time(self, rows, results, drafted)
Guard._time = t
lm = load_model(None, settings_store())
ids = prompt_of(lm.tokenizer, 1024)
g = generate(lm.model, lm.tokenizer, ids, lm.drafter, max_tokens=64)
print(g.stats.policy)
