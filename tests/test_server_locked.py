"""`mlx-dflash serve` with an API key, CORS and a queue of one: a second real
server process (tests/serve_process.py), loading its model on first use."""

import threading
import time

import httpx
import openai
import pytest
from serve_process import Server, api_error

pytestmark = [pytest.mark.timeout(600), pytest.mark.server]


@pytest.fixture(scope="module")
def locked(serve_models):
    s = Server(serve_models[1], "--queue-size", "1", "--max-batch", "1", "--cors", "http://app.example",
               "--strict-models", model=None, key="sekret")  # one row: a second request waits in the queue
    yield s
    s.stop()


@pytest.mark.slow
def test_api_key(locked):
    with pytest.raises(openai.AuthenticationError):
        locked.client("wrong").models.list()
    api_error(httpx.get(locked.url + "/v1/models"), 401)
    api_error(httpx.post(locked.url + "/v1/completions", json={"prompt": "x"}), 401)
    assert httpx.get(locked.url + "/health").status_code == 200  # liveness needs no key
    assert httpx.head(locked.url + "/").status_code == 200  # nor a client's probe of the base URL
    assert httpx.get(locked.url + "/").json() == {"status": "ok"}
    assert [m.id for m in locked.client("sekret").models.list()]


@pytest.mark.slow
def test_cors(locked):
    r = httpx.options(locked.url + "/v1/chat/completions",
                      headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code in (200, 204) and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(locked.url + "/v1/chat/completions",
                      headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


@pytest.mark.slow
def test_the_default_loads_at_start_and_another_model_on_first_use(locked):
    t0 = time.monotonic()  # no --model: the settings' default model loads at start (and what loading measures)
    while locked.metrics()["loaded"] != "qwen":
        assert time.monotonic() - t0 < 120, "the default model was not loaded at start"
        time.sleep(0.2)
    r = locked.client("sekret").completions.create(model="llama", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert locked.metrics()["loaded"] == "llama"  # and it stays
    # a request that names no model gets the settings' default model
    r = httpx.post(locked.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": "Bearer sekret"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "qwen"


def test_strict_models_refuse_unknown_names(locked):
    h = {"Authorization": "Bearer sekret"}
    for name in ("nope", "gpt-4o", "claude-haiku-4-5"):
        e = api_error(httpx.post(locked.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2},
                                 headers=h, timeout=60), 404)
        assert e["code"] == "model_not_found" and name in e["message"]
    r = httpx.post(locked.url + "/v1/completions", json={"model": "QWEN", "prompt": "x", "max_tokens": 2},
                   headers=h, timeout=60)  # a listed model in another spelling is no unknown name
    assert r.status_code == 200 and r.json()["model"] == "qwen"


@pytest.mark.slow
def test_queue_full_is_429(locked):
    h = {"Authorization": "Bearer sekret"}
    long = {"model": "qwen", "prompt": "while True:", "max_tokens": 3000, "temperature": 0, "stream": True}
    queued = {}

    def wait_in_queue():
        queued["r"] = httpx.post(locked.url + "/v1/completions", headers=h, timeout=120,
                                 json={"model": "qwen", "prompt": "ok", "max_tokens": 2})

    with httpx.stream("POST", locked.url + "/v1/completions", json=long, headers=h, timeout=60) as r:
        it = r.iter_lines()
        assert next(ln for ln in it if ln.startswith("data: "))  # the worker is busy with this one
        t = threading.Thread(target=wait_in_queue)
        t.start()
        deadline = time.monotonic() + 60
        while locked.metrics()["queued"] < 1:  # (a stream that ended early would leave nothing queued)
            assert time.monotonic() < deadline and t.is_alive(), queued
            time.sleep(0.05)
        e = api_error(httpx.post(locked.url + "/v1/completions", headers=h, timeout=60,
                            json={"model": "qwen", "prompt": "ok", "max_tokens": 2}), 429)
        assert e["code"] == "queue_full"
    # leaving the stream frees the worker for the queued request
    t.join()
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 2
