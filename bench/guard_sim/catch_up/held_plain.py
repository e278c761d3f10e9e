"""Where plain decoding is best (a replayed drafter right about half the time:
tau 2.0 at block 16), answers of 48 tokens after a 1k-token prompt, one process:
mlx-lm's plain generate_step, verify mode off, and the default (the guard), in
turn for `rounds` rounds (each answer starts from a copy of the prefilled cache,
as the realistic bench's). Prints each method's median ms per token and, per
default answer, its DFlash cycles and decode time against verify mode off's.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \
        python bench/guard_sim/catch_up/held_plain.py qwen3-small 12
"""
from mlx_dflash.platform import fastblas  # noqa: F401  (before mlx: the BLAS shim binds)

import copy
import random
import statistics
import sys
import time

from app.bench.long import prefill
from app.bench.realistic import CostSampler, ReplayDrafter, alpha_for, build_drafter, build_target, word_tokenizer
from app.bench.runs import fastest_plain, run_mlx_lm, run_ours
from mlx_dflash import DecodeConfig
from mlx_dflash.engine.calibrate import DEFAULT
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.registry import guard_widths, priced_at

N, TOKENS = 1024, 48


def main(name: str, rounds: int) -> None:
    model = build_target(name, "float32")
    inner = build_drafter(model, 5, "float32")
    tok = word_tokenizer(inner.config.vocab_size)
    fastest_plain(model)
    vocab = inner.config.vocab_size
    rng = random.Random(N)
    prompt = [rng.randrange(4, vocab - 1) for _ in range(N)]
    replay = ReplayDrafter(inner, alpha_for(2.0, inner.block_size), vocab)
    pc, _, _ = prefill(model, tok, prompt, replay)
    base = run_mlx_lm(model, tok, prompt[-1:], TOKENS, prompt_cache=copy.deepcopy(pc.target))
    sampler = CostSampler(model, inner, [w for w in guard_widths(inner.block_size) if w > 1], N,
                          cache=copy.deepcopy(pc.target), feats=pc.pending, layout=DecodeConfig().drafter_layout)
    sampler.sample(2)
    costs = sampler.costs()
    curve = Costs(costs.t1, costs.c, costs.d, N, time.time(), base.gen_time / max(1, base.gen_tokens))
    if hasattr(costs, "u"):  # (the code before the catch-up was priced has no u)
        curve.u = costs.u
    ms = {"mlx-lm": [], "off": [], "default": []}
    for i in range(rounds):
        off = None
        for m in ms:
            if m == "mlx-lm":
                r = run_mlx_lm(model, tok, prompt[-1:], TOKENS, prompt_cache=copy.deepcopy(pc.target))
            else:
                replay.begin(prompt, base.tokens, seed=i)
                DEFAULT.book.keep(model, replay, curve, save=False)  # (the guard's curves at this length: these)
                if priced_at(N) is not None:
                    DEFAULT.book.keep(model, replay, curve, save=False, context=priced_at(N))
                r = run_ours(model, tok, prompt, replay, TOKENS, None, "off" if m == "off" else "dflash", costs,
                             m == "default", on_token=lambda k: setattr(replay, "emitted", k), lookup=False,
                             prompt_cache=copy.deepcopy(pc))
            ms[m].append(r.gen_time / r.gen_tokens * 1e3)
            if m == "off":
                off = r.gen_time
            if m == "default":
                print(f"answer {i}: {r.cycles - r.plain_cycles} DFlash cycles, decode {r.gen_time * 1e3:.0f} ms "
                      f"(off {off * 1e3:.0f} ms); {r.policy}")
    for m, v in ms.items():
        print(f"{m:8s} ms per token, median of {rounds}: {statistics.median(v):.2f}")
    print(f"default / off: {statistics.median(ms['default']) / statistics.median(ms['off']):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
