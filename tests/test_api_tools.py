"""Tool calls in /v1/chat/completions, with the official `openai` client against
a real server (tests/scripted.py: a scripted target through the real engine,
a Qwen-style tool template, mlx-lm's json_tools parser)."""

import json

import httpx
import openai
import pytest
from scripted import script_server, tool_call_text

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


srv = script_server(KEY)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(client, content, **kw):
    msgs = kw.pop("messages", None) or [{"role": "user", "content": content}]
    return client.chat.completions.create(model="script", messages=msgs, **kw)


@pytest.mark.slow
def test_tool_round_trip(client):
    user = {"role": "user", "content": "RAW:" + tool_call_text()}
    r = client.chat.completions.create(model="script", messages=[user], tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    [c] = ch.message.tool_calls
    assert c.type == "function" and c.function.name == "get_weather" and c.id
    assert json.loads(c.function.arguments) == {"city": "Paris"}
    d = r.model_dump()
    assert d["dflash"]["mode"] == "dflash" and d["dflash"]["tau"] > 1  # the drafter knows the script
    # the result goes back as a tool message; the model answers from it
    msgs = [user, ch.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21C"}]
    r2 = client.chat.completions.create(model="script", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Answer: sunny, 21C"
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix was kept


def test_tool_round_trip_streamed(client):
    user = {"role": "user", "content": "RAW:Checking. " + tool_call_text()}
    chunks = list(client.chat.completions.create(model="script", messages=[user], tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == "Checking. "
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert finish == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0
    msgs = [user, {"role": "assistant", "content": text, "tool_calls": [
        {"id": calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"}]
    out = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="script", messages=msgs, tools=TOOLS, stream=True) if c.choices)
    assert out == "Answer: rain"


def test_parallel_calls(client):
    raw = "RAW:" + tool_call_text() + tool_call_text("get_time", {"zone": "UTC"})
    r = ask(client, raw, tools=TOOLS)
    names = [c.function.name for c in r.choices[0].message.tool_calls]
    assert names == ["get_weather", "get_time"] and r.choices[0].finish_reason == "tool_calls"
    chunks = list(ask(client, raw, tools=TOOLS, stream=True))
    idx = [tc.index for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert idx == [0, 1]
    one = ask(client, raw, tools=TOOLS, parallel_tool_calls=False)  # generation stops after the first call
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < r.usage.completion_tokens


@pytest.mark.parametrize("bad", ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {oops\n</tool_call>",
                                 "<tool_call>\n[1, 2]\n</tool_call>",
                                 "Sure <tool_call>\n{\"name\": \"get_weather\""])  # unclosed at EOS
def test_malformed_call_comes_back_as_text(client, bad):
    r = ask(client, "RAW:" + bad, tools=TOOLS)
    assert r.choices[0].message.content == bad
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, "RAW:" + bad, tools=TOOLS, stream=True)
                       if c.choices)
    assert streamed == bad


def test_tool_choice(client):
    raw = "RAW:" + tool_call_text()
    none = ask(client, raw, tools=TOOLS, tool_choice="none")  # tools not shown, nothing parsed
    assert none.choices[0].message.content == tool_call_text() and not none.choices[0].message.tool_calls
    auto = ask(client, raw, tools=TOOLS)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # the tools were not in the prompt
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = ask(client, raw, tools=TOOLS, tool_choice=choice)  # the call is opened in the prompt
        [c] = r.choices[0].message.tool_calls
        assert c.function.name == "get_weather" and json.loads(c.function.arguments) == {"city": "Paris"}
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        ask(client, raw, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        ask(client, raw, tool_choice="required")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
          "required": ["city", "temp"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


def test_structured_output_constrains_the_decode(client):
    pytest.importorskip("llguidance")
    good = '{"city":"Paris","temp":21}'
    r = ask(client, "RAW:" + good, response_format=JSON_SCHEMA)  # what the model wants is valid (compact): untouched
    assert r.choices[0].message.content == good and r.choices[0].finish_reason == "stop"
    d = r.model_dump()["dflash"]
    assert d["mode"] == "dflash" and d["fallback"] is None and d["tau"] > 1  # the verify applies the mask
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(
        client, "RAW:" + good, response_format=JSON_SCHEMA, stream=True) if c.choices)
    assert streamed == good
    # what the model wants breaks the schema: each bad token is masked out
    bad = ask(client, 'RAW:{"city":5,"temp":1}', response_format=JSON_SCHEMA, max_tokens=12)
    assert bad.choices[0].message.content.startswith('{"city":') and '5' not in bad.choices[0].message.content
    extra = ask(client, 'RAW:{"city":"Oslo","temp":3,"wind":2}', response_format=JSON_SCHEMA, max_tokens=30)
    assert extra.choices[0].message.content.startswith('{"city":"Oslo","temp":3')
    assert "wind" not in extra.choices[0].message.content
    obj = ask(client, 'RAW:{"a":[1,2]}', response_format={"type": "json_object"})
    assert json.loads(obj.choices[0].message.content) == {"a": [1, 2]}
    arr = ask(client, "RAW:[1,2]", response_format={"type": "json_object"}, max_tokens=8)
    assert arr.choices[0].message.content.startswith("{")  # an object, not the array the model wanted


def test_structured_output_without_llguidance_is_a_clear_400(client, monkeypatch):
    from app.server import structured

    monkeypatch.setattr(structured, "_llguidance", lambda: None)  # as on a server without the package
    with pytest.raises(openai.BadRequestError, match="pip install llguidance") as e:
        ask(client, "hi", response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and e.value.body["code"] == "unsupported_parameter"


def test_structured_output_errors(client):
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as e:
        ask(client, "hi", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                  "schema": {"type": "frob"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="schema"):
        ask(client, "hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert ask(client, "hi", response_format={"type": "text"}).choices[0].message.content == "Echo: hi"


def test_auth_error_in_openai_format(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="script", messages=[{"role": "user", "content": "x"}])


def test_second_conversation_reuses_system_prompt(srv, client):
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    ask(client, None, messages=[system, {"role": "user", "content": "first question"}], tools=TOOLS)
    warm = ask(client, None, messages=[system, {"role": "user", "content": "another one"}], tools=TOOLS)
    assert warm.usage.prompt_tokens_details.cached_tokens > 60
    assert warm.model_dump()["timings"]["cache_n"] == warm.usage.prompt_tokens_details.cached_tokens
    srv.worker.store.clear()  # a cold run of the same request
    cold = ask(client, None, messages=[system, {"role": "user", "content": "another one"}], tools=TOOLS)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content == "Echo: another one"
    pc = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).json()["models"]["script"]
    assert pc["prompt_cache"]["entries"] >= 1 and 0 < pc["prompt_cache"]["bytes"] <= pc["prompt_cache"]["budget"]
    assert pc["prompt_cache"]["hits"] >= 1


N_FUZZ = 60  # mutated bodies per run (600 passed once when this was written)


@pytest.mark.slow
def test_fuzz_never_500(srv):
    import random

    from scripted import mutations

    rng = random.Random(3)
    body = {"model": "script", "max_tokens": 8, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "noon"}]}
    for b in mutations(body, rng, N_FUZZ):
        r = httpx.post(srv.url + "/v1/chat/completions", json=b, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code in (200, 400, 404), (b, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"], r.text



def test_chat_stream_event_order(srv):
    body = {"model": "script", "messages": [{"role": "user", "content": "RAW:Ok. " + tool_call_text()}], "tools": TOOLS,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = ["tool" if "tool_calls" in d else "text" if d.get("content") else "end" for d in deltas[1:]]
    assert kinds == ["text"] * kinds.count("text") + ["tool", "end"]  # text, then the call, then the finish
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and "dflash" in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
