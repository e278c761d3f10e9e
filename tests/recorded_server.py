"""The server in this process on a free loopback port, behind a recorder of
every request it answered (with each generation's stats), for the tests that
drive it with real clients (agent CLIs, SDKs)."""

import re
import threading
import time

import uvicorn

from app.server import create_app
from app.server.security import STATS_KEY


class Recorder:
    """An ASGI wrapper that records every request: method, path, status, wall time,
    and the generation's stats (prompt / cached tokens, tau, policy, ttft)."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec = {"method": scope["method"], "path": scope["path"], "status": None, "t0": time.perf_counter()}
        body = []

        async def send_(msg):
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                body.append(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        finally:
            rec["ms"] = (time.perf_counter() - rec.pop("t0")) * 1000
            s = scope.get("state", {}).get(STATS_KEY)
            if s is not None:
                ttft = re.findall(rb'"ttft_ms": ([0-9.]+)', b"".join(body))
                rec.update(prompt=s.prompt_tokens, cached=s.reused_tokens, out=s.generation_tokens,
                           tau=round(s.tau, 2), policy=s.policy, mode=s.mode,
                           ttft_ms=round(float(ttft[-1])) if ttft else None)
            self.seen.append(rec)


def serve_app(catalog, model, key):
    """create_app(catalog) behind a Recorder on a free loopback port: (recorder, url, server, its thread)."""
    app = Recorder(create_app(catalog, model=model, api_key=key))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "test server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    return app, f"http://127.0.0.1:{port}", srv, thread


def report(name, seen):
    print(f"\n{name}: method path status wall_ms | prompt cached out ttft_ms tau mode policy")
    for r in seen:
        print(f"  {r['method']} {r['path']} {r['status']} {r['ms']:.0f}"
              + (f" | {r['prompt']} {r['cached']} {r['out']} {r['ttft_ms']} {r['tau']} {r['mode']} {r['policy']}"
                 if "prompt" in r else ""))


def api_calls(seen, path):
    calls = [r for r in seen if r["path"].startswith(path)]
    assert calls and all(r["status"] == 200 for r in calls), [(r["path"], r["status"]) for r in seen]
    return calls
