"""The prompt cache on disk, measured through real `serve` processes (issue 38).

`ttft` mode: the captured first requests of Claude Code, Codex and opencode
(bench/agents_prompts, bench/prompt_cache_disk/capture_agent_prompts.py) replayed against
`serve` on the embedded model, greedy: each one cold, again from memory, a new
session sharing only its instructions (another first message) from memory;
then the server is stopped and started again on the same cache folder: another
new session (its instructions from disk), then the first request again (from disk). The outputs of the
cold and the disk runs must be identical (asserted).

`load` mode: 16 clients with long prompts against one `serve` under a small
memory budget (memory_budget_gb), each a bounded number of requests, loopback
only; the server's RSS sampled from /proc every 0.1 s: its peak against the
budget, every HTTP status, and whether the process is still alive.

    PYTHONPATH=. python bench/prompt_cache_disk/bench.py ttft --out bench/prompt_cache_disk.json
    PYTHONPATH=. python bench/prompt_cache_disk/bench.py load --budget-gb 1.5 --clients 16 --requests 2 --words 1500"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "bench" / "agents_prompts"
MODEL = "embedded/target"
FIRST = {"claude_code": "Read hello.txt and tell me what it says.", "codex": "Run cat hello.txt",
         "opencode": "Read hello.txt and tell me what it says."}
OTHER = ("List the Python files in this folder and say what each one is for.",
         "Explain what a race condition is, with a short example.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`mlx-dflash serve` in a subprocess on a settings home, up with the model loaded."""

    def __init__(self, home: Path, log: Path, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), MLX_DFLASH_HOME=str(home))
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), "--model", MODEL, *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a"))
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/metrics", timeout=5).json().get("loaded"):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        sys.exit("serve did not come up")

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics", timeout=30).json()

    def stop(self) -> int:
        """SIGINT, as Ctrl-C: it finishes, writes its last cached prompts, exits."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(300)

    def rss(self) -> int:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


# -- the agents' first requests -----------------------------------------------------------

def request(name: str, first: str | None = None, max_tokens: int = 16) -> tuple:
    """(path, body) of an agent's captured first request, greedy, non-streamed,
    its first user message replaced by `first` (a new session) when given."""
    cap = json.loads((PROMPTS / f"{name}.json").read_text())
    path, body = cap["path"], copy.deepcopy(cap["body"])
    body.update(model=MODEL, stream=False, temperature=0)
    body.pop("top_p", None)
    if path.endswith("/responses"):
        body["max_output_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    if first is not None:
        hits = _replace(body, FIRST[name], first)
        assert hits, f"{name}: its first message was not found"
    return path, body


def _replace(x, old: str, new: str) -> int:
    n = 0
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, str) and old in v:
                x[k], n = v.replace(old, new), n + 1
            else:
                n += _replace(v, old, new)
    elif isinstance(x, list):
        for v in x:
            n += _replace(v, old, new)
    return n


def _text(j: dict) -> str:
    """The answer (text and tool calls) without the ids a server makes up per response."""
    if "choices" in j:
        out = j["choices"][0]["message"]
    else:
        out = j.get("content", j.get("output"))
    return json.dumps(_no_ids(out), sort_keys=True)


def _no_ids(x):
    if isinstance(x, dict):
        return {k: _no_ids(v) for k, v in x.items() if k not in ("id", "call_id", "tool_call_id")}
    if isinstance(x, list):
        return [_no_ids(v) for v in x]
    return x


def ask(srv: Serve, name: str, first: str | None = None) -> dict:
    path, body = request(name, first)
    t0 = time.perf_counter()
    r = httpx.post(srv.url + path, json=body, timeout=3600)
    wall = time.perf_counter() - t0
    j = r.json()
    assert r.status_code == 200, (name, r.status_code, j)
    d = j["dflash"]
    u = j.get("usage", {})
    prompt = u.get("prompt_tokens") or (u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0))
    return {"status": r.status_code, "ttft_ms": d["ttft_ms"], "wall_ms": wall * 1000, "prompt_tokens": prompt,
            "cached": d["reused_prompt_tokens"], "tier": (d.get("prompt_cache") or {}).get("tier"),
            "load_ms": (d.get("prompt_cache") or {}).get("load_ms"), "text": _text(j)}


def ttft(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-"))
    log = Path(args.log)
    names = [n for n in ("claude_code", "codex", "opencode") if (PROMPTS / f"{n}.json").exists()]
    rows = {n: {} for n in names}
    srv = Serve(home, log, "--max-batch", "1")
    for n in names:
        rows[n]["cold"] = ask(srv, n)
        rows[n]["memory"] = ask(srv, n)
        rows[n]["new session, memory"] = ask(srv, n, OTHER[0])
        print(n, {k: (v["prompt_tokens"], v["cached"], round(v["ttft_ms"])) for k, v in rows[n].items()}, flush=True)
    before = srv.metrics()
    rc = srv.stop()
    srv = Serve(home, log, "--max-batch", "1")  # restarted: only the disk is shared
    for n in names:  # the new session first: its instructions can only come from disk
        rows[n]["new session, disk"] = ask(srv, n, OTHER[1])
        rows[n]["disk, after a restart"] = ask(srv, n)
        print(n, {k: (v["prompt_tokens"], v["cached"], round(v["ttft_ms"])) for k, v in rows[n].items()}, flush=True)
    for n in names:  # the same request, the same answer: cold, from memory, from disk
        for k in ("memory", "disk, after a restart"):
            rows[n][k]["same_as_cold"] = rows[n][k]["text"] == rows[n]["cold"]["text"]
    after = srv.metrics()
    srv.stop()
    du = subprocess.run([sys.executable, "-m", "app.cli", "cache", "du"], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, MLX_DFLASH_HOME=str(home), PYTHONPATH=str(ROOT))).stdout.strip()
    res = {"rows": rows, "first_server_exit": rc, "metrics_before_restart": before, "metrics_after": after,
           "cache_du": du, "home": str(home)}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return res


def ttft_table(res: dict) -> str:
    out = ["| agent | request | prompt tokens | cached tokens | from | server ttft (ms) | vs cold | wall (ms) | "
           "answer = cold's |", "|---|---|---|---|---|---|---|---|---|"]
    for n, rows in res["rows"].items():
        cold = rows["cold"]["ttft_ms"]
        for k, v in rows.items():
            src = v["tier"] or "-"
            if v["load_ms"]:
                src += f" (load {v['load_ms']:.0f} ms)"
            out.append(f"| {n} | {k} | {v['prompt_tokens']:,} | {v['cached']:,} | {src} | {v['ttft_ms']:,.0f} | "
                       f"{v['ttft_ms'] / cold:.1%} | {v['wall_ms']:,.0f} | "
                       f"{ {True: 'yes', False: 'NO'}.get(v.get('same_as_cold'), '') } |")
    return "\n".join(out)


# -- the load test ---------------------------------------------------------------------------

def load(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-"))
    subprocess.run([sys.executable, "-m", "app.cli", "settings", "set", "memory_budget_gb", str(args.budget_gb)],
                   cwd=ROOT, env=dict(os.environ, MLX_DFLASH_HOME=str(home), PYTHONPATH=str(ROOT)), check=True)
    srv = Serve(home, Path(args.log), "--max-batch", str(args.max_batch), "--queue-size", str(args.queue_size))
    base = srv.rss()
    peak, samples, stop = [base], [], threading.Event()

    def sample():
        while not stop.is_set():
            r = srv.rss()
            peak[0] = max(peak[0], r)
            samples.append(r)
            time.sleep(0.1)

    statuses, errors, served = [], [], []
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()

    def client(i: int):
        with httpx.Client(timeout=3600) as c:
            for k in range(args.requests):
                text = " ".join(words[(i * 7 + k * 3 + j) % len(words)] for j in range(args.words))
                body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0,
                        "messages": [{"role": "system", "content": f"Client {i}. Summarize the user's text."},
                                     {"role": "user", "content": text}]}
                for attempt in range(args.retries + 1):  # a client backs off on 429, as the SDKs do
                    try:
                        r = c.post(srv.url + "/v1/chat/completions", json=body)
                    except httpx.HTTPError as e:
                        statuses.append(type(e).__name__)
                        break
                    statuses.append(r.status_code)
                    if r.status_code != 200:
                        errors.append(r.json()["error"]["message"])
                    if r.status_code != 429:
                        break
                    time.sleep(min(30.0, 2.0 * 2 ** attempt))
                served.append(r.status_code == 200)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    m = srv.metrics()
    alive = srv.proc.poll() is None
    rc = srv.stop()
    counts = {k: [str(s) for s in statuses].count(k) for k in sorted({str(s) for s in statuses})}
    return {"budget_bytes": int(args.budget_gb * 1e9), "rss_at_start": base, "rss_peak": peak[0],
            "statuses": counts, "errors": sorted(set(errors))[:5], "alive_after": alive, "exit": rc,
            "wall_s": wall, "memory": m.get("memory"), "attempts": len(statuses), "requests": len(served),
            "served": sum(served), "args": vars(args)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ttft", "load"))
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench_prompt_cache_disk.serve.log"))
    ap.add_argument("--budget-gb", type=float, default=1.6)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="per client")
    ap.add_argument("--words", type=int, default=2500, help="words per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", default="4")
    ap.add_argument("--retries", type=int, default=6, help="per request, after a 429 (backing off)")
    ap.add_argument("--queue-size", type=int, default=32, help="serve --queue-size: every client may wait in it")
    args = ap.parse_args()
    res = ttft(args) if args.mode == "ttft" else load(args)
    if args.mode == "ttft":
        print(ttft_table(res))
    else:
        print(json.dumps({k: v for k, v in res.items() if k != "memory"}, indent=1))
        print("memory:", json.dumps(res["memory"]))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
