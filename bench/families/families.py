"""Every supported mlx-lm family, exactly (issue 14): for each tiny random
family of tests/tiny_families.py, whether the adapter's logits are the
model's own, whether DFlash greedy equals mlx_lm.stream_generate, whether a
partial-prefix oracle reaches exactly the expected tau, and what rolling back
a verify costs as a share of that verify.

    PYTHONPATH=. python bench/families/families.py [--out bench/families.md] [--families a,b] [--rounds 15]
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from tests.drafters import OracleDrafter, PrefixOracle, reference_tokens  # noqa: E402
from tests.tiny_families import FAMILIES, build  # noqa: E402

from mlx_dflash import generate  # noqa: E402
from mlx_dflash.target.rollback import leaves  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402

QUANT = {"qwen3:q4": dict(bits=4, group_size=64), "qwen3_next:q4": dict(bits=4, group_size=32),
         "gpt_oss:q8": dict(bits=8, group_size=32), "lfm2:mixed": dict(bits="mixed", group_size=32),
         "granitemoehybrid:q8": dict(bits=8, group_size=64)}
WIDTHS = [1, 3, 5, 8, 16]
PROMPTS = ["def fibonacci(n):\n    if n < 2:", "Natalia sold clips to 48 of her friends in April",
           "import os\nimport sys\nimport json\n", "class Stack:\n    def push(self, x):",
           "Janet's ducks lay 16 eggs per day. She eats"]
MAX = 26


def logits_exact(model) -> bool:
    t = Target(model)
    rng = random.Random(1)
    ids = [rng.randrange(4, 512) for _ in range(40)]
    a, b = t.make_cache(), t.make_cache()
    for lo, hi in [(0, 14), (14, 15), (15, 20), (20, 21), (21, 29), (29, 40)]:
        x = mx.array(ids[lo:hi])[None]
        if not mx.array_equal(model(x, cache=a), t(x, b, [0])[0]).item():
            return False
    return True


def greedy(model, tok):
    ok = n = 0
    for i, p in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, p, MAX)
        for w in WIDTHS:
            o = OracleDrafter(len(tok.encode(p)), ref, 512, noise=0.3, seed=i * 31 + w, layer_ids=(0,))
            ok += generate(model, tok, p, o, max_tokens=MAX, block_size=w, guard=False).token_ids == ref
            n += 1
    return ok, n


def oracle_tau(model, tok):
    """(runs whose accepted count, tau and text are exactly as expected, runs, mean tau)."""
    ok = n = 0
    taus = []
    for i, p in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, p, MAX)
        for w in WIDTHS:
            o = PrefixOracle(len(tok.encode(p)), ref, 512, seed=100 * i + w)
            r = generate(model, tok, p, o, max_tokens=MAX, block_size=w, guard=False)
            emitted, acc, toks, cyc, log = 1, 0, 0, 0, list(o.log)
            while emitted < MAX:
                ww = min(w, MAX - emitted)
                a = log.pop(0)[1] if ww > 1 else 0
                e = min(a + 1, MAX - emitted)
                emitted, acc, toks, cyc = emitted + e, acc + a, toks + e, cyc + 1
            ok += (r.token_ids == ref and r.stats.accepted == acc and r.stats.tau == toks / cyc)
            n += 1
            taus.append(r.stats.tau)
    return ok, n, sum(taus) / len(taus)


def eval_cache(cache):
    arrs = []
    for c in cache:
        for x in leaves(c):
            if hasattr(x, "cache") and isinstance(x.cache, list):
                arrs += [a for a in x.cache if a is not None]
            elif getattr(x, "keys", None) is not None:
                arrs += [x.keys, x.values] if isinstance(x.keys, mx.array) else list(x.keys) + list(x.values)
    mx.eval(arrs)


def prefilled(model, context: int):
    """(Target, its cache after `context` tokens, evaluated)."""
    t = Target(model)
    cache = t.make_cache()
    t((mx.arange(context)[None] % 500) + 4, cache)
    eval_cache(cache)
    return t, cache


def timed_verify(t, block, cache) -> float:
    """Seconds of one verify forward of `block` over `cache`, evaluated (cache included)."""
    t0 = time.perf_counter()
    logits, f = t(block, cache, [0])
    mx.eval(logits, f)
    eval_cache(cache)
    return time.perf_counter() - t0


def rollback_cost(model, rounds: int, width: int = 8, keep: int = 4, context: int = 40):
    """Median (trim of width-keep rows, evaluated) / (the verify forward of
    width rows, evaluated), after `context` tokens (every window wrapped)."""
    t, cache = prefilled(model, context)
    block = mx.arange(100, 100 + width)[None]
    ratios, tv = [], []
    for r in range(rounds + 2):
        restore = t.checkpoint(cache)
        v = timed_verify(t, block, cache)
        t1 = time.perf_counter()
        t.trim(cache, width - keep)
        eval_cache(cache)
        t2 = time.perf_counter()
        restore()
        if r >= 2:  # warm-up
            ratios.append((t2 - t1) / v)
            tv.append(v)
    ratios.sort()
    tv.sort()
    return ratios[len(ratios) // 2], tv[len(tv) // 2]


H = 512
_MED = dict(hidden_size=H, intermediate_size=2 * H, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=8)
MEDIUM = {  # hidden 512, 8 layers: compute, not Python, dominates (closer to a real model's shares)
    "qwen3": dict(_MED),
    "gemma3_text": dict(_MED, query_pre_attn_scalar=64, sliding_window=64),
    "qwen3_next": dict(_MED, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                       full_attention_interval=4),
    "nemotron_h": dict(_MED, mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64,
                       hybrid_override_pattern=["M", "-", "M", "*", "M", "-", "M", "-"]),
    "falcon_h1": dict(_MED, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64,
                      mamba_chunk_size=128),
    "lfm2": dict(_MED, block_dim=H, block_ff_dim=2 * H,
                 layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"]),
}


NOTE = """
Reading: KV and sliding-window rollback is an offset or a slice (~0%). Recurrent rollback is a
selection from what the verify kept (rollback.py): a conv state is a slice of the conv's input
window, a gated-delta state the one mlx-lm's own step produced after the last kept row (kept per
row where mlx-lm runs its step-by-step ops, i.e. off Metal), a Mamba2 state mlx-lm's SSD state of
the verify's own scan inputs cut at that row (a few small ops per Mamba layer: what is left of the
share at this size). In the decode loop the selection stays lazy and is evaluated with the next
verify forward. bench/families/rollback.py measures the same at more shapes.
"""


def medium_rows(rounds: int):
    rows = []
    for fam, over in MEDIUM.items():
        model = build(fam, **over)
        cells = []
        for width, keep in [(8, 4), (16, 8), (16, 1)]:
            share, tv = rollback_cost(model, rounds, width, keep, context=256)
            cells.append(f"{100 * share:.0f}% (verify {tv * 1e3:.1f} ms)")
        row = f"| {fam} | {kinds(model)} | " + " | ".join(cells) + " |"
        print(row, flush=True)
        rows.append(row)
    return rows


def kinds(model) -> str:
    names = sorted({type(x).__name__ for c in Target(model).make_cache() for x in leaves(c)})
    return ", ".join(n.replace("KVCache", "KV") for n in names)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "families.md"))
    ap.add_argument("--families", default="")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-medium", action="store_true", help="skip the hidden-512 rollback table")
    a = ap.parse_args(argv)
    from make_test_pair import write_tokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    import mlx_lm

    fams = a.families.split(",") if a.families else list(FAMILIES) + list(QUANT)
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d), 512)
        tok = load_tokenizer(Path(d))
    rows = []
    for fam in fams:
        model = build(fam, **QUANT.get(fam, {}))
        le = logits_exact(model)
        g_ok, g_n = greedy(model, tok)
        o_ok, o_n, tau = oracle_tau(model, tok)
        share, tv = rollback_cost(model, a.rounds)
        row = (f"| {fam} | {kinds(model)} | {'yes' if le else 'NO'} | {g_ok}/{g_n} | {o_ok}/{o_n} (tau {tau:.2f}) "
               f"| {100 * share:.0f}% | {tv * 1e3:.1f} |")
        print(row, flush=True)
        rows.append(row)
    med = [] if a.no_medium else medium_rows(a.rounds)
    cmd = "MLX_DFLASH_BLAS_THREADS=1 PYTHONPATH=. .venv/bin/python bench/families/families.py" + (
        f" --families {a.families}" if a.families else "") + (f" --rounds {a.rounds}" if a.rounds != 15 else "")
    text = f"""# Every mlx-lm family, exactly (issue 14)

