"""The rough edges a new user hit in the first hour (issue 37, items 5 and 6): each
one as a user or a client meets it."""

import io
import json
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from scripted import EmbeddedCatalog, LocalServer

import app.server.worker  # noqa: F401  (imported with the real stream_generate, before a test replaces it)
from mlx_dflash.settings.schema import ModelSettings

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A settings home of this test's own."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path / "home"


def main(*argv):
    from app.cli import main as _main

    return _main(list(argv))


# -- generate -----------------------------------------------------------------------------------

def _scripted_run(monkeypatch, steps):
    """stream_generate replaced by results whose stats go through `steps` ((drafted, accepted), ...)."""
    import mlx_dflash
    from mlx_dflash.engine.stats import GenerationStats

    def fake(model, tok, prompt, drafter=None, config=None, **kw):
        for i, (d, a) in enumerate(steps):
            s = GenerationStats(mode="dflash", cycles=8 * (i + 1), cycle_tokens=8 * (i + 1) + a, drafted=d,
                                accepted=a, generation_tokens=i + 1)
            yield SimpleNamespace(token=5, text="x", finish_reason="length" if i == len(steps) - 1 else None,
                                  stats=s, logprobs=None)

    monkeypatch.setattr(mlx_dflash, "stream_generate", fake)


@pytest.mark.slow
def test_a_drafter_is_judged_on_the_whole_answer(home, monkeypatch, capsys):
    """The shipped pair's first drafts of an answer are often all rejected (0 of 35), its
    whole answer then runs at tau 3: no warning. A drafter that accepts nothing: one."""
    _scripted_run(monkeypatch, [(35, 0), (80, 30), (160, 70)])
    assert main("generate", "--prompt", "Write a Python function.") == 0
    assert "drafted tokens" not in capsys.readouterr().err
    _scripted_run(monkeypatch, [(35, 0), (80, 1), (160, 1)])
    assert main("generate", "--prompt", "Write a Python function.") == 0
    err = capsys.readouterr().err
    assert err.count("drafted tokens") == 1 and "accepted 1 of 160 drafted tokens" in err


def test_a_near_miss_of_a_local_name_says_only_did_you_mean(home, monkeypatch, capsys):
    from mlx_dflash.platform import hub

    def no_hub(*a, **kw):
        raise AssertionError("the hub was asked for a near miss of a local name")

    monkeypatch.setattr(hub, "resolve_path", no_hub)
    monkeypatch.setattr("mlx_dflash.models.model_names.resolve_path", no_hub)
    assert main("generate", "--model", "embeded/target", "--prompt", "hi") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("unknown model 'embeded/target' (did you mean 'embedded/target'?)"), err
    assert "pull" not in err and err.count("\n") == 0


def test_settings_get_of_an_unknown_name_is_an_error(home, capsys):
    assert main("settings", "get", "nosuch") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nosuch' is no setting and no model here" in err
    assert main("settings", "get", "prot") == 2
    assert "did you mean 'port'?" in capsys.readouterr().err
    assert main("settings", "get", "embedded/target", "max_tokens") == 0  # a model here
    assert main("settings", "set", "org/later", "top_k", "3") == 0  # settings saved before a download
    capsys.readouterr()
    assert main("settings", "get", "org/later", "top_k") == 0 and "3" in capsys.readouterr().out


# -- settings file ------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_corrupt_copy_per_corrupt_file(tmp_path, capsys):
    from mlx_dflash.settings.store import SettingsStore

    path = tmp_path / "settings.json"
    path.write_text('{"version": 1, "global": {')
    os.utime(path, (time.time() - 10, time.time() - 10))  # settled: read as it is
    for _ in range(3):  # three commands, each a store of its own
        SettingsStore(path).globals()
    copies = sorted(tmp_path.glob("settings.json.corrupt-*"))
    assert len(copies) == 1 and copies[0].read_text() == '{"version": 1, "global": {'
    err = capsys.readouterr().err
    assert err.count("copied it to") == 1 and err.count(f"a copy is in {copies[0]}") == 2
    path.write_text('{"version": 1, "models": 3}')  # another corrupt content: a copy of its own
    os.utime(path, (time.time() - 10, time.time() - 10))
    SettingsStore(path).globals()
    assert len(list(tmp_path.glob("settings.json.corrupt-*"))) == 2


# -- doctor, serve --help -----------------------------------------------------------------------

def test_doctor_labels_cached_curves_of_one_shape():
    """Two cached curves at one context (another BLAS, another drafter of the same shape):
    each row says what it was measured with, so no two rows look alike."""
    from app.commands import doctor

    rows = [{"context": 128, "t1_ms": 12.7, "plain_ms": 13.3, "c": {"2": 1.28}, "d": {"2": 0.58},
             "with": doctor._measured_with({"machine": {"blas": "OpenBLAS 0.3 (x)"}, "model_params": "14b87c",
                                            "drafter_params": "a68cb5"})},
            {"context": 128, "t1_ms": 29.5, "plain_ms": 33.5, "c": {"2": 1.37}, "d": {"2": 0.65},
             "with": doctor._measured_with({"machine": {"blas": "reference (mlx-cpu bundled)"},
                                            "model_params": "9a6e44", "drafter_params": "3224b0"})}]
    lines = doctor.guard_cost_lines([{"model": "m", "drafter": "d", "curves": rows}], quick=True)
    assert lines[1].endswith("measured with")
    assert lines[2].endswith("OpenBLAS, weights 14b8/a68c") and lines[3].endswith("reference, weights 9a6e/3224")


