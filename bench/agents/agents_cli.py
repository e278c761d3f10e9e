"""Claude Code and Codex CLI against `mlx-dflash serve` (issue 22), with the
README's agent configurations: `claude -p` then `claude -p --continue`, an
interactive `claude` session in a tmux pane (two turns), and `codex exec` then
`codex exec resume --last`. The CLIs talk to the server through a recording
proxy in this script, which notes for every request: session, turn, HTTP status,
prompt / cached / output tokens, the server's time to first token, wall time, and
the `dflash` report (tau, mode, policy) the server returns; also whether the
model's answer was a tool call, and which.

    PYTHONPATH=. python bench/agents/agents_cli.py --home /tmp/scratch-home       # starts `serve` (defaults: the embedded model)
    PYTHONPATH=. python bench/agents/agents_cli.py --url http://127.0.0.1:8000    # a running server; --api-key its key

The CLIs come from the npm prefix tests/test_agents_cli.py installs them into
($TMPDIR/mlx-dflash-agent-clis: Claude Code 2.1.197, Codex 0.171.0); run that test
once, or `npm install --prefix $TMPDIR/mlx-dflash-agent-clis @anthropic-ai/claude-code@2.1.197
@openai/codex@0.171.0`. Prints a markdown table; --out writes the rows as JSON."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from bench.long_context.agent_conversation import start_server  # `serve` on a free port, up and loaded

ROOT = Path(__file__).resolve().parents[2]
PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-agent-clis"
NOTE = "hello from a file"
TOOL_TYPES = ("tool_use", "function_call", "custom_tool_call")
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


def _walk(x):
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)


def _summary(body: bytes) -> dict:
    """What a response (JSON or an SSE stream) said: usage, the `dflash` report, tool calls, an error."""
    docs = []
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        try:
            docs.append(json.loads(text))
        except ValueError:
            pass
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                docs.append(json.loads(line[5:]))
            except ValueError:
                pass
    out: dict = {"tools": []}
    for d in _walk(docs):
        if isinstance(d.get("dflash"), dict):
            out["dflash"] = d["dflash"]
        for k in ("input_tokens", "prompt_tokens", "output_tokens", "completion_tokens", "cache_read_input_tokens"):
            if isinstance(d.get(k), int):
                out[k] = d[k]
        if d.get("type") in TOOL_TYPES and d.get("name") and d.get("id", d.get("call_id")) not in \
                [t[0] for t in out["tools"]]:
            out["tools"].append((d.get("id", d.get("call_id")), d["name"]))
        if isinstance(d.get("error"), dict) and d["error"].get("message"):
            out["error"] = d["error"]["message"]
    return out


class Proxy:
    """An ASGI app in front of the server: forwards every request as it is, streams the
    answer back as it comes, and records it."""

    def __init__(self, upstream: str):
        self.upstream, self.rows, self.session, self.in_flight = upstream, [], "", 0
        self.client = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.client = httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.in_flight += 1
        t0 = time.perf_counter()
        row = {"session": self.session, "method": scope["method"], "path": scope["path"]}
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            req = {}
        if isinstance(req, dict):
            structured = req.get("output_format") or (req.get("output_config") or {}).get("format") \
                or (req.get("response_format") or {}).get("type") == "json_schema"
            row["request"] = {"model": req.get("model"), "stream": req.get("stream"), "structured": bool(structured),
                              "tools": len(req.get("tools") or []), "bytes": len(body)}
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP]
        url = self.upstream + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        got = b""
        try:
            req_ = self.client.build_request(scope["method"], url, headers=headers, content=body)
            r = await self.client.send(req_, stream=True)
            row["status"] = r.status_code
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": [(k.encode(), v.encode()) for k, v in r.headers.items() if k.lower() not in HOP]})
            async for chunk in r.aiter_raw():
                got += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            await r.aclose()
        except (httpx.HTTPError, OSError) as e:
            row.setdefault("status", 502)
            row["error"] = f"proxy: {type(e).__name__}: {e}"
        finally:
            row["wall_ms"] = round((time.perf_counter() - t0) * 1000)
            s = _summary(got)
            f = s.get("dflash", {})
            prompt = s.get("prompt_tokens")
            if prompt is None and "input_tokens" in s:  # Messages counts cached tokens apart; Responses does not
                prompt = s["input_tokens"] + s.get("cache_read_input_tokens", 0) if "cache_read_input_tokens" in s \
                    else s["input_tokens"]
            row.update(prompt=prompt, cached=f.get("reused_prompt_tokens"),
                       out=s.get("output_tokens", s.get("completion_tokens")), ttft_ms=f.get("ttft_ms"),
                       tau=f.get("tau"), mode=f.get("mode"), policy=f.get("policy"),
                       tool_calls=[name for _, name in s["tools"]], **({"error": s["error"]} if "error" in s else {}))
            self.rows.append(row)
            self.in_flight -= 1
            print(json.dumps({k: v for k, v in row.items() if k != "request"}), file=sys.stderr, flush=True)


def serve_proxy(proxy: Proxy) -> str:
    srv = uvicorn.Server(uvicorn.Config(proxy, host="127.0.0.1", port=0, log_level="error", lifespan="on"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


def wait_quiet(proxy: Proxy, since: int, quiet: float, timeout: float) -> None:
    """Until at least one request came after `since`, none is running, and none came for `quiet` s."""
    deadline = time.monotonic() + timeout
    last, n = time.monotonic(), len(proxy.rows)
    while time.monotonic() < deadline:
        time.sleep(1)
        if len(proxy.rows) != n or proxy.in_flight:
            last, n = time.monotonic(), len(proxy.rows)
        elif n > since and time.monotonic() - last > quiet:
            return
    print(f"(no quiet after {timeout:.0f} s)", file=sys.stderr)


def scratch(root: Path, name: str):
    home, work = root / name / "home", root / name / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    (work / "hello.txt").write_text(NOTE + "\n")
    return home, work


def claude_env(home, url, key, model, max_output=None):
    # the README's configuration (the server's URL and key, the served model for the main and
    # background requests), with the README's long timeouts: a CPU prefills an agent's first prompt
    # in minutes, and Claude Code drops a stream with no event for 5 minutes
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key or "none",
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "API_TIMEOUT_MS": "3600000",
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if max_output:  # Claude Code asks for 32k output tokens: a small model that never stops fills its context
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
    env.pop("ANTHROPIC_API_KEY", None)
    return env


def run(cmd, cwd, env, timeout, log: dict):
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        log.update(rc=r.returncode, stdout=r.stdout[-3000:], stderr=r.stderr[-3000:])
    except subprocess.TimeoutExpired as e:
        log.update(rc="timeout", stdout=str(e.stdout)[-3000:], stderr=str(e.stderr)[-3000:])
    log["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: log[k] for k in ("cmd", "rc", "seconds")}), file=sys.stderr, flush=True)


def claude_p(bins, proxy, url, args, root, transcripts):
    home, work = scratch(root, "claude-p")
    env = claude_env(home, url, args.api_key, args.model, args.claude_max_output)
    for turn, extra, prompt in ((1, [], args.claude_turn1), (2, ["--continue"], args.turn2)):
        proxy.session = f"claude -p, turn {turn}"
        cmd = [str(bins["claude"]), "-p", prompt, *extra, "--max-turns", "3", "--output-format", "json",
               "--allowedTools", "Read", *shlex.split(args.claude_flags)]
        log = {"session": proxy.session, "cmd": " ".join(cmd[1:])}
        run(cmd, work, env, args.timeout, log)
        transcripts.append(log)


def claude_tmux(bins, proxy, url, args, root, transcripts):
    tmux = shutil.which("tmux")
    if tmux is None:
        print("tmux is not installed: no interactive session", file=sys.stderr)
        return
    home, work = scratch(root, "claude-tmux")
    # first-run screens (onboarding, folder trust) answered as a user would have
    (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True, "theme": "dark", "projects": {
        str(work): {"hasTrustDialogAccepted": True, "allowedTools": []}}}))
    env = claude_env(home, url, args.api_key, args.model, args.claude_max_output)
    cmd = " ".join(f"{k}={json.dumps(v)}" for k, v in env.items()
                   if k.startswith(("ANTHROPIC_", "DISABLE_", "CLAUDE_", "API_")) or k == "HOME")
    sock = f"bench-agents-{os.getpid()}"

    def pane():
        return subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", "cc"], capture_output=True,
                              text=True).stdout

    def say(text):
        subprocess.run([tmux, "-L", sock, "send-keys", "-t", "cc", "-l", text], check=True)
        time.sleep(0.5)
        subprocess.run([tmux, "-L", sock, "send-keys", "-t", "cc", "Enter"], check=True)

    proxy.session = "claude (tmux), start"
    subprocess.run([tmux, "-L", sock, "new-session", "-d", "-s", "cc", "-x", "200", "-y", "50", "-c", str(work),
                    f"env {cmd} {bins['claude']} --allowedTools Read {args.claude_flags}"], check=True)
    try:
        deadline = time.monotonic() + 120
        while "for shortcuts" not in pane() and time.monotonic() < deadline:
            time.sleep(0.5)
        for turn, prompt in ((1, args.claude_turn1), (2, args.turn2)):
            proxy.session = f"claude (tmux), turn {turn}"
            since = len(proxy.rows)
            t0 = time.perf_counter()
            say(prompt)
            wait_quiet(proxy, since, args.quiet, args.timeout)
            transcripts.append({"session": proxy.session, "cmd": f"(typed) {prompt}",
                                "seconds": round(time.perf_counter() - t0, 1), "pane": pane()[-3000:]})
            if "Do you want" in pane():  # a permission question for a tool not allowed: answer no
                subprocess.run([tmux, "-L", sock, "send-keys", "-t", "cc", "Escape"], check=True)
                time.sleep(2)
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], capture_output=True)


def codex(bins, proxy, url, args, root, transcripts):
    home, work = scratch(root, "codex")
    codex_home = home / ".codex"
    codex_home.mkdir()
    # the README's configuration, with this server's URL
    (codex_home / "config.toml").write_text(
        f'model = "{args.model}"\nmodel_provider = "mlx-dflash"\n\n[model_providers.mlx-dflash]\n'
        f'name = "mlx-dflash"\nbase_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "MLX_DFLASH_API_KEY"\n'
        f'stream_idle_timeout_ms = 3600000\n')
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(codex_home), "MLX_DFLASH_API_KEY": args.api_key or "none"}
    env.pop("OPENAI_API_KEY", None)
    for turn, extra, prompt in ((1, [], args.codex_turn1), (2, ["resume", "--last"], args.turn2)):
        proxy.session = f"codex exec, turn {turn}"
        cmd = [str(bins["codex"]), "exec", "--skip-git-repo-check", *shlex.split(args.codex_flags), *extra, prompt]
        log = {"session": proxy.session, "cmd": " ".join(cmd[1:])}
        run(cmd, work, env, args.timeout, log)
        transcripts.append(log)


SESSIONS = {"claude-p": claude_p, "claude-tmux": claude_tmux, "codex": codex}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (else one is started with the default settings)")
    ap.add_argument("--home", help="MLX_DFLASH_HOME for the server this script starts")
    ap.add_argument("--model", default="embedded/target", help="the model name the CLIs are configured with")
    ap.add_argument("--api-key", default=os.environ.get("MLX_DFLASH_API_KEY", "local-key"))
    ap.add_argument("--sessions", nargs="+", default=list(SESSIONS), choices=list(SESSIONS))
    ap.add_argument("--claude-flags", default="", help="more claude options, e.g. '--tools Read' (a short tool "
                    "list: a smaller prompt)")
    ap.add_argument("--claude-max-output", type=int, help="CLAUDE_CODE_MAX_OUTPUT_TOKENS for Claude Code")
    ap.add_argument("--codex-flags", default="", help="more codex exec options, e.g. "
                    "'-c model_instructions_file=short.md' (a smaller prompt)")
    ap.add_argument("--claude-turn1", default="Read hello.txt")
    ap.add_argument("--codex-turn1", default="Run cat hello.txt")
    ap.add_argument("--turn2", default="Thanks. Say what the file said.")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per CLI run / interactive turn")
    ap.add_argument("--quiet", type=float, default=30, help="interactive turn over: no request for this long")
    ap.add_argument("--out", help="write the rows and the CLIs' output here (JSON)")
    args = ap.parse_args()
    bins = {n: PREFIX / "node_modules" / ".bin" / n for n in ("claude", "codex")}
    missing = [str(b) for b in bins.values() if not b.exists()]
    if missing:
        sys.exit(f"not installed: {', '.join(missing)}; run tests/test_agents_cli.py once (it installs them)")
    proc = None
    url = args.url
    root = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    if url is None:
        proc, url = start_server(None, args.home, root / "serve.log", args.api_key)
        print(f"serve: {url}, log {root / 'serve.log'}", file=sys.stderr)
    proxy = Proxy(url.rstrip("/"))
    purl = serve_proxy(proxy)
    transcripts: list = []
    try:
        for name in args.sessions:
            SESSIONS[name](bins, proxy, purl, args, root, transcripts)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print("| session | request | HTTP | prompt tokens | cached tokens | output tokens | ttft ms | wall ms | tau "
          "| mode | policy | tool calls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x, f="{:,}": "" if x is None else f.format(x)  # noqa: E731
    for r in proxy.rows:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        note = ", ".join(r["tool_calls"]) + (f" error: {r['error']}" if r.get("error") else "")
        title = " (structured)" if r.get("request", {}).get("structured") else ""
        print(f"| {r['session']}{title} | {r['method']} {r['path']} | {r['status']} | {fmt(r['prompt'])} "
              f"| {fmt(r['cached'])} | {fmt(r['out'])} | {fmt(r['ttft_ms'], '{:,.0f}')} | {r['wall_ms']:,} | {tau} "
              f"| {r['mode'] or ''} | {r['policy'] or ''} | {note} |")
    if args.out:
        if proc is not None:  # the server's own log (one line per request) next to the rows
            shutil.copy(root / "serve.log", Path(args.out).with_suffix(".serve.log"))
        Path(args.out).write_text(json.dumps({"url": url, "rows": proxy.rows, "runs": transcripts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
