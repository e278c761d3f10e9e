"""`mlx-dflash serve` under what users and clients really do (issue 26): settings
edited in place while it runs, settings that change the model, any model name,
huge prompts, idle and slow connections, and a shutdown that cuts a stream."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ROOT, Server, api_error

from mlx_dflash.models.model_names import resolve
from mlx_dflash.models.settings_checks import check_settings
from mlx_dflash.settings.store import SettingsStore
from mlx_dflash.settings.schema import ModelSettings, SettingsError

pytestmark = [pytest.mark.timeout(600), pytest.mark.server]


@pytest.fixture(scope="module")
def world(serve_models, tmp_path_factory):
    """(model folder, a settings home of this module's own: its tests edit it)."""
    root = serve_models[0]
    home = tmp_path_factory.mktemp("home-rel")
    (home / "settings.json").write_text(json.dumps({
        "version": 1, "global": {"model_dirs": [str(root)], "default_model": "qwen"},
        "models": {"qwen": {"max_tokens": 6}}}, indent=2))
    return root, home


@pytest.fixture(scope="module")
def srv(world):
    s = Server(world[1], "--header-timeout", "1", "--keep-alive", "1")
    yield s
    s.stop()


def _post(s, path, body, timeout=120):
    return httpx.post(s.url + "/v1" + path, json=body, timeout=timeout)


def _edit_in_place(path, text, pause):
    """An editor's save: truncate, write half, pause, write the rest (same file)."""
    with open(path, "r+", encoding="utf-8") as f:
        f.truncate(0)
        f.write(text[: len(text) // 2])
        f.flush()
        time.sleep(pause)
        f.write(text[len(text) // 2:])


def _settings(home, **models):
    d = json.loads((home / "settings.json").read_text())
    d["models"] = models
    return json.dumps(d, indent=2)


@pytest.mark.slow
def test_any_name_means_what_it_means_to_every_command(srv, world):
    root, home = world
    store = SettingsStore(home / "settings.json")
    names = ["qwen", "QWEN", "someorg/qwen", str(root / "qwen")]
    for name in names:
        assert resolve(name, store).id == "qwen"  # what generate, chat and settings use
        r = _post(srv, "/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "qwen", (name, r.text)
    env = {"MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "app.cli", "settings", "get", "QWEN", "max_tokens"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "6" in r.stdout, r.stderr
    for name in ("QWEN", "someorg/qwen"):  # and generate, in a process of its own
        r = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", name, "--prompt", "hi",
                            "--max-tokens", "2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
    for name in ("gpt-4o", "claude-haiku-4-5-20251001", "gpt-5-codex", "default", "gpt-4o"):  # clients' own names
        r = _post(srv, "/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "qwen", r.text
    r = httpx.post(srv.url + "/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]}, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "qwen", r.text
    log = srv.log.read_text()
    assert log.count("model 'gpt-4o' is not served here; answering with 'qwen'") == 1  # named once
    api_error(_post(srv, "/completions", {"model": "qwen-drafter", "prompt": "x"}), 404)  # a drafter: a mistake
    r = _post(srv, "/completions", {"model": str(root.parent / "elsewhere"), "prompt": "x", "max_tokens": 2})
    assert r.json()["model"] == "qwen"  # a folder that is no listed model is never read: an unknown name
    r = _post(srv, "/completions", {"model": "app", "prompt": "x", "max_tokens": 2})  # a folder in its cwd
    assert r.status_code == 200 and r.json()["model"] == "qwen", r.text


@pytest.mark.slow
def test_settings_edits_in_place_reach_the_server_and_lose_nothing(srv, world):
    path = world[1] / "settings.json"
    stop, answers = threading.Event(), []

    def traffic():
        while not stop.is_set():
            r = _post(srv, "/completions", {"model": "qwen", "prompt": "count", "temperature": 0})
            answers.append(r.status_code)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        for i, n in enumerate((3, 5, 4, 7)):
            text = _settings(world[1], qwen={"max_tokens": n})
            _edit_in_place(path, text, 0.3 if i % 2 == 0 else 0.0)
            assert path.read_text() == text  # the edit is where the user put it
            r = _post(srv, "/completions", {"model": "qwen", "prompt": "count", "temperature": 0})
            assert r.json()["usage"]["completion_tokens"] == n  # and the next request has it
    finally:
        stop.set()
        t.join(60)
    assert answers and set(answers) == {200}
    assert list(world[1].glob("settings.json.corrupt-*")) == []  # nothing called corrupt while it was saved


@pytest.mark.slow
def test_changed_drafter_applies_and_a_bad_one_is_refused(srv, world):
    path = world[1] / "settings.json"
    chat = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert _post(srv, "/chat/completions", chat).json()["dflash"]["mode"] == "dflash"
    path.write_text(_settings(world[1], qwen={"drafter": "llama-drafter"}))  # another target's drafter
    store = SettingsStore(path)
    with pytest.raises(SettingsError) as why:  # what `generate` and `settings set` say about it
        check_settings("qwen", ModelSettings(drafter="llama-drafter"), store)
    for _ in range(2):
        e = api_error(_post(srv, "/chat/completions", chat), 503)
        assert e["code"] == "settings_invalid" and str(why.value) in e["message"], e
    assert srv.metrics()["loaded"] == "qwen"  # the model loaded before stays
    path.write_text(_settings(world[1], qwen={"dflash.enabled": False}))
    r = _post(srv, "/chat/completions", chat)
    assert r.status_code == 200 and r.json()["dflash"]["mode"] == "off", r.text  # reloaded without a drafter
    path.write_text(_settings(world[1], qwen={"drafter": "qwen-drafter"}))
    r = _post(srv, "/chat/completions", chat)
    assert r.status_code == 200 and r.json()["dflash"]["mode"] == "dflash"
    assert srv.log.read_text().count("loading it again") == 2


@pytest.mark.slow
def test_huge_prompts_are_refused_before_they_are_tokenized(srv):
    short = {"model": "qwen", "prompt": "hi", "max_tokens": 2}
    t0 = time.monotonic()
    assert _post(srv, "/completions", short).status_code == 200
    alone = time.monotonic() - t0
    for mib, text in ((8, "word " * (8 << 18)), (8, "x" * (8 << 20)), (2, "a b\n" * (1 << 19))):
        got = {}
        big = threading.Thread(target=lambda: got.update(r=_post(srv, "/completions", {"model": "qwen",
                                                                                       "prompt": text})))
        t0 = time.monotonic()
        big.start()
        time.sleep(0.3)  # the big one is queued first
        t1 = time.monotonic()
        assert _post(srv, "/completions", short).status_code == 200
        behind = time.monotonic() - t1
        big.join(120)
        e = api_error(got["r"], 400)
        assert e["code"] == "context_length_exceeded", e
        assert time.monotonic() - t0 < 15, mib  # the figures (bench/reliability.md) are far lower; a busy CPU
        assert behind < alone + 10


def _closed(sock, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.mark.slow
def test_idle_and_slow_connections_are_closed(srv):
    """--header-timeout 1 --keep-alive 1 (the defaults are 10 and 5 s)."""
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
    slow = socket.create_connection(("127.0.0.1", srv.port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 400
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):  # slowloris, a byte every 0.1 s: cut off, the head never completes
            for b in head:
                slow.sendall(bytes([b]))
                time.sleep(0.1)
        assert time.monotonic() - t0 < 4
        assert all(_closed(s, 5) for s in idle)
        assert time.monotonic() - t0 < 8
        assert _post(srv, "/completions", {"model": "qwen", "prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        for s in (*idle, slow):
            s.close()
    with httpx.Client(timeout=60) as c:  # keep-alive clients go on as usual
        for _ in range(2):
            assert c.post(srv.url + "/v1/completions", json={"model": "qwen", "prompt": "hi", "max_tokens": 2}
                          ).status_code == 200
            time.sleep(1.5)


def test_endless_request_head_is_refused(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as k:  # headers that never end
        k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: aaaaaaaaaaaaaaaa\r\n" * 1500)
        assert k.recv(100).startswith(b"HTTP/1.1 400")
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def _stream_then_stop(home, grace: str, signals: int):
    """A server, a long stream on it, `signals` Ctrl-C once it runs; (exit status, its request log lines)."""
    s = Server(home, "--grace", grace)
    got = {}

    def stream():
        body = {"prompt": "while True:", "max_tokens": 100000, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    got["started"] = True
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while not got.get("started") and time.monotonic() < deadline:
        time.sleep(0.02)
    for _ in range(signals):
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    try:
        rc = s.proc.wait(30)
    finally:
        s.stop()
    t.join(30)
    return rc, [ln for ln in s.log.read_text().splitlines() if "POST /v1/completions" in ln]


@pytest.mark.slow
def test_a_stream_cut_by_the_shutdown_is_logged(world):
    rc, lines = _stream_then_stop(world[1], "120", 2)  # the second Ctrl-C exits at once
    assert rc == 130
    assert len(lines) == 1 and " 499 (cut by the shutdown: Ctrl-C twice)" in lines[0], lines
    rc, lines = _stream_then_stop(world[1], "0.5", 1)  # stopped when the grace ends
    assert rc in (0, 130)
    assert len(lines) == 1 and re.search(r" 200 tokens=\d+ \(the server is shutting down; the generation was stopped\)",
                                         lines[0]), lines  # (with the tokens it had sent)


@pytest.mark.slow
def test_the_length_bound_and_the_piecewise_count_hold_for_real_text():
    """What the early refusal rests on, for the embedded model's tokenizer: a text
    has at least len / max_token_chars tokens, and counted in pieces it has what
    it has as a whole (within COUNT_SLACK)."""
    import random

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from app.server.prompt_ids import CHUNK_CHARS, COUNT_SLACK, max_token_chars, pieces
    from mlx_dflash.models.discovery import default_pair

    tok = load_tokenizer(Path(default_pair()[0]))
    rnd = random.Random(0)
    words = ["".join(rnd.choice("abcdefghij") for _ in range(rnd.randint(1, 12))) for _ in range(500)]
    texts = {"words": " ".join(rnd.choice(words) for _ in range(40000)),
             "lines": "\n".join(" ".join(rnd.choice(words) for _ in range(9)) for _ in range(4000)),
             "one letter": "x" * 100000, "spaces": " " * 100000, "digits": "1234567890" * 10000,
             "CJK and emoji": "".join(rnd.choice("日本語の文章です。😀🎉") for _ in range(60000)),
             "specials": "<|im_start|>user\nhi<|im_end|>\n" * 3000}
    most = max_token_chars(tok)
    for name, text in texts.items():
        whole = len(tok.encode(text, add_special_tokens=False))
        assert len(text) / most <= whole, name
        parts = sum(len(tok.encode(p, add_special_tokens=False)) for p in pieces(text, CHUNK_CHARS))
        assert whole / COUNT_SLACK <= parts <= whole * COUNT_SLACK, (name, whole, parts)
        assert "".join(pieces(text, CHUNK_CHARS)) == text
