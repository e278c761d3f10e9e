"""Ctrl-C on a busy `mlx-dflash serve`: one long stream running, one request queued.
Prints the queued request's status, how the stream ended, seconds from SIGINT to
exit and the exit code; then the same for a second Ctrl-C 0.5 s after the first.
usage: python bench/server_shutdown.py SRC_DIR SETTINGS_HOME MODEL PORT [SERVE_ARGS...]"""
import json, os, signal, subprocess, sys, threading, time
import httpx

src, home, model, port, extra = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
url = f"http://127.0.0.1:{port}"


def run(second: bool):
    env = {**os.environ, "MLX_DFLASH_HOME": home, "HF_HUB_OFFLINE": "1"}
    err = open(f"/tmp/server_shutdown_{port}.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--model", model, *extra],
                         cwd=src, env=env, stderr=err)
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    time.sleep(3)  # the model loads in the background
    got, queued = {"lines": 0, "end": None}, {}

    def stream():
        body = {"prompt": "while True:", "max_tokens": 100000, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        got["lines"] += 1
                        if ln.startswith('data: {"error"'):
                            got["end"] = json.loads(ln[6:])["error"]["code"]
                got["end"] = got["end"] or "complete"
        except httpx.HTTPError as e:
            got["end"] = type(e).__name__

    t = threading.Thread(target=stream)
    t.start()
    while got["lines"] < 2:
        time.sleep(0.01)
    q = threading.Thread(target=lambda: queued.update(r=httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=300)))
    q.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    if second:
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
    rc = p.wait(300)
    dt = time.monotonic() - t0
    q.join(10)
    t.join(10)
    r = queued.get("r")
    log = open(f"/tmp/server_shutdown_{port}.log").read()
    print(f"{'two Ctrl-C' if second else 'one Ctrl-C'}: exit {rc} after {dt:.1f} s; queued request: "
          f"{r.status_code if r is not None else 'no answer'}; stream: {got['end']} after {got['lines']} chunks; "
          f"abort in log: {'terminate called' in log}")


run(False)
run(True)
