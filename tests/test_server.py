"""`mlx-dflash serve`: a real server process on loopback, driven by the official
`openai` client and by raw HTTP (httpx); the process: tests/serve_process.py, a
second server with an API key, CORS and a queue of one: test_server_locked.py."""

import json
import random
import threading
import time

import httpx
import pytest
# ROOT and Server: test_server_security imports them from here
from serve_process import MAX_TOKENS_SETTING, ROOT, SYSTEM, Server, api_error  # noqa: F401

pytestmark = [pytest.mark.timeout(600), pytest.mark.server]


@pytest.fixture(scope="module")
def server(serve_models):
    s = Server(serve_models[1], "--queue-size", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(serve_models):
    """The same model in this process, for reference generations (plain decoding)."""
    from mlx_dflash import generate
    from mlx_dflash import load

    model, tok, _ = load(str(serve_models[0] / "qwen"))

    def chat_prompt(messages):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def run(prompt, n):
        return generate(model, tok, prompt, None, max_tokens=n)

    return tok, chat_prompt, run


def _chat(client, content, n=16, **kw):
    return client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": content}],
                                          max_tokens=n, temperature=0, **kw)


def _check_report(d, finish_cut=False):
    """usage, timings and dflash agree with one another."""
    u, t, f = d["usage"], d["timings"], d["dflash"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert t["predicted_n"] == u["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
    assert t["cache_n"] == f["reused_prompt_tokens"] == u["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0
    assert f["mode"] in ("dflash", "off")
    if f["mode"] == "dflash":
        assert f["max_width"] >= 2 and 1 <= f["width"] <= f["max_width"] and f["fallback"] is None
        assert t["draft_n"] <= f["cycles"] * (f["max_width"] - 1)
        assert f["acceptance_rate"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0)
    if not finish_cut:  # every token after the prefill's came from a verify cycle
        assert f["tau"] * f["cycles"] == pytest.approx(u["completion_tokens"] - 1)


# -- the openai client ------------------------------------------------------------------

@pytest.mark.slow
def test_models_lists_targets_only(server):
    ids = [m.id for m in server.client().models.list()]
    assert {"llama", "qwen"} <= set(ids)  # (plus the embedded target, once it exists)
    assert not [i for i in ids if "drafter" in i or i.endswith("draft-ar")]


@pytest.mark.slow
def test_chat_greedy_equals_engine_and_reports(server, ref):
    _, chat_prompt, run = ref
    r = _chat(server.client(), "Tell me about the sea.", n=20)
    d = r.model_dump()
    # the settings' system prompt is applied when the request has none
    expect = run(chat_prompt([{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Tell me about the sea."}]), 20)
    assert r.choices[0].message.content == expect.text
    assert r.usage.completion_tokens == len(expect.token_ids) == 20
    assert r.usage.prompt_tokens == expect.stats.prompt_tokens
    assert r.choices[0].finish_reason == "length"
    assert d["dflash"]["mode"] == "dflash"
    _check_report(d)


def test_settings_default_max_tokens(server):
    r = server.client().chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Go on"}])
    assert r.usage.completion_tokens == MAX_TOKENS_SETTING
    assert r.choices[0].finish_reason == "length"


def test_completion_and_stream_agree(server, ref):
    _, _, run = ref
    c = server.client()
    r = c.completions.create(model="qwen", prompt="def main():", max_tokens=12, temperature=0)
    expect = run("def main():", 12)
    assert r.choices[0].text == expect.text
    _check_report(r.model_dump())
    chunks = list(c.completions.create(model="qwen", prompt="def main():", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expect.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    token_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
    assert len(token_chunks) == 12  # one chunk per generated token
    _check_report(chunks[-1].model_dump())


@pytest.mark.slow
def test_chat_stream_with_usage(server):
    c = server.client()
    full = _chat(c, "Count with me", n=10)
    chunks = list(_chat(c, "Count with me", n=10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    last = chunks[-1].model_dump()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    _check_report(last)
    # without include_usage there is no usage-only chunk, yet timings ride on the final chunk
    plain = list(_chat(c, "Count with me", n=10, stream=True))
    assert all(ch.choices for ch in plain)
    assert plain[-1].model_dump()["timings"]["predicted_n"] == 10


def test_stop_string(server, ref):
    c = server.client()
    full = c.completions.create(model="qwen", prompt="class A:", max_tokens=16, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    r = c.completions.create(model="qwen", prompt="class A:", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.find(stop)]
    _check_report(r.model_dump(), finish_cut=True)


def test_prefix_reuse_is_lossless(server, ref):
    """A chat client sends the whole conversation again: the cached prefix is reused."""
    _, chat_prompt, run = ref
    c = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    first = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    second = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0)
    d = second.model_dump()
    assert d["dflash"]["reused_prompt_tokens"] >= first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == d["dflash"]["reused_prompt_tokens"]
    assert second.choices[0].message.content == run(chat_prompt(msgs), 8).text  # no cache: same text
    _check_report(d)


@pytest.mark.slow
def test_sampling_with_seed_is_reproducible(server):
    c = server.client()
    kw = dict(model="qwen", prompt="import os", max_tokens=12, temperature=0.9, top_p=0.95,
              extra_body={"top_k": 50, "min_p": 0.02})
    a = c.completions.create(seed=7, **kw)
    b = c.completions.create(seed=7, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.model_dump()["dflash"]["mode"] == "dflash"  # sampling options stay on the DFlash path


def test_logprobs_fall_back_to_plain_decoding_and_say_so(server):
    c = server.client()
    base = _chat(c, "Hello there", n=8)
    r = _chat(c, "Hello there", n=8, logprobs=True, top_logprobs=3)
    d = r.model_dump()
    assert d["dflash"]["mode"] == "off" and "logprobs" in d["dflash"]["fallback"]
    assert r.choices[0].message.content == base.choices[0].message.content  # greedy either way
    lp = r.choices[0].logprobs.content
    assert len(lp) == 8 and "".join(e.token for e in lp) == base.choices[0].message.content
    for e in lp:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the top one
    cr = c.completions.create(model="qwen", prompt="x = 1", max_tokens=4, temperature=0, logprobs=2)
    assert len(cr.choices[0].logprobs.tokens) == 4
    assert all(len(t) == 2 for t in cr.choices[0].logprobs.top_logprobs)


@pytest.mark.slow
def test_penalties_are_applied_not_ignored(server):
    c = server.client()
    base = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=24, temperature=0)
    pen = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=24, temperature=0,
                               frequency_penalty=2.0, presence_penalty=2.0)
    d = pen.model_dump()
    # the verify applies the penalties per row: DFlash stays on (only logprobs decode plainly)
    assert d["dflash"]["mode"] == "dflash" and d["dflash"]["fallback"] is None
    base_tokens = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=24, temperature=0,
                                       logprobs=0).choices[0].logprobs.tokens
    pen_tokens = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=24, temperature=0,
                                      logprobs=0, frequency_penalty=2.0,
                                      presence_penalty=2.0).choices[0].logprobs.tokens
    assert pen_tokens != base_tokens
    # a strong presence penalty makes a repeat rarer than without it
    assert len(set(pen_tokens)) > len(set(base_tokens))
    assert pen.choices[0].text != base.choices[0].text
    # logit_bias forces a token
    tok_id = 300
    r = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=3, temperature=0,
                             logit_bias={str(tok_id): 100}, logprobs=0)
    assert "logprobs" in r.model_dump()["dflash"]["fallback"]  # (logprobs: plain decoding)
    assert r.usage.completion_tokens == 3 and len(set(r.choices[0].logprobs.tokens)) == 1
    b = c.completions.create(model="qwen", prompt="def f(a, b):", max_tokens=3, temperature=0,
                             logit_bias={str(tok_id): 100})  # without logprobs: on DFlash, the same tokens
    assert b.model_dump()["dflash"]["mode"] == "dflash" and b.choices[0].text == r.choices[0].text


@pytest.mark.slow
def test_eight_parallel_streams(server):
    c = server.client()
    prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    expect = {p: c.completions.create(model="qwen", prompt=p, max_tokens=10, temperature=0).choices[0].text
              for p in prompts}
    out, errors = {}, []

    def worker(i):
        try:
            p = prompts[i % len(prompts)]
            s = c.completions.create(model="qwen", prompt=p, max_tokens=10, temperature=0, stream=True,
                                     stream_options={"include_usage": True})
            chunks = list(s)
            out[i] = (p, "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(out) == 8
    for p, text, usage in out.values():
        assert text == expect[p] and usage.completion_tokens == 10


@pytest.mark.slow
def test_switching_models(server):
    c = server.client()
    r = c.completions.create(model="llama", prompt="hello", max_tokens=5, temperature=0)
    assert r.model == "llama" and r.usage.completion_tokens == 5
    assert r.model_dump()["dflash"]["mode"] == "dflash"
    assert server.metrics()["loaded"] == "llama"
    r2 = c.completions.create(model="qwen", prompt="hello", max_tokens=5, temperature=0)
    assert r2.model == "qwen"
    m = server.metrics()["models"]
    assert m["llama"]["requests"] >= 1 and m["qwen"]["requests"] >= 1
    assert m["qwen"]["completion_tokens"] > 0 and m["qwen"]["cycles"] > 0


# -- raw HTTP -------------------------------------------------------------------------------

@pytest.mark.slow
def test_bad_requests(server):
    u = server.url + "/v1"
    json_type = {"Content-Type": "application/json"}  # httpx sets it for json= only
    post = lambda path, **kw: httpx.post(u + path, timeout=60, headers=json_type, **kw)  # noqa: E731
    msgs = [{"role": "user", "content": "hi"}]
    api_error(post("/chat/completions", content=b"{not json"), 400)
    api_error(post("/chat/completions", content=b"\xff\xfe"), 400)
    api_error(post("/chat/completions", json=[1, 2]), 400)
    api_error(post("/chat/completions", json={"model": "qwen"}), 400)  # no messages
    e = api_error(post("/chat/completions", json={"model": "qwen", "messages": msgs, "temperature": "hot"}), 400)
    assert e["param"] == "temperature"
    e = api_error(post("/chat/completions", json={"model": "qwen", "messages": msgs, "modalities": ["audio"]}), 400)
    assert e["param"] == "modalities" and e["code"] == "unsupported_parameter"  # never silently ignored
    api_error(post("/chat/completions", json={"model": "qwen", "messages": msgs, "n": 2}), 400)
    api_error(post("/chat/completions", json={"model": "qwen", "messages": msgs, "top_p": 0}), 400)
    api_error(post("/chat/completions", json={"model": "qwen", "messages": msgs, "max_tokens": 0}), 400)
    api_error(post("/completions", json={"model": "qwen", "prompt": ["a", "b"]}), 400)
    api_error(post("/completions", json={"model": "qwen", "prompt": [1, 10**6]}), 400)
    api_error(post("/completions", json={"model": "qwen", "prompt": ""}), 400)
    r = post("/chat/completions", json={"model": "nope", "messages": msgs, "max_tokens": 2})  # any name works:
    assert r.status_code == 200 and r.json()["model"] == "qwen"  # the served model answers, and says so
    api_error(post("/chat/completions", json={"model": "qwen-drafter", "messages": msgs}), 404)  # not a target
    e = api_error(post("/completions", json={"model": "qwen", "prompt": [5] * 5000}), 400)
    assert e["code"] == "context_length_exceeded"
    api_error(httpx.get(u + "/nowhere"), 404)
    # still serving
    r = post("/completions", json={"model": "qwen", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_disconnect_cancels_generation(server):
    before = server.metrics()["models"]["qwen"]
    body = {"model": "qwen", "prompt": "while True:", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        got = [ln for ln in (next(it) for _ in range(6)) if ln.startswith("data: ")]
        assert got  # mid-stream: leave now
    def served_next(cancelled: int):  # the next request is served; then the counters
        r = httpx.post(server.url + "/v1/completions", json={"model": "qwen", "prompt": "ok", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
        # a batching server serves it beside the request being cancelled: its counters may lag a cycle
        deadline = time.monotonic() + 30
        m = server.metrics()["models"]["qwen"]
        while m["cancelled"] < cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
            m = server.metrics()["models"]["qwen"]
        return m

    # the worker notices, stops, and serves the next request
    after = served_next(before["cancelled"] + 1)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < 3000 - 100
    # a non-streaming client that gives up waiting cancels its generation too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4000},
                   timeout=httpx.Timeout(60, read=0.5))
    last = served_next(after["cancelled"] + 1)
    assert last["cancelled"] == after["cancelled"] + 1
    assert last["completion_tokens"] - after["completion_tokens"] < 4000 - 100


@pytest.mark.slow
def test_fuzz_never_500(server, ref):
    rng = random.Random(1234)
    msgs = [{"role": "user", "content": "hi"}]
    junk = [None, True, -1, 0, 1.5, 1e308, -1e308, "x", "", [], {}, [None], {"a": 1}, [[[]]], "\u0000",
            "\ud800", 2**70, -(2**70)]
    fields = {
        "model": junk, "messages": junk + [[{"role": "robot", "content": "x"}], [{"content": "x"}],
                                           [{"role": "user"}], [{"role": "user", "content": 5}],
                                           [{"role": "user", "content": [{"type": "image_url"}]}]],
        "prompt": [None, True, 1.5, {}, [1.5], [True], [[1, 2], [3]], [-1], [10**9], ["a", "b"], [[]]],
        "max_tokens": [0, -5, 1.5, "3", True, [], -(2**64)],
        "temperature": [-0.1, "0", 1e9, [], True, 1e-40], "top_p": [0, -1, 1.01, "1", {}], "top_k": [-1, 2.5, "5"],
        "min_p": [-0.1, 1, 1.5, "0"], "seed": [-1, 2**64, 1.5, "7"], "stop": [5, [1], [None], ["a"] * 40, {}],
        "stream": ["yes", 1, [], 2], "n": [0, 2, "1", -1],
        "logprobs": [7, -1, "true", 1.5], "top_logprobs": [-1, 50, "3"],
        "frequency_penalty": [-3, 3, "x"], "presence_penalty": [5, "y"], "logit_bias": [{"a": 1}, {"1": 500}, [],
                                                                                      {"1": "x"}, {"99999": 1}],
        "stream_options": [{"include_usage": "yes"}, {"x": 1}, 5], "tools": [[]], "bogus": [1],
        "echo": [True, "no"], "best_of": [2, 0],
    }
    raw_bodies = [b"", b"{", b"null", b"[]", b'"s"', b"12", b"\xff\xfe\xfd", b'{"a":' * 50, b"[" * 100000,
                  b'{"model": "qwen", "messages": NaN}', b'{"prompt": "x", "max_tokens": Infinity}']
    statuses = []
    http = httpx.Client(base_url=server.url, timeout=60)
    for i in range(240):
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        if i % 12 == 0:
            content = rng.choice(raw_bodies)
        else:
            body = {"model": "qwen", "max_tokens": 2}
            body["messages" if i % 2 else "prompt"] = msgs if i % 2 else "hello"
            # one or more fields set to something invalid for this endpoint
            # (messages on /v1/completions or prompt on chat: an unsupported field)
            for k in rng.sample(sorted(fields), rng.randint(1, 3)):
                body[k] = rng.choice(fields[k])
            content = json.dumps(body, allow_nan=True).encode()
        r = http.post(path, content=content,
                      headers={"content-type": rng.choice(["application/json", "text/plain", "x/y"])})
        statuses.append(r.status_code)
        assert r.status_code < 500, (content[:200], r.text)
        if r.status_code != 200:
            api_error(r, r.status_code)
    assert statuses.count(200) <= len(statuses) // 10  # the fuzz is mostly malformed requests
    assert len(statuses) >= 200
    http.close()
    # and the server still answers correctly
    _, chat_prompt, run = ref
    r = _chat(server.client(), "Tell me about the sea.", n=20)
    expect = run(chat_prompt([{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Tell me about the sea."}]), 20)
    assert r.choices[0].message.content == expect.text


@pytest.mark.slow
def test_eos_ends_the_stream(server, ref):
    tok = ref[0]
    eos = str(sorted(tok.eos_token_ids)[0])
    c = server.client()
    r = _chat(c, "Stop now", n=8, logit_bias={eos: 100})  # the model's first token is EOS
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 0
    chunks = list(_chat(c, "Stop now", n=8, logit_bias={eos: 100}, stream=True))
    assert [ch.choices[0].finish_reason for ch in chunks] == [None, "stop"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
