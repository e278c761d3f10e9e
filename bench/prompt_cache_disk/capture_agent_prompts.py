"""The first request of Claude Code, Codex and opencode, captured as each CLI
sends it (system prompt, tools, the user's first message), for benchmarks that
replay them (bench/prompt_cache_disk/bench.py). Each CLI talks to a stub on
loopback that records every POST and answers 400, so nothing is generated and
nothing leaves the machine.

    PYTHONPATH=. python bench/prompt_cache_disk/capture_agent_prompts.py --out bench/agents_prompts

The CLIs come from the npm prefix tests/test_agents_cli.py installs them into
($TMPDIR/mlx-dflash-agent-clis), with opencode-ai added there."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from bench_agents_cli import PREFIX, claude_env

MODEL = "embedded/target"


class Stub:
    """An ASGI app that keeps every POST body and answers 400."""

    def __init__(self):
        self.posts = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["method"] == "POST" and body:
            try:
                self.posts.append((scope["path"], json.loads(body)))
            except ValueError:
                pass
        msg = json.dumps({"error": {"type": "invalid_request_error", "message": "capture only"}}).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": msg})


def serve(app) -> str:
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(cfg)
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"


def sessions(url: str, root: Path):
    """(name, command, env, folder) of each CLI's first turn, as the README configures it."""
    bins = PREFIX / "node_modules" / ".bin"
    out = []
    home, work = root / "claude-home", root / "claude-work"
    for d in (home, work):
        d.mkdir(parents=True)
    (work / "hello.txt").write_text("hello from a file\n")
    out.append(("claude_code", [str(bins / "claude"), "-p", "Read hello.txt and tell me what it says.", "--max-turns",
                                "1", "--output-format", "json"], claude_env(home, url, "none", MODEL), work))
    home, work = root / "codex-home", root / "codex-work"
    for d in (home / ".codex", work):
        d.mkdir(parents=True)
    (work / "hello.txt").write_text("hello from a file\n")
    (home / ".codex" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "mlx-dflash"\n\n[model_providers.mlx-dflash]\n'
        f'name = "mlx-dflash"\nbase_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "MLX_DFLASH_API_KEY"\n')
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "MLX_DFLASH_API_KEY": "none"}
    env.pop("OPENAI_API_KEY", None)
    out.append(("codex", [str(bins / "codex"), "exec", "--skip-git-repo-check", "Run cat hello.txt"], env, work))
    home, work = root / "opencode-home", root / "opencode-work"
    for d in (home, work):
        d.mkdir(parents=True)
    (work / "hello.txt").write_text("hello from a file\n")
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": f"mlx/{MODEL}",
        "provider": {"mlx": {"npm": "@ai-sdk/openai-compatible", "name": "mlx-dflash",
                             "options": {"baseURL": f"{url}/v1", "apiKey": "none"}, "models": {MODEL: {}}}}}))
    env = {**os.environ, "HOME": str(home), "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_CONFIG": str(work / "opencode.json")}  # (found in the folder only in a project)
    out.append(("opencode", [str(bins / "opencode"), "run", "--model", f"mlx/{MODEL}",
                             "Read hello.txt and tell me what it says."], env, work))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/agents_prompts")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stub = Stub()
    url = serve(stub)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd, env, cwd in sessions(url, Path(tmp)):
            before = len(stub.posts)
            try:
                subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                pass
            got = stub.posts[before:]
            if not got:
                print(f"{name}: no request captured")
                continue
            path, body = max(got, key=lambda pb: len(json.dumps(pb[1])))  # the main request, not a title
            (out / f"{name}.json").write_text(json.dumps({"path": path, "body": body}, indent=1))
            print(f"{name}: {path}, {len(json.dumps(body)):,} bytes, {len(body.get('tools') or [])} tools "
                  f"({len(got)} requests)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
