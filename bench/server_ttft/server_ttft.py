"""Time to first token of a follow-up chat request through `mlx-dflash serve`,
with and without prefix reuse.

A chat client sends the whole conversation again each turn. With reuse, the
server's prompt cache already holds the previous turn, so only the new part is
prefilled; without, the same requests go to a second server whose prompt cache
is off (`prompt_cache_mb` 0; the store keeps several conversations, so an
unrelated request in between no longer evicts one).

    PYTHONPATH=. python bench/server_ttft/server_ttft.py [--model embedded/target] [--model-dir DIR]
        [--history-tokens 1500] [--repeats 5] [--max-tokens 16]

--model-dir adds a folder of models (e.g. one from make_test_pair.py) to a
fresh settings home; the user's own settings are never touched. Prints a
markdown table: client-side TTFT (request sent -> first streamed token), the
server's own ttft_ms / prompt_ms, and how many prompt tokens were reused.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the model drafts a block of tokens and the target verifies them all in one pass so that "
         "every accepted token saves a full forward step of the large model ").split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(n_words: int, shift: int) -> str:
    return " ".join(WORDS[(i * 7 + shift) % len(WORDS)] for i in range(n_words))


def _stream(url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat request: client TTFT, the text, and the server's report."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, final = None, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices"):
                c = d["choices"][0]["delta"].get("content")
                if c is not None and "role" not in d["choices"][0]["delta"]:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c)
            elif "usage" in d:
                final = d
    return {"ttft_ms": ttft * 1000, "text": "".join(text), "usage": final["usage"], "timings": final["timings"],
            "dflash": final["dflash"]}


def serve(model: str, settings: dict) -> tuple:
    """`mlx-dflash serve --model MODEL` in a subprocess with a fresh settings home
    holding `settings` (the user's own are never touched): (process, url, home)."""
    home = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-"))
    (home / "settings.json").write_text(json.dumps({"version": 1, **settings}))
    port = _port()
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "MLX_DFLASH_HOME": str(home)}, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}", home


def wait_loaded(proc, url: str, home: Path) -> str:
    """Wait until the server has loaded its model; the model's id."""
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited: {(home / 'server.log').read_text().strip()}")
        try:
            h = httpx.get(url + "/metrics", timeout=2).json()  # /health says only "ok"
            if h["loaded"] is not None:
                return h["loaded"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def report(model: str, rows: dict, what: str, repeats: int, note: str = "", column: str = "",
           reused: str = "reused tokens") -> None:
    """The markdown table of `rows` ({name: [_stream results]}), medians, under a line
    saying how the server decoded; `what`: the timed request, `column`: its header."""
    med = statistics.median
    r0 = next(iter(rows.values()))[0]
    f = r0["dflash"]
    print(f"model: {model}; decoding: {f['mode']}{' (' + f['fallback'] + ')' if f['fallback'] else ''}, "
          f"verify width {f['max_width']}; {what} prompt {r0['usage']['prompt_tokens']} tokens; "
          f"{repeats} repeats, medians{note}\n")
    print(f"| {column or what + ' request'} | client TTFT (ms) | server ttft_ms | prompt_ms | prefilled tokens | {reused} |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {med(r['ttft_ms'] for r in rs):.1f} | {med(r['dflash']['ttft_ms'] for r in rs):.1f} | "
              f"{med(r['timings']['prompt_ms'] for r in rs):.1f} | {med(r['timings']['prompt_n'] for r in rs):.0f} | "
              f"{med(r['timings']['cache_n'] for r in rs):.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded/target", help="model id (or model folder) to serve")
    ap.add_argument("--model-dir", default=None, help="a folder of models to add to a fresh settings home")
    ap.add_argument("--history-tokens", type=int, default=1500, help="approximate length of the conversation so far")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    g = {"model_dirs": [str(Path(args.model_dir).resolve())]} if args.model_dir else {}
    servers = [serve(args.model, {"global": g, "models": {}}),
               serve(args.model, {"global": {**g, "prompt_cache_mb": 0}, "models": {}})]
    try:
        (model, url), (_, url_off) = [(wait_loaded(p, u, h), u) for p, u, h in servers]
        n_words = max(1, args.history_tokens // 2)  # roughly two tokens per word in small vocabularies
        rows = {"reuse": [], "no reuse": []}
        for u in (url, url_off):
            _stream(u, model, [{"role": "user", "content": "warm up"}], 4)
        for i in range(args.repeats):
            history = [{"role": "user", "content": _text(n_words, i)}]
            first = _stream(url, model, history, args.max_tokens)
            follow = history + [{"role": "assistant", "content": first["text"]},
                                {"role": "user", "content": "Go on, briefly."}]
            rows["reuse"].append(_stream(url, model, follow, args.max_tokens))
            _stream(url_off, model, history, args.max_tokens)  # the same turns, on the server without a cache
            rows["no reuse"].append(_stream(url_off, model, follow, args.max_tokens))
            assert rows["reuse"][-1]["text"] == rows["no reuse"][-1]["text"], "prefix reuse changed the output"
    finally:
        for proc, _, _ in servers:
            proc.terminate()
            proc.wait(30)

    report(model, rows, "follow-up", args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
