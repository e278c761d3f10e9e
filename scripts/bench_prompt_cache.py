"""Time to first token of a SECOND conversation that shares the first one's
system prompt (an agent's long instructions), with the prompt cache across
requests (mlx_dflash.prompt_store) and without it (prompt_cache_mb = 0).

Two real server processes run side by side in one run, same model; requests
alternate between them, one at a time. Per repeat: conversation 1 (system S +
question A), an unrelated request (another long system prompt), then
conversation 2 (system S + question B), streamed and timed. Both servers must
give conversation 2 the same text (the script asserts it).

    python scripts/bench_prompt_cache.py [--model embedded/target] [--model-dir DIR]
        [--system-tokens 1000] [--repeats 5] [--max-tokens 16] [--block-size W]

--block-size sets the model's verify width in both servers' settings (a fixed
width: every cycle drafts; the default width runs the guard, whose plain steps
add no drafter context, which bounds what a later request can reuse).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server_ttft import ROOT, _port, _stream, _text  # noqa: E402


def _serve(model: str, model_dir, budget_mb: int, block_size=None):
    home = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-"))
    g = {"prompt_cache_mb": budget_mb}
    if model_dir:
        g["model_dirs"] = [str(Path(model_dir).resolve())]
    models = {model: {"block_size": block_size}} if block_size else {}
    (home / "settings.json").write_text(json.dumps({"version": 1, "global": g, "models": models}))
    port = _port()
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "MLX_DFLASH_HOME": str(home)}, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}", home


def _ready(proc, url, home) -> None:
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited: {(home / 'server.log').read_text().strip()}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


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
            _ready(*s)
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
    first = next(iter(rows.values()))[0]
    f = first["dflash"]
    print(f"model: {args.model}; decoding: {f['mode']}{' (' + f['fallback'] + ')' if f['fallback'] else ''}, "
          f"verify width {f['verify_width']}; second-conversation prompt {first['usage']['prompt_tokens']} tokens; "
          f"{args.repeats} repeats, medians; the two servers ran side by side in one run\n")
    print("| second conversation | client TTFT (ms) | server ttft_ms | prompt_ms | prefilled tokens | cached tokens |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {med(r['ttft_ms'] for r in rs):.1f} | {med(r['dflash']['ttft_ms'] for r in rs):.1f} | "
              f"{med(r['timings']['prompt_ms'] for r in rs):.1f} | {med(r['timings']['prompt_n'] for r in rs):.0f} | "
              f"{med(r['usage']['prompt_tokens_details']['cached_tokens'] for r in rs):.0f} |")
    a, b = (med(r["ttft_ms"] for r in rs) for rs in rows.values())
    print(f"\nclient TTFT ratio (no cache / cache): {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
