"""Per-cycle wall time of the default (guard) against fixed width 8 at one context, in the
realistic long-context bench's set-up (its targets, replayed drafter, guard seeded with the
sampled costs): whether the guarded path costs more per cycle where both draft at width 8.
Width None is the default. Columns: wW<source>:count x median ms of the cycles after the
first (the first carries the drafter's catch-up of the prompt's window).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/long_context/realistic/percycle/percycle.py hybrid-small 32768 4
"""

import copy
import random
import statistics
import sys
import time

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.bench.long import prefill, seed_guard, synthetic, tau_at
from app.bench.realistic import CostSampler, ReplayDrafter, alpha_for, build_drafter, build_target, word_tokenizer
from app.bench.runs import fastest_plain, run_mlx_lm
from mlx_dflash import DecodeConfig, stream_generate
from mlx_dflash.policy.registry import guard_widths


def main(name: str, n: int, rounds: int) -> None:
    model = build_target(name, "float32")
    inner = build_drafter(model, 5, "float32")
    fastest_plain(model)
    vocab = inner.config.vocab_size
    tok = word_tokenizer(vocab)
    rng = random.Random(n)
    prompt = [rng.randrange(4, vocab - 1) for _ in range(n)]
    replay = ReplayDrafter(inner, alpha_for(tau_at(6.5, 1.0, n), inner.block_size), vocab)
    pc = synthetic(model, tok, prompt, replay) if n >= 8192 else prefill(model, tok, prompt, replay)[0]
    base = run_mlx_lm(model, tok, prompt[-1:], 48, prompt_cache=copy.deepcopy(pc.target))
    sampled = sorted({5, 8, 16} | {w for w in guard_widths(inner.block_size) if w > 1})
    sampler = CostSampler(model, inner, sampled, n, cache=copy.deepcopy(pc.target), feats=pc.pending,
                          layout=DecodeConfig().drafter_layout)
    sampler.sample(2)
    costs = sampler.costs()

    def go(width, i):
        replay.begin(prompt, base.tokens, seed=1000 * i)
        seed_guard(model, replay, costs, n, base)
        cycles, seen, count = [], None, 0
        t0 = last = time.perf_counter()
        for r in stream_generate(model, tok, prompt, replay, max_tokens=48, block_size=width, verify_mode="dflash",
                                 guard=width is None, lookup=False, prompt_cache=copy.deepcopy(pc)):
            count += 1
            replay.emitted = count
            if r.cycle is not None and r.cycle is not seen:
                now = time.perf_counter()
                cycles.append((r.cycle.width, r.cycle.source, now - last))
                last, seen = now, r.cycle
        return time.perf_counter() - t0, cycles, r.stats

    print("t1 ms", costs.t1 * 1e3, "c8", costs.c[8], "d8", costs.d[8], "plain step ms",
          base.gen_time / base.gen_tokens * 1e3)
    go(None, 0), go(8, 0)
    for i in range(rounds):
        for w in ((None, 8) if i % 2 == 0 else (8, None)):
            total, cycles, st = go(w, i)
            by = {}
            for cw, src, dt in cycles[1:]:
                by.setdefault((cw, src), []).append(dt * 1e3)
            print(f"round {i} width {w}: total {total * 1e3:.0f} ms, gen {st.generation_time * 1e3:.0f} ms, "
                  f"cycles {len(cycles)}, first {cycles[0][0]} {cycles[0][2] * 1e3:.0f} ms;",
                  " ".join(f"w{k[0]}{k[1][0]}:{len(v)}x{statistics.median(v):.1f}" for k, v in sorted(by.items())))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
