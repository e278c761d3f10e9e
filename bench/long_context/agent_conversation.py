"""An agent-style conversation against `mlx-dflash serve` (issue 23): a long
system prompt (instructions and tool schemas, as coding agents send), then
turns that each hand the model a file as a tool result and ask about it, so the
prompt grows turn by turn to --target-tokens. Each turn is one streamed
/v1/chat/completions request, as an agent sends it (the whole conversation
again: the server's prompt store reuses what it has); per turn: prompt tokens,
cached tokens, time to first token (client side and the server's), the prefill
progress comments the stream carried, and the `dflash` report (tau, mode,
policy, fallback) from the last chunk.

    PYTHONPATH=. python bench/long_context/agent_conversation.py --model PATH_OR_ID [--home DIR]   # starts `serve`
    PYTHONPATH=. python bench/long_context/agent_conversation.py --url http://127.0.0.1:8000        # a running server

Works on any served model; a turn the model's context cannot hold ends the run
(reported, with the server's message)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {k: {"type": "string", "description": v} for k, v in ps.items()},
    "required": list(ps)}}} for n, d, ps in (
    ("read_file", "Read a file of the repository and return its text.", {"path": "repository-relative path"}),
    ("search", "Search the repository for a regular expression.", {"pattern": "regex", "glob": "file glob"}),
    ("run_tests", "Run the test files given and return pytest's summary.", {"paths": "space-separated paths"}),
    ("apply_patch", "Apply a unified diff to the repository.", {"patch": "the diff"}),
    ("shell", "Run a shell command in the repository root.", {"command": "the command line"}))]
SYSTEM = ("You are a coding agent working in the mlx-dflash repository (speculative decoding for MLX). "
          "Read the files you are given with care, answer precisely, cite function names, and propose small, "
          "tested changes. Never invent APIs. Keep answers short.\n\n# Tools\n"
          + "\n".join(json.dumps(t) for t in TOOLS) + "\n\n# Repository guide\n" + (ROOT / "README.md").read_text()[:6000])
FILES = ["mlx_dflash/engine/decode_config.py", "mlx_dflash/cache/prompt_cache.py", "mlx_dflash/engine/decoder.py", "mlx_dflash/policy/registry.py",
         "mlx_dflash/policy/costs.py", "mlx_dflash/engine/calibrate.py", "mlx_dflash/policy/guard.py", "mlx_dflash/drafting/drafter.py",
         "mlx_dflash/target/adapter.py", "mlx_dflash/cache/prompt_store.py", "mlx_dflash/engine/stats.py", "mlx_dflash/engine/sampling.py"]
QUESTIONS = ["What does this file define? List its public names.", "Which function here would a long prompt slow "
             "down, and why?", "Write a one-line docstring for the first class.", "Where is state mutated here?",
             "Which of these functions could raise on bad input?", "Summarise the control flow in three steps."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, home, log: Path, key=None):
    """`serve` on a free port, once it answers and has `model` loaded (None: the
    default model, loaded by the first request); `key`: its API key. (process, url)"""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    if home:
        env["MLX_DFLASH_HOME"] = str(home)
    if key:
        env["MLX_DFLASH_API_KEY"] = key
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)] + (["--model", model] if model else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and (model is None or httpx.get(
                    url + "/metrics", headers=auth, timeout=5).json().get("loaded") is not None):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit(f"serve did not come up in 600 s: {log}")


def turn(client: httpx.Client, url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed request; what the stream said."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # (the tools are described in the system prompt: any model)
    out = {"progress": 0, "text": "", "ttft_s": None}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json().get("error", {}).get("message")
            except ValueError:
                msg = r.text
            return {"error": f"HTTP {r.status_code}: {msg}"}
        for line in r.iter_lines():
            if line.startswith(": prefill"):
                out["progress"] += 1
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"error": d["error"].get("message")}
            for ch in d.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    out["text"] += piece
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
            if "dflash" in d:
                out["dflash"], out["timings"] = d["dflash"], d["timings"]
            if d.get("usage"):
                out["usage"] = d["usage"]
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (else --model starts one)")
    ap.add_argument("--model", default="embedded/target", help="model id or folder to serve / to ask for")
    ap.add_argument("--home", help="MLX_DFLASH_HOME for the server this script starts")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--target-tokens", type=int, default=20000, help="stop once a prompt reaches this many tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--api-key", default=os.environ.get("MLX_DFLASH_API_KEY"))
    ap.add_argument("--out", help="write the per-turn results here (JSON)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.home, Path(args.out or "agent-conversation").with_suffix(".serve.log"))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    try:
        with httpx.Client(headers=headers, timeout=httpx.Timeout(1800, connect=10)) as client:
            msgs = [{"role": "system", "content": SYSTEM}]
            for i in range(args.turns):
                path = FILES[i % len(FILES)]
                msgs.append({"role": "user", "content": f"Output of read_file({path!r}):\n```python\n"
                             f"{(ROOT / path).read_text()}\n```\n{QUESTIONS[i % len(QUESTIONS)]}"})
                r = turn(client, url, args.model, msgs, args.max_tokens)
                if "error" in r:
                    rows.append({"turn": i + 1, "error": r["error"]})
                    print(f"turn {i + 1}: {r['error']}", file=sys.stderr)
                    break
                u, f, tm = r.get("usage", {}), r.get("dflash", {}), r.get("timings", {})
                row = {"turn": i + 1, "prompt_tokens": u.get("prompt_tokens"),
                       "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                       "completion_tokens": u.get("completion_tokens"), "ttft_s": r["ttft_s"],
                       "server_ttft_ms": f.get("ttft_ms"), "progress_comments": r["progress"],
                       "prefill_tok_s": tm.get("prompt_per_second"), "tok_s": tm.get("predicted_per_second"),
                       "tau": f.get("tau"), "cycles": f.get("cycles"), "mode": f.get("mode"),
                       "fallback": f.get("fallback"), "policy": f.get("policy")}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
                msgs.append({"role": "assistant", "content": r["text"]})
                if (row["prompt_tokens"] or 0) >= args.target_tokens:
                    break
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print("| turn | prompt tokens | cached | TTFT s | server TTFT ms | progress lines | prefill tok/s | tok/s | tau "
          "| cycles | mode | fallback | policy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['turn']} | error: {r['error']} |||||||||||| ")
            continue
        fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {fmt(r['ttft_s'])} "
              f"| {fmt(r['server_ttft_ms'], '{:.0f}')} | {r['progress_comments']} | {fmt(r['prefill_tok_s'], '{:.0f}')} "
              f"| {fmt(r['tok_s'], '{:.1f}')} | {fmt(r['tau'])} | {r['cycles']} | {r['mode']} | {r['fallback'] or '-'} "
              f"| {r['policy']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"url": url, "model": args.model, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
