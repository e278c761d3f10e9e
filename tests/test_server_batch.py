"""`serve --max-batch 4`: requests decode together (app/server/batcher.py) and
every answer is what the request gets alone. The single-stream server tests
(test_server.py) run again here against a batching server, except those about
the prompt store (test_batched_turns_reuse_cached_prefixes_and_equal_alone
below: batched requests take and give back cached prefixes)."""

import os
import subprocess
import sys
import threading

import httpx
import pytest
from pair_server import PairCatalog
from serve_process import ROOT, Server
from test_server import (  # noqa: F401  (collected here, against the batching server below)
    ref,
    test_bad_requests,
    test_chat_greedy_equals_engine_and_reports,
    test_chat_stream_with_usage,
    test_completion_and_stream_agree,
    test_disconnect_cancels_generation,
    test_eight_parallel_streams,
    test_eos_ends_the_stream,
    test_logprobs_fall_back_to_plain_decoding_and_say_so,
    test_penalties_are_applied_not_ignored,
    test_sampling_with_seed_is_reproducible,
    test_settings_default_max_tokens,
    test_sse_wire_format,
    test_stop_string,
    test_switching_models,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.server]


@pytest.fixture(scope="module")
def server(serve_models):
    s = Server(serve_models[1], "--queue-size", "8", "--max-batch", "4")
    yield s
    s.stop()


@pytest.mark.slow
def test_sixteen_concurrent_clients_each_get_their_own_answer(server, ref):
    """16 clients at once (4 decode together, the rest wait in the queue of 8 or
    are told 429): no 5xx; every answer served is the request's text alone;
    /metrics shows the batch's occupancy."""
    _, _, run = ref
    prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta", "one two", "import os", "def f(x):",
               "The sea is"]
    expect = {p: run(p, 12).text for p in prompts}
    out, codes = {}, []
    lock = threading.Lock()

    def client(i):
        p = prompts[i % len(prompts)]
        r = httpx.post(server.url + "/v1/completions", json={"model": "qwen", "prompt": p, "max_tokens": 12,
                                                              "temperature": 0}, timeout=600)
        with lock:
            codes.append(r.status_code)
            if r.status_code == 200:
                out[i] = (p, r.json()["choices"][0]["text"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [c for c in codes if c >= 500]
    assert all(c in (200, 429) for c in codes) and len(out) >= 12  # 4 rows + 8 queued + 1 admitted
    for p, text in out.values():
        assert text == expect[p], p
    b = server.metrics()["batch"]
    assert b["max_batch"] == 4 and 2 <= b["peak_rows"] <= 4


@pytest.mark.slow
def test_max_batch_auto_measures_and_says_what_it_picked(serve_models, ref):
    """`serve --max-batch auto` (the default): the size is measured for the model
    at startup, said in one log line and in /metrics; a request that arrives
    alone is served alone with the prompt cache; answers are unchanged."""
    s = Server(serve_models[1], "--max-batch", "auto")
    try:
        b = s.metrics()["batch"]
        for _ in range(600):  # the warm-up job loads, then measures
            if b.get("auto", "not measured yet") != "not measured yet":
                break
            threading.Event().wait(0.5)
            b = s.metrics()["batch"]
        size = b["max_batch"]
        assert size in (1, 2, 4, 8, 16) and b["auto"].startswith(f"{size} (")
        said = [l for l in s.log.read_text().splitlines() if "max_batch auto" in l]
        assert len(said) == 1 and f": {size} (" in said[0]
        _, _, run = ref

        def ask(p):
            r = httpx.post(s.url + "/v1/completions", json={"model": "qwen", "prompt": p, "max_tokens": 8,
                                                             "temperature": 0}, timeout=600)
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None

        # one request at a time: served alone, with the prompt cache (the second one hits it)
        assert ask("alpha") == ask("alpha") == (200, run("alpha", 8).text)
        assert s.metrics()["models"]["qwen"]["prompt_cache"]["hits"] >= 1
        prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta", "one two", "import os"]
        got = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, ask(p))) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in prompts:  # overlapping requests (batched when the size is > 1): each the request alone
            assert got[p] == (200, run(p, 8).text), p
        if size > 1:  # the batch was made: how it prefills new requests was measured once, and said
            said = [l for l in s.log.read_text().splitlines() if "prefill of new requests" in l]
            assert len(said) == 1 and s.metrics()["batch"]["prefill"] in said[0]
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("value,message", [("many", "auto or an integer"), ("0", "auto or in 1..64")])
def test_bad_max_batch_is_one_line(serve_models, value, message):
    env = {**os.environ, "MLX_DFLASH_HOME": str(serve_models[1])}
    r = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--max-batch", value], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_auto_serves_alone_with_the_prompt_cache_and_batches_overlaps(pairs, monkeypatch):
    """In process, the auto size forced to 4 (the measurement itself is tested
    above): a request that arrives alone is served alone, reusing the prompt
    cache; overlapping requests decode together; every answer is the request's
    own (greedy, as served alone with max_batch 1)."""
    import openai
    from scripted import LocalServer

    from app.server import worker as worker_module

    monkeypatch.setattr(worker_module, "auto_max_batch", lambda model, drafter, book=None: (4, "forced by the test"))
    qs = ["Tell me about lists.", "Tell me about dicts.", "And sets?", "What is a tuple?", "Explain loops.",
          "Name a prime."]

    def ask(url, q):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        return c.chat.completions.create(model="pair", temperature=0, max_tokens=12,
                                         messages=[{"role": "user", "content": q}]).choices[0].message.content

    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch=1) as srv:
        want = {q: ask(srv.url, q) for q in qs}
    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch="auto") as srv:
        assert ask(srv.url, qs[0]) == ask(srv.url, qs[0]) == want[qs[0]]
        assert srv.worker.store.stats.hits >= 1  # served alone, from the prompt cache
        got = {}
        threads = [threading.Thread(target=lambda q=q: got.__setitem__(q, ask(srv.url, q))) for q in qs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == want
        b = srv.worker.batch_summary()
        assert b["auto"] == "4 (forced by the test)" and b["max_batch"] == 4


TURNS = ["Tell me about lists.", "And dicts?", "Which one is faster?"]


def _chat(url, msgs):
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "pair", "temperature": 0, "max_tokens": 12, "messages": msgs})
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens_details"]["cached_tokens"], \
        j["dflash"]["reused_prompt_tokens"]


