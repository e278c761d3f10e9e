"""`mlx-dflash serve` on a laptop: what a hostile web page or a careless client
can do. Real server processes on loopback, real HTTP (httpx and raw sockets):
Host and Origin checks, content types, the body limit while the body arrives,
the API key, errors without paths, the request log, and Ctrl-C."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_process import ROOT, Server

pytestmark = [pytest.mark.timeout(600), pytest.mark.server]

MAX_BODY = 64 << 20  # the server's default limit (app/server/security.py)
JSON = {"Content-Type": "application/json"}
EVIL = "http://evil.example"
APP = "http://app.example"


@pytest.fixture(scope="module")
def setup(pairs, tmp_path_factory):
    """A model folder (qwen + its drafter, and a copy with truncated weights),
    a settings home pointing at it, and a target folder outside it (`serve
    --model PATH`)."""
    a = pairs()
    root = tmp_path_factory.mktemp("models")
    (root / "qwen").symlink_to(a / "target")
    (root / "qwen-drafter").symlink_to(a / "drafter")
    bad = root / "truncated"
    shutil.copytree(a / "target", bad)
    w = (a / "target" / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(w[: len(w) // 3])
    home = tmp_path_factory.mktemp("home")
    (home / "settings.json").write_text(json.dumps({
        "version": 1, "global": {"model_dirs": [str(root)], "default_model": "qwen"}}))
    outside = tmp_path_factory.mktemp("elsewhere") / "my-model"
    shutil.copytree(a / "target", outside)
    return root, home, outside


@pytest.fixture(scope="module")
def srv(setup):
    """The default configuration (no key), serving a folder outside the model folders."""
    s = Server(setup[1], "--allowed-hosts", "my.box", "--cors", APP, model=str(setup[2]))
    yield s
    s.stop()


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 60) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(head.encode() + b"\r\n" + body)
    return s


def _response(s: socket.socket) -> tuple:
    """(status, JSON body) of the one response on `s` (the server closes after it)."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        m = re.search(rb"content-length: *(\d+)", head, re.I)
        if m and len(body) >= int(m.group(1)):
            break
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _err(r, status, code=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["message"] and "type" in e and "param" in e
    if code is not None:
        assert e["code"] == code, e
    return e


def _generated(s) -> int:
    """Requests the worker has served (so a rejected request provably ran nothing)."""
    return sum(m["requests"] + m["errors"] for m in s.metrics()["models"].values())


def _completion(s, n=4, **headers):
    return httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": n, "temperature": 0},
                      headers={**s.headers, **headers}, timeout=120)


# -- Host header (DNS rebinding) ------------------------------------------------------------

@pytest.mark.slow
def test_unknown_host_is_refused_before_any_work(srv):
    before = _generated(srv)
    for path in ("/health", "/v1/models"):
        _err(httpx.get(srv.url + path, headers={"Host": "attacker.example"}), 403, "host_not_allowed")
    # a rebinding page's POST looks like a normal one, except for its Host
    _err(_completion(srv, Host=f"attacker.example:{srv.port}"), 403, "host_not_allowed")
    assert _generated(srv) == before
    for ok in ("localhost", f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "[::1]", "app.localhost",
               "my.box", f"MY.BOX:{srv.port}", socket.gethostname()):
        assert httpx.get(srv.url + "/health", headers={"Host": ok}).status_code == 200, ok
    assert _completion(srv, Host=f"localhost:{srv.port}").status_code == 200
    assert _generated(srv) == before + 1


# -- Origin, content type, CORS ---------------------------------------------------------------

