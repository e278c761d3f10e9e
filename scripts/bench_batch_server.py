"""Server load test (issue 24): `serve --max-batch N` on the embedded pair, C
clients sending greedy completions back to back for S seconds. Counts
answers, 429s and 5xx, and checks every answer against the same prompt's
answer from the same server with nothing else running (exact).

    python scripts/bench_batch_server.py [--clients 16] [--seconds 120] [--max-batch 8|auto] [--queue-size 8]

--max-batch defaults to auto, `serve`'s own default (the size measured on
this machine; a request that arrives alone is served alone); the test helper
that starts the server would otherwise pass 1.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from serve_process import Server  # noqa: E402

PROMPTS = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "def add(a, b):",
           "A baker makes 12 cakes a day. How many cakes does he make in 5 days?", "import os\nimport sys\n",
           "Natalia sold clips to 48 of her friends in April", "The answer is", "for i in range(10):",
           "Janet's ducks lay 16 eggs per day."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-batch", default="auto", help="an integer or auto (serve's default)")
    ap.add_argument("--queue-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-batch-server-"))
    s = Server(home, "--max-batch", a.max_batch, "--queue-size", str(a.queue_size), "--quiet", model="embedded/target")
    try:
        def ask(p, timeout=600):
            return httpx.post(s.url + "/v1/completions", timeout=timeout,
                              json={"model": "embedded/target", "prompt": p, "max_tokens": a.max_tokens,
                                    "temperature": 0})

        alone = {p: ask(p).json()["choices"][0]["text"] for p in PROMPTS}  # one at a time: the reference
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

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        m = s.metrics()
        out = {"clients": a.clients, "seconds": round(wall, 1), "max_batch": a.max_batch, "queue_size": a.queue_size,
               "max_tokens": a.max_tokens, "codes": {str(k): v for k, v in codes.items()},
               "answers": codes[200], "http_5xx": sum(v for k, v in codes.items() if isinstance(k, int) and k >= 500),
               "http_429": codes[429], "not_identical_to_alone": len(wrong),
               "latency_p50_s": round(sorted(lat)[len(lat) // 2], 2) if lat else None,
               "completion_tokens_per_s": round(m["models"]["embedded/target"]["completion_tokens"] / wall, 1),
               "batch": m.get("batch"), "prompt_cache": m["models"]["embedded/target"].get("prompt_cache")}
        print(json.dumps(out, indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    finally:
        s.stop()


if __name__ == "__main__":
    main()