Command: `{cmd}`
(mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, {platform.machine()}, backend {mx.default_device()};
the machine's 2 cores were shared with other jobs: the times are indicative, the equalities are not.)

Tiny random-weight targets built from mlx-lm's own `ModelArgs` (tests/tiny_families.py: hidden 64,
4 layers, vocabulary 512, sliding windows of 6 tokens so every window wraps; quantized with `nn.quantize`:
`qwen3:q4` 4-bit group 64, `qwen3_next:q4` 4-bit group 32, `:q8` 8-bit, `lfm2:mixed` a mixed-precision
predicate: 8-bit embedding and head, 4-bit elsewhere, group 32). Per family:
- **logits exact**: the adapter's logits `==` `model(inputs, cache=cache)` (bitwise), prefill and decode
  steps of 1 and several tokens past the window;
- **greedy equal**: DFlash greedy token ids == `mlx_lm.stream_generate`, {len(PROMPTS)} prompts x widths
  {WIDTHS} (fixed: `guard=False`), a 30%-noisy oracle drafter (partial acceptance), {MAX} tokens;
- **oracle tau exact**: an oracle right for a random-length prefix of every block (accepts 0..w-1):
  accepted count, tau and tokens exactly as expected; mean tau over the runs;
- **rollback % of verify**: median time of dropping 4 of 8 verified rows (evaluated) / the time of that
  8-row verify forward (evaluated), 40 tokens of context. KV caches: an offset; sliding windows: a slice;
  recurrent state: a selection from what the verify kept (gated-delta: the state after the last kept row;
  Mamba2: the SSD state of the kept rows' scan inputs; conv: a slice of the input window).

| family | cache kinds | logits exact | greedy equal | oracle tau exact | rollback % of verify | verify ms |
|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
    if med:
        text += f"""
## Rollback cost at a larger size

Hidden 512, 8 layers (same layer mixes), 256 tokens of context (sliding windows of 64, wrapped),
float32, median of {a.rounds} rounds: dropping the rejected rows (evaluated) as a share of the verify
forward (evaluated). Recurrent states are selected from what the verify kept (no projection,
convolution or gated-delta scan is run again).

| family | cache kinds | 8 verified, 4 kept | 16 verified, 8 kept | 16 verified, 1 kept |
|---|---|---|---|---|
""" + "\n".join(med) + "\n" + NOTE
    Path(a.out).write_text(text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
