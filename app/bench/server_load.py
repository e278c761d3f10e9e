"""`mlx-dflash bench --server-load`: `mlx-dflash serve` under load (issue 24). The
server runs in a process of its own (a scratch settings home: nothing of yours
is read or written) with the model loaded; --clients clients send greedy
completions back to back for --seconds. Counts answers, 429s and 5xx, and checks
every answer against the same prompt's answer from the same server with nothing
else running (exact). --max-batch defaults to auto, `serve`'s own default (the
size measured on this machine; a request that arrives alone is served alone)."""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.bench.batch import command_line, write
from app.bench.report import machine_info
from app.errors import UserError

PROMPTS = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "def add(a, b):",
           "A baker makes 12 cakes a day. How many cakes does he make in 5 days?", "import os\nimport sys\n",
           "Natalia sold clips to 48 of her friends in April", "The answer is", "for i in range(10):",
           "Janet's ducks lay 16 eggs per day."]

MAX_TOKENS = 32  # per stream, when --max-tokens is not given


def add_arguments(p) -> None:
    g = p.add_argument_group("the server under load (--server-load)")
    g.add_argument("--server-load", action="store_true", help="clients sending completions back to back to "
                   "`mlx-dflash serve`; every answer checked against the prompt served alone (server_load.py)")
    g.add_argument("--clients", type=int, default=16)
    g.add_argument("--seconds", type=float, default=120)
    g.add_argument("--max-batch", default="auto", help="serve --max-batch: an integer or auto (serve's default)")
    g.add_argument("--queue-size", type=int, default=8, help="serve --queue-size")


@contextmanager
def serve(model: str, *args: str, log=lambda s: None):
    """(base url) of `mlx-dflash serve --model MODEL ARGS` on a free loopback port,
    once the model is loaded; stopped on exit. Its log is kept in a scratch folder."""
    home = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-serve-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, logfile = f"http://127.0.0.1:{port}", home / "serve.log"
    env = {**os.environ, "MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("MLX_DFLASH_API_KEY", None)
    with open(logfile, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--model", model,
                                 "--quiet", *args], env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 600  # a model load on a busy CPU
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = logfile.read_text().strip().splitlines()[-1:] or ["no output"]
                raise UserError(f"serve did not come up ({tail[0]}); log: {logfile}")
            try:
                if httpx.get(url + "/metrics", timeout=2).json().get("loaded") is not None:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        log(f"serve is up at {url} (log: {logfile})")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def load_test(url: str, model: str, a, log) -> dict:
    def ask(p, timeout=600):
        return httpx.post(url + "/v1/completions", timeout=timeout,
                          json={"model": model, "prompt": p, "max_tokens": a.max_tokens, "temperature": 0})

    log(f"each of the {len(PROMPTS)} prompts alone (the reference answers)...")
    alone = {p: ask(p).json()["choices"][0]["text"] for p in PROMPTS}
    codes, wrong, lat = collections.Counter(), [], []
    lock = threading.Lock()
    stop = time.monotonic() + a.seconds

    def client(i):
        k = i
        while time.monotonic() < stop:
            p = PROMPTS[k % len(PROMPTS)]
            k += 1
            t0 = time.perf_counter()
            try:
                r = ask(p)
            except httpx.HTTPError as e:
                with lock:
                    codes[type(e).__name__] += 1
                continue
            with lock:
                codes[r.status_code] += 1
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                    if r.json()["choices"][0]["text"] != alone[p]:
                        wrong.append(p)
            if r.status_code == 429:
                time.sleep(0.2)  # as a client would, before retrying

    log(f"{a.clients} clients for {a.seconds:g} s...")
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    m = httpx.get(url + "/metrics", timeout=10).json()
    served = m["models"].get(model) or next(iter(m["models"].values()), {})
    return {"clients": a.clients, "seconds": round(wall, 1), "max_batch": a.max_batch, "queue_size": a.queue_size,
            "max_tokens": a.max_tokens, "codes": {str(k): v for k, v in codes.items()},
            "answers": codes[200], "http_5xx": sum(v for k, v in codes.items() if isinstance(k, int) and k >= 500),
            "http_429": codes[429], "not_identical_to_alone": len(wrong),
            "latency_p50_s": round(sorted(lat)[len(lat) // 2], 2) if lat else None,
            "completion_tokens_per_s": round(served.get("completion_tokens", 0) / wall, 1),
            "batch": m.get("batch"), "prompt_cache": served.get("prompt_cache")}


def markdown(res: dict) -> str:
    r, m = res["result"], res["meta"]
    return "\n".join([
        f"# `serve` under load: {m['model']}", "", f"`{m['command']}`" if m["command"] else "", "",
        f"{r['clients']} clients, {r['seconds']} s, --max-batch {r['max_batch']}, --queue-size {r['queue_size']}, "
        f"{r['max_tokens']} tokens a completion, greedy. {m['date_utc']} UTC, load {m['loadavg_start'][0]:.1f} -> "
        f"{m['loadavg_end'][0]:.1f}.", "",
        "| answers | 429 | 5xx | not identical to the prompt alone | latency p50 s | completion tok/s |",
        "|---|---|---|---|---|---|",
        f"| {r['answers']} | {r['http_429']} | {r['http_5xx']} | {r['not_identical_to_alone']} | "
        f"{r['latency_p50_s']} | {r['completion_tokens_per_s']} |", ""])


def run(args, log) -> int:
    if args.clients < 1 or args.seconds <= 0 or args.max_tokens < 1:
        raise UserError("--clients and --max-tokens must be >= 1 and --seconds > 0")
    if args.max_batch != "auto" and not args.max_batch.isdigit():
        raise UserError(f"--max-batch must be an integer or auto, got '{args.max_batch}'")
    model = args.model or "embedded/target"
    t_start, load0 = time.time(), os.getloadavg()
    with serve(model, "--max-batch", args.max_batch, "--queue-size", str(args.queue_size), log=log) as url:
        result = load_test(url, model, args, log)
    res = {"meta": {"command": command_line(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
                    "model": model, "machine": machine_info(), "loadavg_start": load0, "loadavg_end": os.getloadavg()},
           "result": result}
    write(res, markdown(res), Path(args.out or f"bench-server-load-{time.strftime('%Y%m%d-%H%M%S')}"), args.json, log)
    return 0