def _conversation(url, before=None):
    """TURNS as one conversation, greedy: [(answer, cached tokens, dflash reused tokens)],
    then one more turn through the Anthropic API (answer, cache_read_input_tokens);
    `before(i)` runs before turn i."""
    msgs, got = [], []
    for i, q in enumerate(TURNS):
        msgs.append({"role": "user", "content": q})
        if before is not None:
            before(i)
        got.append(_chat(url, msgs))
        msgs.append({"role": "assistant", "content": got[-1][0]})
    # the next turn through the Anthropic API: its cache_read_input_tokens
    r = httpx.post(url + "/v1/messages", timeout=300, json={
        "model": "pair", "max_tokens": 12, "temperature": 0, "messages": msgs + [{"role": "user", "content": "Why?"}]})
    assert r.status_code == 200, r.text
    j = r.json()
    got.append((j["content"][0]["text"] if j["content"] else "", j["usage"]["cache_read_input_tokens"]))
    return got


def _alone_reference(pairs):
    from scripted import LocalServer

    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch=1) as srv:
        return _conversation(srv.url), srv.worker.store.stats.hits


@pytest.mark.slow
def test_batched_turns_reuse_cached_prefixes_and_equal_alone(pairs):
    """In process, max_batch 4 (every request decodes in the batch): a
    conversation's turns take the prompt store's cached prefix, the second one
    while a long request decodes beside it; each answer, its cached-token count
    (usage, dflash stats) and the store's hits equal those of a server that
    serves one request at a time (max_batch 1, the single-stream prompt cache)."""
    from scripted import LocalServer

    want, hits = _alone_reference(pairs)
    assert 0 < want[1][1] < want[2][1] < want[3][1]  # the single-stream turns hit the store
    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch=4) as srv:
        background = []

        def start_long(i):  # a long request decoding when the second turn arrives
            if i != 1:
                return
            first = threading.Event()

            def run():
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=300, json={
                        "model": "pair", "prompt": "Write a long story about a lighthouse.", "max_tokens": 400,
                        "temperature": 0, "stream": True}) as r:
                    for _ in r.iter_lines():
                        first.set()
                first.set()

            t = threading.Thread(target=run)
            t.start()
            background.append(t)
            first.wait(300)

        got = _conversation(srv.url, start_long)
        for t in background:
            t.join()
        assert got == want
        assert srv.worker.store.stats.hits == hits
        assert srv.worker.batch_summary()["peak_rows"] >= 2  # the second turn decoded beside the long request


@pytest.mark.slow
def test_auto_turns_share_the_prompt_store(pairs, monkeypatch):
    """max_batch auto (size forced to 4): a conversation's turns, each a set of
    one on the model's one engine, take and store their caches as a
    one-at-a-time server does: its answers and cached counts."""
    from scripted import LocalServer

    from app.server import worker as worker_module

    want, hits = _alone_reference(pairs)
    monkeypatch.setattr(worker_module, "auto_max_batch", lambda model, drafter, book=None: (4, "forced by the test"))
    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch="auto") as srv:
        got = _conversation(srv.url)
        assert got == want
        assert srv.worker.store.stats.hits == hits
        assert srv.worker.batch_summary()["max_batch"] == 4


@pytest.mark.slow
def test_logprobs_requests_use_the_prompt_store(pairs):
    """Requests that decode plainly (logprobs) on a batching server: from the
    prompt store's longest cached prefix, their caches stored back for the next
    turn; their answers and log-probabilities are those of a one-at-a-time server."""
    from scripted import LocalServer

    def turns(url):
        msgs, out = [], []
        for q in ("Tell me about the sea.", "And the sky?", "Why?"):
            msgs.append({"role": "user", "content": q})
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "model": "pair", "temperature": 0, "max_tokens": 8, "messages": msgs, "logprobs": True})
            assert r.status_code == 200, r.text
            j = r.json()
            text = j["choices"][0]["message"]["content"]
            out.append((text, [round(e["logprob"], 3) for e in j["choices"][0]["logprobs"]["content"]],
                        j["usage"]["prompt_tokens_details"]["cached_tokens"]))
            msgs.append({"role": "assistant", "content": text})
        return out

    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch=1) as srv:
        want = turns(srv.url)
    with LocalServer(PairCatalog(pairs(), 1 << 30), model="pair", max_batch=4) as srv:
        got = turns(srv.url)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[0][2] == 0 and 0 < got[1][2] < got[2][2]  # turns 2 and 3 from the stored prefix