def test_serve_help_is_in_sentences(capsys):
    with pytest.raises(SystemExit):
        main("serve", "--help")
    out = capsys.readouterr().out
    opts = re.split(r"\n  (?=-)", out.split("options:", 1)[1])[2:]  # after --help
    assert len(opts) >= 14
    for o in opts:
        assert " ".join(o.split()).endswith("."), o  # every option's help is a whole sentence, ended


# -- the server: model names, the HTTP layer, a client that leaves ---------------------------

class Home(EmbeddedCatalog):
    """The model manager's catalog (the listed names) with the embedded pair."""

    def __init__(self):
        from app.server.catalog import ManagerCatalog

        super().__init__(ModelSettings(max_tokens=4))
        self.manager = ManagerCatalog()

    def targets(self):
        return self.manager.targets()

    def find(self, name, served=None):
        return self.manager.find(name, served)


@pytest.mark.slow
def test_client_model_names_never_reach_the_filesystem(home, monkeypatch):
    touched = []
    real = {f: getattr(os, f) for f in ("stat", "lstat", "open", "access")}
    for f, fn in real.items():
        def spy(path, *a, _fn=fn, **kw):
            if isinstance(path, (str, bytes, os.PathLike)) and "sentinel" in os.fsdecode(path):
                touched.append(os.fsdecode(path))
            return _fn(path, *a, **kw)
        monkeypatch.setattr(os, f, spy)
    names = ["/etc/sentinel-shadow", "/proc/1/sentinel", "./sentinel", "~/sentinel", "sentinel" * 40,
             "/" + "sentinel/" * 40, "a" * 300, "x/" * 200]
    with LocalServer(Home(), model="embedded/target") as srv:
        for name in names:
            r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200 and r.json()["model"] == "embedded/target", (name[:40], r.text[:200])
    with LocalServer(Home(), model="embedded/target", strict_models=True) as srv:
        for name in names:
            r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": "hi"}, timeout=120)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text[:200]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "EMBEDDED/TARGET", "prompt": "hi",
                                                          "max_tokens": 2}, timeout=120)
        assert r.status_code == 200  # a listed name, in any case
    assert not touched, touched


def test_the_http_layer_answers_in_json(home):
    from app.server.connections import Connection

    with LocalServer(EmbeddedCatalog(ModelSettings(max_tokens=2)), model="embedded/target") as srv:
        for path in ("/health", "/v1/models", "/"):  # HEAD wherever GET
            r = httpx.head(srv.url + path, timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == "application/json", path
        r = httpx.head(srv.url + "/v1/chat/completions", timeout=30)
        assert r.status_code == 405 and r.headers["content-type"] == "application/json" and r.headers["allow"]
        r = httpx.get(srv.url + "/v1/chat/completions", timeout=30)
        assert r.status_code == 405 and "POST" in r.headers["allow"]
        assert r.json()["error"]["message"] == "Method Not Allowed"
    # requests h11 itself refuses (a request head over its limit, a malformed line): the server's Connection
    import uvicorn

    from app.server import create_app

    app = create_app(EmbeddedCatalog(ModelSettings()), model=None)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", http=Connection))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        for head in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: aaaaaaaaaaaaaaaa\r\n" * 1500,
                     b"NOT A REQUEST\r\n\r\n"):  # a head past MAX_HEAD_BYTES that never ends; a malformed line
            with socket.create_connection(("127.0.0.1", port), timeout=10) as k:
                k.sendall(head)
                got = b""
                while chunk := k.recv(4096):
                    got += chunk
            status, _, rest = got.partition(b"\r\n")
            headers, _, body = rest.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in headers.lower()
            assert json.loads(body)["error"]["code"] == "invalid_http_request"
    finally:
        srv.should_exit = True
        t.join(10)


@pytest.mark.slow
def test_a_client_that_leaves_is_logged_with_its_tokens(home):
    with LocalServer(EmbeddedCatalog(ModelSettings()), model="embedded/target", log=True) as srv:
        out = srv.app.state.request_log.out = io.StringIO()
        body = {"prompt": "Once upon a time", "max_tokens": 20000, "stream": True,
                "logit_bias": {"2": -100, "0": -100}}  # (no EOS: it runs until the client leaves)
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: {")
                if got >= 8:
                    break  # the client leaves mid-answer

        def logged(n):  # the first n requests' lines: a line is written after its response is sent
            deadline = time.monotonic() + 30
            while len(lines := [ln for ln in out.getvalue().splitlines() if "POST /v1/completions" in ln]) < n \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            return lines

        line = logged(1)[0]
        m = re.search(r" 200 tokens=(\d+) \(client left\) \d+ ms$", line)
        assert m and int(m.group(1)) >= 8, line
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=120)
        assert r.status_code == 200
        line = logged(2)[-1]
        assert " 200 tokens=" in line and "tau=" in line and "client left" not in line
