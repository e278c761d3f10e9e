"""Time to first token of a SECOND conversation that shares the first one's
system prompt (an agent's long instructions), with the prompt cache across
requests (mlx_dflash.cache.prompt_store) and without it (prompt_cache_mb = 0).

Two real server processes run side by side in one run, same model; requests
alternate between them, one at a time. Per repeat: conversation 1 (system S +
question A), an unrelated request (another long system prompt), then
conversation 2 (system S + question B), streamed and timed. Both servers must
give conversation 2 the same text (the script asserts it).

    PYTHONPATH=. python bench/prompt_cache_ttft/prompt_cache.py [--model embedded/target] [--model-dir DIR]
        [--system-tokens 1000] [--repeats 5] [--max-tokens 16] [--block-size W]

--block-size sets the model's verify width in both servers' settings (a fixed
width: every cycle drafts; the default width runs the guard, whose plain steps
add no drafter context, which bounds what a later request can reuse).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.server_ttft.server_ttft import _stream, _text, report, serve, wait_loaded  # noqa: E402


def _serve(model: str, model_dir, budget_mb: int, block_size=None):
    g = {"prompt_cache_mb": budget_mb}
    if model_dir:
        g["model_dirs"] = [str(Path(model_dir).resolve())]
    models = {model: {"block_size": block_size}} if block_size else {}
    return serve(model, {"global": g, "models": models})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded/target", help="model id (or model folder) to serve")
    ap.add_argument("--model-dir", default=None, help="a folder of models to add to fresh settings homes")
    ap.add_argument("--system-tokens", type=int, default=1000, help="approximate length of the shared system prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None, help="verify width for both servers (default: the model's)")
    args = ap.parse_args(argv)

    servers = {"prompt cache": _serve(args.model, args.model_dir, 2048, args.block_size),
               "no cache (prompt_cache_mb 0)": _serve(args.model, args.model_dir, 0, args.block_size)}
    rows = {k: [] for k in servers}
    try:
        for s in servers.values():
            wait_loaded(*s)
        n_words = max(1, args.system_tokens // 2)  # roughly two tokens per word in small vocabularies
        for name, (_, url, _) in servers.items():
            _stream(url, args.model, [{"role": "user", "content": "warm up"}], 4)
        for i in range(args.repeats):
            system = {"role": "system", "content": _text(n_words, i)}
            other = {"role": "system", "content": _text(n_words, i + 100)}
            texts = []
            for name, (_, url, _) in servers.items():
                _stream(url, args.model, [system, {"role": "user", "content": f"Question {i}: what is a block?"}],
                        args.max_tokens)
                _stream(url, args.model, [other, {"role": "user", "content": "Unrelated."}], 4)
                r = _stream(url, args.model, [system, {"role": "user", "content": f"Task {i}: explain verify."}],
                            args.max_tokens)
                rows[name].append(r)
                texts.append(r["text"])
            assert len(set(texts)) == 1, "the prompt cache changed the output"
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(30)

    med = statistics.median
    report(args.model, rows, "second-conversation", args.repeats, "; the two servers ran side by side in one run",
           column="second conversation", reused="cached tokens")
    a, b = (med(r["ttft_ms"] for r in rs) for rs in rows.values())
    print(f"\nclient TTFT ratio (no cache / cache): {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
