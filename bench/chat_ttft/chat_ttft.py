"""Time to first token of the 5th chat turn, with and without reusing the
caches of the previous turn (what `mlx-dflash chat` does: one PromptCache per
loaded model holds the target's KV cache and the drafter's context).

Each repeat replays turns 1..N-1 (greedy, so the same answers every time) with
one PromptCache, then times turn N twice: with that cache (only the new part is
prefilled) and with a fresh one (the whole conversation is read again). TTFT is
wall time from building the prompt (chat template + tokenize) to the first
token, as in the chat app.

    PYTHONPATH=. python bench/chat_ttft/chat_ttft.py [--model PATH_OR_ID] [--drafter PATH] [--turns 5]
        [--words 120] [--max-tokens 64] [--repeats 5] [--json]

With no --model, the embedded default pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)

from app.chat import build_prompt  # noqa: E402
from mlx_dflash import PromptCache, load, stream_generate  # noqa: E402

TOPICS = [
    "Explain how speculative decoding keeps the output of the large model unchanged",
    "Write a Python function that merges two sorted lists and explain its running time",
    "What is the difference between a process and a thread on macOS",
    "Summarise the rules of chess for a beginner in a few short paragraphs",
    "Give three ways to make a slow SQL query faster and say when each one helps",
    "How does a KV cache make autoregressive decoding cheaper",
    "Describe how to write a good unit test for a function that parses dates",
]
FILLER = ("please be concrete and use a short example where it helps and keep the answer focused on the "
          "question so that it is easy to follow for someone who has not seen this before").split()


def user_message(i: int, words: int) -> str:
    pad = " ".join(FILLER[(k + i) % len(FILLER)] for k in range(max(0, words - 12)))
    return f"{TOPICS[i % len(TOPICS)]}. {pad}."


def turn(model, tok, drafter, history, cache, max_tokens, first_only=False):
    """(ttft seconds, answer text, stats) of one turn."""
    t0 = time.perf_counter()
    prompt = build_prompt(tok, "", history)
    ttft, text, r = None, [], None
    gen = stream_generate(model, tok, prompt, drafter, max_tokens=max_tokens, prompt_cache=cache)
    try:
        for r in gen:
            if ttft is None:
                ttft = time.perf_counter() - t0
                if first_only:
                    break
            text.append(r.text)
    finally:
        gen.close()
    return ttft, "".join(text), r.stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=120, help="words per user message")
    ap.add_argument("--max-tokens", type=int, default=64, help="answer length of turns 1..N-1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    model, tok, drafter = load(a.model, a.drafter)
    warm, cold, info = [], [], {}
    for rep in range(a.repeats + 1):  # the first repeat warms up MLX and is not counted
        cache, history = PromptCache(), []
        for i in range(a.turns - 1):
            history.append({"role": "user", "content": user_message(i, a.words)})
            _, answer, _ = turn(model, tok, drafter, history, cache, a.max_tokens)
            history.append({"role": "assistant", "content": answer})
        history.append({"role": "user", "content": user_message(a.turns - 1, a.words)})
        order = [("warm", cache), ("cold", PromptCache())]
        if rep % 2:  # alternate which runs first
            order.reverse()
        for kind, c in order:
            ttft, _, st = turn(model, tok, drafter, history, c, a.max_tokens, first_only=True)
            if rep:
                (warm if kind == "warm" else cold).append(ttft)
            info[kind] = dict(prompt_tokens=st.prompt_tokens, reused_tokens=st.reused_tokens)
            print(f"repeat {rep}{' (warm-up)' if not rep else ''}: {kind} cache TTFT {ttft:.3f} s, "
                  f"{st.reused_tokens}/{st.prompt_tokens} prompt tokens reused", file=sys.stderr, flush=True)
    out = {
        "model": a.model or "embedded default pair",
        "drafter": a.drafter or ("embedded" if a.model is None and drafter is not None else None),
        "dflash": drafter is not None, "turn": a.turns, "repeats": a.repeats, "words": a.words,
        "max_tokens": a.max_tokens,
        "ttft_reuse_s": statistics.median(warm), "ttft_no_reuse_s": statistics.median(cold),
        "ttft_reuse_all": warm, "ttft_no_reuse_all": cold, **{f"{k}_{n}": v for k, d in info.items() for n, v in d.items()},
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"model: {out['model']}  drafter: {out['drafter']}  turn {a.turns}, {a.repeats} repeats, median")
    print("| caches | TTFT (s) | prompt tokens | reused | prefilled |")
    print("|---|---|---|---|---|")
    for kind, name in (("warm", "reused (PromptCache kept)"), ("cold", "not reused (fresh cache)")):
        d = info[kind]
        t = out["ttft_reuse_s" if kind == "warm" else "ttft_no_reuse_s"]
        print(f"| {name} | {t:.3f} | {d['prompt_tokens']} | {d['reused_tokens']} | {d['prompt_tokens'] - d['reused_tokens']} |")
    print(f"speed-up: {out['ttft_no_reuse_s'] / out['ttft_reuse_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
