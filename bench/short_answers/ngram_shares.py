"""How often prompt-lookup drafts are right, by the length of the n-gram match
that proposed them: the embedded target's plain (greedy) answer to each
prompt, replayed through an NgramIndex of the prompt and the answer so far
(min_n 1), each proposal (up to 7 drafts) scored by the drafts a verify would
accept. Per prompt and over all: proposals, drafts accepted per proposal, and
their share of the drafts proposed; then the same scored inside the prompt
itself (its own text replayed through an index that starts empty), which an
index could measure before the answer begins. The prompts: short_answers/bench.py's six,
long_context_embedded's source and docs prompts at 4k, and three chat prompts.

    MLX_DFLASH_DTYPE=float32 PYTHONPATH=. python bench/short_answers/ngram_shares.py
"""

import importlib.util
from pathlib import Path

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from mlx_dflash.drafting.lookup import NgramIndex
from mlx_dflash.engine.generate import generate
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store

DRAFTS, ANSWER = 7, 128
CHAT = ["Janet has 3 apples and buys 5 more. How many apples does she have?", "Explain how a hash map works.",
        "Write a poem about the sea at night."]


def module(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).parent.name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def shares(index: NgramIndex, answer: list, into: dict) -> None:
    for i, token in enumerate(answer):
        n, pos = index.match()
        if n:
            proposed = index.tokens[pos:pos + DRAFTS]
            ok = 0
            for x, y in zip(proposed, answer[i:]):
                if x != y:
                    break
                ok += 1
            row = into.setdefault(n, [0, 0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + ok, row[2] + len(proposed)
        index.append(token)


def line(stats: dict) -> str:
    return "  ".join(f"n={n}: {c} proposals, {a / c:.2f} accepted each, share {a / max(1, k):.2f}"
                     for n, (c, a, k) in sorted(stats.items()))


def main():
    lm = load_model(None, settings_store())
    model, tok = lm.model, lm.tokenizer
    cases = {k: tok.encode(v) for k, v in module("bench/short_answers/bench.py").prompts().items()}
    long = module("bench/long_context_embedded/bench.py")
    cases.update({f"{t}4k": long.prompt_of(tok, 4096, t) for t in ("source", "docs")})
    cases.update({f"chat: {q[:16]}": tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                  for q in CHAT})
    total = {}
    for name, ids in cases.items():
        answer = generate(model, tok, ids, None, max_tokens=ANSWER, verify_mode="off").token_ids
        mine, inside = {}, {}
        shares(NgramIndex(ids, min_n=1), answer, mine)
        shares(NgramIndex([], min_n=1), list(ids), inside)
        for n, row in mine.items():
            total[n] = [a + b for a, b in zip(total.get(n, [0, 0, 0]), row)]
        print(f"{name:20s} {len(answer):3d} tokens  {line(mine)}", flush=True)
        print(f"{'  inside the prompt':20s} {len(ids):5d}  {line(inside)}", flush=True)
    print(f"{'all':20s}             {line(total)}")


if __name__ == "__main__":
    main()
