"""Reliability figures for `mlx-dflash serve` (issue 26); see bench/reliability.md.

    python bench/reliability.py settings SRC OUT [--edits 300] [--pause 0.3]
    python bench/reliability.py prompts SRC OUT [--sizes 8 16 32 60]
    python bench/reliability.py connections SRC OUT [--idle 1000] [--slow 200]

SRC is the source tree whose server runs (`python -m app.cli serve` with cwd SRC,
so an older checkout measures the old code); OUT a scratch folder (settings home,
models, logs). `settings` and `connections` serve a tiny random test pair
(tests/make_test_pair.py, made in OUT), `prompts` the embedded default model."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, src: Path, home: Path, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / f"serve-{self.port}.log"
        env = {**os.environ, "MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), *args],
                                     cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and \
                        httpx.get(self.url + "/metrics", timeout=5).json()["loaded"] is not None:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("server did not come up")

    def rss_mib(self) -> float:
        for ln in open(f"/proc/{self.proc.pid}/status"):
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024
        return 0.0

    def post(self, path, body, timeout=300):
        return httpx.post(self.url + "/v1" + path, json=body, timeout=timeout)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_pair(out: Path) -> Path:
    """OUT/models/{qwen,qwen-drafter}: the tiny random pair the tests use."""
    models = out / "models"
    if not (models / "qwen").exists():
        pair = out / "pair"
        subprocess.run([sys.executable, str(HERE / "scripts" / "make_test_pair.py"), str(pair)], check=True,
                       stdout=subprocess.DEVNULL)
        models.mkdir(parents=True, exist_ok=True)
        (models / "qwen").symlink_to(pair / "target")
        (models / "qwen-drafter").symlink_to(pair / "drafter")
    return models


def settings_text(models: Path, max_tokens: int) -> str:
    return json.dumps({"version": 1, "global": {"model_dirs": [str(models)], "default_model": "qwen"},
                       "models": {"qwen": {"max_tokens": max_tokens, "temperature": 0.0}}}, indent=2) + "\n"


# -- settings edited in place under traffic ------------------------------------------------

def edit(path: Path, text: str, pause: float) -> None:
    """An editor that saves in place: truncate and write (same file), split by `pause`."""
    with open(path, "r+" if path.exists() else "w", encoding="utf-8") as f:
        f.truncate(0)
        if pause:
            f.write(text[: len(text) // 2])
            f.flush()
            time.sleep(pause)
            f.write(text[len(text) // 2:])
        else:
            f.write(text)


def bench_settings(src: Path, out: Path, edits: int, pause: float) -> dict:
    models = test_pair(out)
    home = out / f"home-settings-{pause:g}"
    home.mkdir(parents=True, exist_ok=True)
    for p in home.glob("settings.json*"):
        p.unlink()
    path = home / "settings.json"
    path.write_text(settings_text(models, 5))
    s = Serve(src, home, "--model", "qwen", "--quiet")
    stop, statuses = threading.Event(), []

    def traffic():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                statuses.append(c.post(s.url + "/v1/completions", json={"model": "qwen", "prompt": "count"}
                                       ).status_code)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    lost_file = lost_server = 0
    t0 = time.monotonic()
    try:
        for i in range(edits):
            n = 2 + i % 8
            text = settings_text(models, n)
            edit(path, text, pause)
            if not path.exists() or path.read_text() != text:
                lost_file += 1
            r = s.post("/completions", {"model": "qwen", "prompt": "count"})
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != n:
                lost_server += 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        s.stop()
    return {"edits": edits, "pause_s": pause, "lost_file": lost_file, "next_request_without_the_edit": lost_server,
            "backups": len(list(home.glob("settings.json.corrupt-*"))), "traffic_requests": len(statuses),
            "traffic_non_200": sum(x != 200 for x in statuses), "seconds": round(time.monotonic() - t0, 1)}


# -- huge prompts ---------------------------------------------------------------------------

def bench_prompts(src: Path, out: Path, sizes) -> list:
    home = out / "home-prompts"
    home.mkdir(parents=True, exist_ok=True)
    s = Serve(src, home, "--model", "embedded/target")  # its log line gives the server's own time
    short = {"model": "embedded/target", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    rows = []
    try:
        alone = []
        for _ in range(3):
            t = time.monotonic()
            s.post("/completions", short)
            alone.append(time.monotonic() - t)
        alone_s = statistics.median(alone)
        for mib in sizes:
            for api in ("completions", "chat"):
                size = int(mib * (1 << 20))
                text = ("All work and no play makes Jack a dull boy. " * (size // 44 + 1))[:size]
                body = json.dumps({"model": "embedded/target", "prompt": text} if api == "completions" else
                                  {"model": "embedded/target", "messages": [{"role": "user", "content": text}]}
                                  ).encode()  # made before the clock starts: the client's time is not the server's
                del text
                time.sleep(1.0)
                base = s.rss_mib()
                peak, got, samples = [base], {}, threading.Event()

                def sample():
                    while not samples.is_set():
                        peak.append(s.rss_mib())
                        time.sleep(0.01)

                def big():
                    t = time.monotonic()
                    r = httpx.post(s.url + ("/v1/completions" if api == "completions" else "/v1/chat/completions"),
                                   content=body, headers={"Content-Type": "application/json"}, timeout=600)
                    got.update(status=r.status_code, code=(r.json().get("error") or {}).get("code"),
                               seconds=time.monotonic() - t)

                logged = len(s.log.read_text().splitlines())
                st = threading.Thread(target=sample)
                st.start()
                bt = threading.Thread(target=big)
                bt.start()
                time.sleep(0.3)  # the big request first, then a short one behind it
                t = time.monotonic()
                rs = s.post("/completions", short)
                behind = time.monotonic() - t
                bt.join(600)
                time.sleep(1.0)
                samples.set()
                st.join()
                time.sleep(1.0)
                mine = [ln for ln in s.log.read_text().splitlines()[logged:] if " 400 " in ln]  # the big one
                rows.append({"MiB": mib, "api": api, "status": got.get("status"), "code": got.get("code"),
                             "refused_after_s": round(got.get("seconds", -1), 2),
                             "server_s": round(float(mine[-1].split()[-2]) / 1000, 2) if mine else None,
                             "rss_before_MiB": round(base), "peak_growth_MiB": round(max(peak) - base),
                             "rss_after_MiB": round(s.rss_mib()), "short_alone_s": round(alone_s, 2),
                             "short_behind_s": round(behind, 2), "short_status": rs.status_code})
                print(json.dumps(rows[-1]), flush=True)
                del body
    finally:
        s.stop()
    return rows


# -- idle and slow connections ----------------------------------------------------------------

def bench_connections(src: Path, out: Path, idle: int, slow: int, watch: float) -> dict:
    models = test_pair(out)
    home = out / "home-connections"
    home.mkdir(parents=True, exist_ok=True)
    (home / "settings.json").write_text(settings_text(models, 4))
    s = Serve(src, home, "--model", "qwen", "--quiet")
    body = {"model": "qwen", "prompt": "hi", "max_tokens": 4}
    lat = {"before": [], "during": []}
    stats = {"during_non_200": 0}
    try:
        with httpx.Client(timeout=60) as c:
            for _ in range(10):
                t = time.monotonic()
                c.post(s.url + "/v1/completions", json=body)
                lat["before"].append(time.monotonic() - t)
        sel = selectors.DefaultSelector()
        t0 = time.monotonic()
        socks = []
        for i in range(idle + slow):
            k = socket.create_connection(("127.0.0.1", s.port))
            k.setblocking(False)
            socks.append(k)
            sel.register(k, selectors.EVENT_READ, ("idle" if i < idle else "slow", i))
        opened = time.monotonic() - t0
        closed = {}
        stop = threading.Event()

        def normal():
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    try:
                        r = c.post(s.url + "/v1/completions", json=body)
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    lat["during"].append(time.monotonic() - t)
                    stats["during_non_200"] += not ok
                    time.sleep(0.2)

        nt = threading.Thread(target=normal)
        nt.start()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Pad: " + \
            b"a" * 4000
        sent = 0
        next_byte = time.monotonic()
        while time.monotonic() - t0 < watch and len(closed) < len(socks):
            for key, _ in sel.select(timeout=0.05):
                kind, i = key.data
                try:
                    data = key.fileobj.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                if not data:
                    closed[i] = (kind, time.monotonic() - t0)
                    sel.unregister(key.fileobj)
            if time.monotonic() >= next_byte:  # slowloris: one more header byte each second
                for k in socks[idle:]:
                    if socks.index(k) not in closed and sent < len(head):
                        try:
                            k.send(head[sent:sent + 1])
                        except OSError:
                            pass
                sent += 1
                next_byte += 1.0
        stop.set()
        nt.join(60)
        for k in socks:
            k.close()
        idle_t = [t for kind, t in closed.values() if kind == "idle"]
        slow_t = [t for kind, t in closed.values() if kind == "slow"]
        return {"idle": idle, "slow": slow, "open_all_s": round(opened, 2), "watched_s": watch,
                "idle_closed": len(idle_t), "idle_closed_within_5s": sum(t < 5 for t in idle_t), "idle_last_closed_s": round(max(idle_t), 1) if idle_t else None,
                "slow_closed": len(slow_t), "slow_last_closed_s": round(max(slow_t), 1) if slow_t else None,
                "normal_before_median_ms": round(statistics.median(lat["before"]) * 1000),
                "normal_during_median_ms": round(statistics.median(lat["during"]) * 1000) if lat["during"] else None,
                "normal_during_max_ms": round(max(lat["during"]) * 1000) if lat["during"] else None,
                "normal_during_requests": len(lat["during"]), "normal_during_failed": stats["during_non_200"]}
    finally:
        s.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["settings", "prompts", "connections"])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--edits", type=int, default=300)
    ap.add_argument("--pause", type=float, nargs="+", default=[0.3, 0.0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[8, 16, 32, 60])
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--watch", type=float, default=40.0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.what == "settings":
        for p in a.pause:
            print(json.dumps(bench_settings(a.src.resolve(), a.out.resolve(), a.edits, p)), flush=True)
    elif a.what == "prompts":
        bench_prompts(a.src.resolve(), a.out.resolve(), a.sizes)
    else:
        print(json.dumps(bench_connections(a.src.resolve(), a.out.resolve(), a.idle, a.slow, a.watch)), flush=True)


if __name__ == "__main__":
    main()
