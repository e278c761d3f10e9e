"""Long prompts in `serve` (issue 23): the prefill's progress as SSE comment
lines on the streams of all three APIs (before the first token; the official
SDKs skip them), and a client that leaves mid-prefill frees the worker after the
chunk in flight, the chunks done kept in the prompt store. On the scripted
target (tests/scripted.py), whose forwards this file logs in order."""

import json
import threading
import time

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from scripted import LocalServer, ScriptCatalog, ScriptModel, tool_tokenizer
from tiers import fast_first

pytestmark = [pytest.mark.timeout(300), pytest.mark.server]

KEY = "sk-test"
LONG = "hello there " * 875  # about 7,000 tokens: four prefill chunks of 2,048
STEP = 2048  # DecodeConfig's prefill_step_size


class LoggedModel(ScriptModel):
    """The scripted target with a longer context, logging each forward's row
    count; `hook.gate(rows)` (when set) runs before a forward."""

    def __init__(self, script, vocab, hook):
        super().__init__(script, vocab)
        self.args.max_position_embeddings = 16384
        self.hook = hook

    def __call__(self, inputs, cache=None):
        self.hook.log.append(("forward", inputs.shape[1]))
        if self.hook.gate is not None:
            self.hook.gate(inputs.shape[1])
        return super().__call__(inputs, cache)


class Hook:
    def __init__(self):
        self.log, self.gate = [], None


class LoggedCatalog(ScriptCatalog):
    def __init__(self, tok, hook):
        super().__init__(tok, budget_mb=256, max_tokens=8)
        self.hook = hook

    def load(self, model_id):
        lm = super().load(model_id)
        lm.model = LoggedModel(self.script, len(self.tok.get_vocab()), self.hook)
        mx.eval(lm.model.parameters())
        return lm


@pytest.fixture(scope="module")
def long_srv(pairs, tmp_path_factory):
    tok = tool_tokenizer(pairs() / "target", tmp_path_factory.mktemp("tok"))
    hook = Hook()
    with LocalServer(LoggedCatalog(tok, hook), api_key=KEY) as s:
        s.hook, s.tok = hook, tok
        yield s


def _headers():
    return {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}


def _progress(line: str):
    """(done, total) of a progress comment line, else None."""
    if line.startswith(": prefill "):
        done, total = line[len(": prefill "):].split("/")
        return int(done), int(total)
    return None


REQUESTS = {  # path -> (a streamed request with the long prompt, is this data line a token of the answer?)
    "/v1/chat/completions": ({"model": "script", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8,
                              "stream": True},
                             lambda d: bool(d.get("choices") and d["choices"][0]["delta"].get("content"))),
    "/v1/messages": ({"model": "script", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8,
                      "stream": True},
                     lambda d: d.get("type") == "content_block_delta"),
    "/v1/responses": ({"model": "script", "input": LONG, "max_output_tokens": 8, "stream": True},
                      lambda d: d.get("type") == "response.output_text.delta"),
}


@pytest.mark.parametrize("path", fast_first(list(REQUESTS)))
def test_streams_send_prefill_progress_before_the_first_token(long_srv, path):
    body, is_token = REQUESTS[path]
    long_srv.worker.store.clear()  # nothing cached: the whole prompt is prefilled
    with httpx.stream("POST", long_srv.url + path, json=body, headers=_headers(), timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    steps = [p for p in map(_progress, lines) if p is not None]
    first_token = next(i for i, ln in enumerate(lines) if ln.startswith("data: ") and ln != "data: [DONE]"
                       and is_token(json.loads(ln[6:])))
    last_progress = max(i for i, ln in enumerate(lines) if _progress(ln) is not None)
    assert last_progress < first_token  # all of them while the prompt is read
    total = steps[-1][1]
    assert total > 3 * STEP and steps[0] == (STEP, total) and steps[-1] == (total, total)
    assert [d for d, _ in steps] == sorted(d for d, _ in steps) and {t for _, t in steps} == {total}


@pytest.mark.slow
def test_sdks_parse_streams_with_progress_comments(long_srv):
    oai = openai.OpenAI(base_url=long_srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ant = anthropic.Anthropic(base_url=long_srv.url, api_key=KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": LONG}]
    whole = oai.chat.completions.create(model="script", messages=msgs, max_tokens=8).choices[0].message.content
    assert whole.startswith("Echo: hel")
    long_srv.worker.store.clear()
    parts = [c.choices[0].delta.content or "" for c in
             oai.chat.completions.create(model="script", messages=msgs, max_tokens=8, stream=True) if c.choices]
    assert "".join(parts) == whole
    long_srv.worker.store.clear()
    with ant.messages.stream(model="script", max_tokens=8, messages=msgs) as s:
        assert "".join(s.text_stream) == whole
    long_srv.worker.store.clear()
    with oai.responses.stream(model="script", input=msgs, max_output_tokens=8) as s:
        for _ in s:
            pass
        assert s.get_final_response().output_text == whole


@pytest.mark.slow
def test_disconnect_during_prefill_frees_the_worker_after_the_chunk_in_flight(long_srv):
    """The client leaves after the first chunk's progress; the second chunk (in
    flight: held until the server has seen the disconnect) is the last forward of
    that request, and the next request's forwards follow at once. The chunks done
    stay cached: the same prompt again reuses them."""
    hook, worker = long_srv.hook, long_srv.worker
    # (the forwards logged below are the requests' only: no cost measurement while idle from here on)
    if worker.engine is not None:
        worker.engine.stop_measuring()
    worker.store.clear()
    before = worker.snapshot()["script"]["cancelled"]
    body = {"model": "script", "prompt": LONG, "max_tokens": 8, "stream": True}
    seen = threading.Event()

    def gate(rows):  # the second chunk waits until the server knows the client left
        if rows == STEP and sum(1 for e in hook.log if e == ("forward", STEP)) == 2:
            t0 = time.monotonic()
            while not any(j.cancel.is_set() for j in list(worker.inflight.values())):
                assert time.monotonic() - t0 < 60, "the server did not notice the disconnect"
                time.sleep(0.01)
            seen.set()

    hook.log.clear()
    hook.gate = gate
    try:
        with httpx.stream("POST", long_srv.url + "/v1/completions", json=body, headers=_headers(), timeout=120) as r:
            for ln in r.iter_lines():
                if _progress(ln):
                    break  # the first chunk is done: leave
        assert seen.wait(60)
        hook.log.append("next request")
        r2 = httpx.post(long_srv.url + "/v1/completions", json={"model": "script", "prompt": "ok", "max_tokens": 2},
                        headers=_headers(), timeout=120)
        assert r2.status_code == 200
    finally:
        hook.gate = None
    mark = hook.log.index("next request")
    # the long request: its first two chunks, nothing after (no third chunk, no first token)
    assert hook.log[:mark] == [("forward", STEP), ("forward", STEP)]
    assert hook.log[mark + 1:] and all(e[0] == "forward" for e in hook.log[mark + 1:])
    assert worker.snapshot()["script"]["cancelled"] == before + 1
    # the two chunks were kept: the same prompt again starts after them
    again = httpx.post(long_srv.url + "/v1/completions", json={**body, "stream": False}, headers=_headers(),
                       timeout=120).json()
    assert again["usage"]["prompt_tokens"] > 3 * STEP
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * STEP
