"""Issue 36: a fresh `mlx-dflash serve` (cost caches cold, default settings) under
a first burst of requests, and 8 long prompts arriving together.

burst: 8 short chat requests at once on the fresh server (cold), the same 8 one
after another (serial), then the 8 at once again (warm); wall seconds of each,
every answer compared with the serial one's.
long: one ~N-token prompt alone (its TTFT: one prefill), then 8 other prompts of
that length at once (streamed): each one's TTFT and its end.

    PYTHONPATH=. python bench/first_burst/first_burst.py burst --out bench/first_burst/burst.json
    PYTHONPATH=. python bench/first_burst/first_burst.py long --tokens 5900 --out bench/first_burst/long.json
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx

TOPICS = ["a binary search in Python", "the water cycle", "how a hash map works", "the causes of tides",
          "a stack class in Python", "why the sky is blue", "how TCP opens a connection", "merge sort in C",
          "the French revolution", "photosynthesis"]


def start(home: str, port: int, extra=()):
    env = dict(os.environ, MLX_DFLASH_HOME=home)
    log = open(os.path.join(home, "serve.log"), "w")
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--quiet", *extra],
                         env=env, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 600:  # up, and the model loaded (its load-time measurements included)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).json().get("loaded"):
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    return p, time.time() - t0


def ask(port, content, max_tokens, out, i, stream=False):
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    t0 = time.time()
    if not stream:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600)
        j = r.json()
        out[i] = {"status": r.status_code, "text": j["choices"][0]["message"]["content"] if r.status_code == 200
                  else j, "seconds": time.time() - t0}
        return
    ttft, text = None, []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.time() - t0
            text.append(delta)
    out[i] = {"status": r.status_code, "ttft": ttft, "seconds": time.time() - t0, "text": "".join(text)}


def together(port, contents, max_tokens, stream=False):
    out = [None] * len(contents)
    ts = [threading.Thread(target=ask, args=(port, c, max_tokens, out, i, stream)) for i, c in enumerate(contents)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.time() - t0, out


def costs_ready(home: str, timeout: float = 900) -> float:
    """Seconds until the server says its guard's costs are measured (the log line)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if "the guard's costs for" in open(os.path.join(home, "serve.log")).read():
            break
        time.sleep(0.5)
    return time.time() - t0


def burst(args, port, home):
    contents = [f"Explain {t} in a few sentences." for t in TOPICS[:args.n]]
    p, boot = start(home, port)
    try:
        cold_s, cold = together(port, contents, args.max_tokens)
        wait_s = costs_ready(home)  # serial and warm: with every curve measured
        serial = [None] * len(contents)
        t0 = time.time()
        for i, c in enumerate(contents):
            ask(port, c, args.max_tokens, serial, i)
        serial_s = time.time() - t0
        warm_s, warm = together(port, contents, args.max_tokens)
    finally:
        p.terminate()
        p.wait()
    same = all(a["text"] == b["text"] == c["text"] for a, b, c in zip(cold, serial, warm))
    return {"boot_s": boot, "costs_ready_after_burst_s": wait_s, "cold_burst_s": cold_s, "serial_s": serial_s, "warm_burst_s": warm_s,
            "cold_vs_serial": serial_s / cold_s, "warm_vs_serial": serial_s / warm_s, "identical": same,
            "statuses": [r["status"] for r in cold + serial + warm]}


def filler(seed: int, tokens: int) -> str:
    words = ["alpha", "river", "stone", "quiet", "lamp", "orbit", "maple", "copper", "violet", "harbor", "ember",
             "glacier", "thunder", "meadow", "cobalt", "lantern"]
    n = int(tokens / 4.2)  # (each word and its number: ~4.2 tokens of the embedded tokenizer)
    return " ".join(words[(seed * 7 + i * (seed + 3)) % len(words)] + str((i * 31 + seed) % 97) for i in range(n))


def long(args, port, home):
    p, boot = start(home, port)
    try:
        one = [None, None]  # one prompt alone, before and after the eight (the machine's load drifts)
        ask(port, filler(99, args.tokens) + "\nSummarize.", args.max_tokens, one, 0, stream=True)
        wall, outs = together(port, [filler(s, args.tokens) + "\nSummarize." for s in range(args.n)], args.max_tokens,
                              stream=True)
        ask(port, filler(98, args.tokens) + "\nSummarize.", args.max_tokens, one, 1, stream=True)
    finally:
        p.terminate()
        p.wait()
    ttfts = sorted(o["ttft"] for o in outs)
    alone = max(o["ttft"] for o in one)
    return {"boot_s": boot, "alone_ttft_s": [o["ttft"] for o in one], "ttft_s": ttfts,
            "end_s": sorted(o["seconds"] for o in outs), "first_ttft_vs_alone": ttfts[0] / alone,
            "first_ttft_vs_faster_alone": ttfts[0] / min(o["ttft"] for o in one), "wall_s": wall,
            "statuses": [o["status"] for o in outs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["burst", "long"])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=5900)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.max_tokens = args.max_tokens or (64 if args.mode == "burst" else 32)
    home = tempfile.mkdtemp(prefix="burst-home-")  # cold: no measured costs, no prompt cache
    try:
        res = (burst if args.mode == "burst" else long)(args, args.port, home)
        res["log"] = open(os.path.join(home, "serve.log")).read().splitlines()[-30:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    res["command"] = " ".join(sys.argv)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