@pytest.mark.slow
def test_cross_origin_browser_post_never_generates(srv):
    before = _generated(srv)
    body = json.dumps({"prompt": "hi", "max_tokens": 4})
    # what a page can send without a CORS preflight: forms and text/plain
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Origin": EVIL, "Content-Type": ctype})
        assert r.status_code == 403, (ctype, r.text)
        # the same without an Origin (an old browser, a sandboxed page): still not JSON
        _err(httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": ctype}), 415,
             "unsupported_media_type")
    _err(httpx.post(srv.url + "/v1/completions", content=body), 415)  # no content type at all
    # with a JSON body (needs a preflight, which is refused too)
    _err(httpx.post(srv.url + "/v1/completions", content=body, headers={**JSON, "Origin": EVIL}), 403,
         "origin_not_allowed")
    _err(httpx.post(srv.url + "/v1/completions", content=body, headers={**JSON, "Origin": "null"}), 403)
    r = httpx.options(srv.url + "/v1/completions", headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert _generated(srv) == before


@pytest.mark.slow
def test_allowed_origin_gets_cors_headers(srv):
    r = httpx.options(srv.url + "/v1/chat/completions",
                      headers={"Origin": APP, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization, content-type, x-api-key"})
    assert r.status_code in (200, 204)
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-api-key" in r.headers["access-control-allow-headers"]
    r = _completion(srv, Origin=APP)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert "origin" in r.headers["vary"].lower()
    # same origin (a page served by this host and port) needs no --cors
    assert _completion(srv, Origin=srv.url).status_code == 200


# -- body size --------------------------------------------------------------------------------

@pytest.mark.slow
def test_declared_oversized_body_is_refused_before_reading(srv):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {200 << 20}\r\n")
    s = _raw(srv.port, head, b"{" + b" " * 1000)  # then nothing more: the answer must not wait for it
    status, body = _response(s)
    assert status == 413 and body["error"]["code"] == "request_too_large"


@pytest.mark.slow
def test_streamed_body_is_cut_at_the_limit(srv):
    """No Content-Length (chunked): the 413 comes once MAX_BODY + 1 bytes arrived,
    while the body is still unfinished (the final chunk is never sent)."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
           "Transfer-Encoding: chunked\r\n"
    s = _raw(srv.port, head)
    piece = b" " * (1 << 20)
    for _ in range(MAX_BODY >> 20):
        s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    s.sendall(b"1\r\n \r\n")
    status, body = _response(s)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.slow
def test_client_leaving_mid_body_is_no_error(srv):
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 5000\r\n")
    _raw(srv.port, head, b'{"prompt": "hi"').close()
    deadline = time.monotonic() + 30
    while "POST /v1/completions 499" not in srv.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = srv.log.read_text()
    assert "POST /v1/completions 499" in log
    assert "Traceback" not in log and " 500 " not in log and "ClientDisconnect" not in log


# -- what the server tells ------------------------------------------------------------------

@pytest.mark.slow
def test_health_tells_nothing_but_ok(srv):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_served_folder_is_listed(srv, setup):
    ids = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    assert str(setup[2]) in ids and "qwen" in ids
    r = _completion(srv)  # no model named: the served folder
    assert r.status_code == 200 and r.json()["model"] == str(setup[2])


@pytest.mark.slow
def test_corrupt_model_gives_openai_error_without_paths(srv, setup):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "truncated", "prompt": "hi", "max_tokens": 2},
                   timeout=120)
    assert 400 <= r.status_code < 500 or r.status_code == 503, r.text
    _err(r, r.status_code)
    assert str(setup[0]) not in r.text and "/tmp" not in r.text and os.path.expanduser("~") + "/" not in r.text
    assert _completion(srv, n=2).status_code == 200  # and serves on


@pytest.mark.slow
def test_one_log_line_per_request(srv):
    n = 5

    def logged():
        return [ln[:2] for ln in re.findall(r"POST /v1/completions 200 tokens=(\d+) tau=([\d.]+) (\d+) ms",
                                            srv.log.read_text())]
    before = logged()
    r = _completion(srv, n=n)
    assert r.status_code == 200
    want = (str(r.json()["usage"]["completion_tokens"]), f'{r.json()["dflash"]["tau"]:.2f}')
    assert want[0] == str(n)
    # the line is written after the response is sent (an earlier test's last line may still
    # arrive too): wait for this request's own line among the new ones, then see it once
    deadline = time.monotonic() + 10
    while want not in logged()[len(before):] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    assert logged()[len(before):].count(want) == 1
    assert re.search(r"GET /health 200 \d+ ms", srv.log.read_text())


# -- the API key --------------------------------------------------------------------------

def _serve_cli(home, *args, timeout=60):
    e = {**os.environ, "MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    e.pop("MLX_DFLASH_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "app.cli", "serve", "--port", "0", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_api_key_on_the_command_line_is_refused(setup):
    r = _serve_cli(setup[1], "--api-key", "sekret")
    assert r.returncode == 2 and "MLX_DFLASH_API_KEY" in r.stderr and "Traceback" not in r.stderr
    from argparse import Namespace

    from app.server.cli import api_key

    empty = setup[1] / "empty-key"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        api_key(Namespace(api_key=None, api_key_file=str(empty)), None)
    with pytest.raises(ValueError, match="cannot read"):
        api_key(Namespace(api_key=None, api_key_file=str(setup[1] / "nope")), None)
    (setup[1] / "key").write_text("k1 \nignored\n")
    assert api_key(Namespace(api_key=None, api_key_file=str(setup[1] / "key")), "from-settings") == "k1"


@pytest.fixture(scope="module")
def keyed(setup, tmp_path_factory):
    """A key from a file (never on the command line); one row, a queue of two; a short grace."""
    f = tmp_path_factory.mktemp("key") / "key.txt"
    f.write_text("s3cret-key\n")
    s = Server(setup[1], "--api-key-file", str(f), "--queue-size", "2", "--max-batch", "1", "--grace", "0.5", "--quiet",
               key="s3cret-key", key_env=False)
    yield s
    s.stop()


@pytest.mark.slow
def test_api_key_from_file_bearer_or_x_api_key(keyed):
    if os.path.exists(f"/proc/{keyed.proc.pid}/cmdline"):  # what `ps` shows (Linux)
        assert b"s3cret-key" not in open(f"/proc/{keyed.proc.pid}/cmdline", "rb").read()
    _err(httpx.get(keyed.url + "/v1/models"), 401, "invalid_api_key")
    _err(httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "s3cret-kex"}), 401)
    _err(httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer s3cret-ke"}), 401)
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "s3cret-key"}).status_code == 200
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}  # no key needed, nothing told
    assert "s3cret-key" not in keyed.log.read_text()


# -- Ctrl-C ----------------------------------------------------------------------------------

def _wait_exit(s, seconds):
    try:
        return s.proc.wait(seconds)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        pytest.fail(f"the server did not exit within {seconds} s: {s.log.read_text()[-2000:]}")


def _clean_log(s):
    log = s.log.read_text()
    assert "terminate called" not in log and "Traceback" not in log and "Fatal Python error" not in log, log


def _long_stream(s, got: dict):
    """A generation as long as the model's context, read until it ends."""
    body = {"prompt": "while True:", "max_tokens": 100000, "temperature": 0, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=s.headers, timeout=120) as r:
            got["status"] = r.status_code
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    lines.append(ln[6:])
                    got["started"] = True
    except httpx.HTTPError as e:
        got["exc"] = e
    got["lines"] = lines


@pytest.mark.slow
def test_ctrl_c_answers_queue_503_and_cancels_after_grace(keyed):
    got, queued = {}, {}
    t = threading.Thread(target=_long_stream, args=(keyed, got))
    t.start()
    deadline = time.monotonic() + 60
    while not got.get("started") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got.get("started")
    q = threading.Thread(target=lambda: queued.update(r=_completion(keyed, n=2)))
    q.start()
    while keyed.metrics()["queued"] < 1:
        assert time.monotonic() < deadline and t.is_alive(), got
        time.sleep(0.02)
    t0 = time.monotonic()
    keyed.proc.send_signal(signal.SIGINT)
    q.join(30)
    _err(queued["r"], 503, "server_shutting_down")
    t.join(30)
    assert not t.is_alive()
    # the stream was stopped after the 0.5 s grace, and says so in-band
    errors = [json.loads(x)["error"] for x in got["lines"] if x.startswith('{"error"')]
    assert errors and errors[0]["code"] == "server_shutting_down"
    assert got["lines"][-1] == "[DONE]"
    assert _wait_exit(keyed, 30) in (0, 130)
    assert time.monotonic() - t0 < 20  # not the whole generation
    _clean_log(keyed)
    with pytest.raises(httpx.HTTPError):  # no longer accepting
        httpx.get(keyed.url + "/health", timeout=2)


@pytest.mark.slow
def test_second_ctrl_c_exits_at_once(setup):
    s = Server(setup[1], "--grace", "120", "--quiet", key="env-key")
    assert _completion(s, n=2).status_code == 200  # the key from MLX_DFLASH_API_KEY
    got = {}
    t = threading.Thread(target=_long_stream, args=(s, got))
    t.start()
    deadline = time.monotonic() + 60
    while not got.get("started") and time.monotonic() < deadline:
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert _wait_exit(s, 10) == 130
    assert time.monotonic() - t0 < 5
    t.join(30)
    _clean_log(s)
    assert "GET /health" not in s.log.read_text()  # --quiet


# -- the rules themselves (no server) ----------------------------------------------------

def test_host_and_origin_rules():
    from app.server.security import AccessRules

    p = AccessRules(hosts=("my.box", "*.lan"), origins=(APP,))
    for ok in ("", "localhost:8000", "LOCALHOST", "x.localhost", "127.0.0.1:1", "10.1.2.3", "[::1]:8000",
               "my.box", "my.box.", "pc.lan", f"{socket.gethostname()}:8000"):
        assert p.host_ok(ok), ok
    for bad in ("evil.example", "localhost.evil.example", "my.box.evil", "lan", "127.0.0.1.nip.io:8000"):
        assert not p.host_ok(bad), bad
    assert AccessRules(hosts=("*",)).host_ok("anything.example")
    assert p.origin_ok(APP, "127.0.0.1:8000", "http")
    assert p.origin_ok("http://127.0.0.1:8000", "127.0.0.1:8000", "http")  # same origin
    for bad in (EVIL, "null", "http://127.0.0.1:9999", APP + ".evil.example"):
        assert not p.origin_ok(bad, "127.0.0.1:8000", "http"), bad


def test_error_messages_lose_folders(tmp_path):
    from app.server.errors import APIError

    f = tmp_path / "models" / "x" / "model.safetensors"
    e = APIError(503, f"model 'x' cannot be loaded: {f} is truncated; see GET /v1/models or ~/m/config.json")
    assert e.message == "model 'x' cannot be loaded: .../model.safetensors is truncated; see GET /v1/models " \
                        "or .../config.json"
    assert str(tmp_path) not in e.response().body.decode()


def test_model_folder_with_wrong_config_types_is_no_500(setup, tmp_path, monkeypatch):
    """A config.json that parses but holds nonsense (a null layer count) made
    the model listing a 500 TypeError."""
    from mlx_dflash.settings.store import SettingsStore
    from starlette.testclient import TestClient

    from app.server import ManagerCatalog, create_app

    root = tmp_path / "models"
    bad = root / "odd"
    shutil.copytree(setup[2], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(num_hidden_layers=None, hidden_size="wide")
    (bad / "config.json").write_text(json.dumps(cfg))
    (root / "qwen").symlink_to(setup[0] / "qwen")
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))
    (tmp_path / "settings.json").write_text(json.dumps({"version": 1, "global": {"model_dirs": [str(root)]}}))
    # strict: "odd" is no model here, so a 404 (not the default model answering)
    app = create_app(ManagerCatalog(SettingsStore()), strict_models=True)
    c = TestClient(app, base_url="http://localhost")
    for r in (c.get("/v1/models"), c.post("/v1/completions", json={"model": "odd", "prompt": "x"})):
        assert r.status_code != 500 and r.status_code in (200, 404, 503), r.text
        if r.status_code != 200:
            assert r.json()["error"]["message"] and str(tmp_path) not in r.text


@pytest.mark.slow
def test_anthropic_path_gets_anthropic_error_format(srv):
    r = httpx.post(srv.url + "/v1/messages", content="{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error" and r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", json={}, headers={"Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


@pytest.mark.slow
def test_ctrl_c_on_idle_server_exits_cleanly(srv):
    """Last test using `srv`: it has answered requests; one Ctrl-C ends it, no abort."""
    assert _completion(srv, n=2).status_code == 200
    srv.proc.send_signal(signal.SIGINT)
    assert _wait_exit(srv, 30) in (0, 130)
    _clean_log(srv)
