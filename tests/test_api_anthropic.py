"""/v1/messages (Anthropic Messages API) with the official `anthropic` client
against a real server (tests/scripted.py: scripted target, real engine)."""

import json
import re

import anthropic
import httpx
import pytest
from scripted import script_server, tool_call_text

pytestmark = pytest.mark.timeout(300)

KEY = "sk-ant-test"
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = tool_call_text()


srv = script_server(KEY)


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


def send(client, content, **kw):
    msgs = kw.pop("messages", None) or [{"role": "user", "content": content}]
    return client.messages.create(model="script", max_tokens=kw.pop("max_tokens", 200), messages=msgs, **kw)


@pytest.mark.slow
def test_text_message(client):
    m = send(client, "hello", system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Echo: hello"
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    assert m.model_dump()["dflash"]["mode"] == "dflash"


def test_tool_round_trip(client):
    user = {"role": "user", "content": "RAW:I will check. " + CALL}
    m = send(client, None, messages=[user], tools=TOOLS, system=[{"type": "text", "text": "Use tools.",
                                                                   "cache_control": {"type": "ephemeral"}}])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "I will check. "
    tu = m.content[1]
    assert tu.name == "get_weather" and tu.input == {"city": "Paris"} and tu.id.startswith("toolu_")
    msgs = [user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id,
                                          "content": [{"type": "text", "text": "foggy"}]}]}]
    m2 = send(client, None, messages=msgs, tools=TOOLS, system="Use tools.")
    assert m2.content[0].text == "Answer: foggy" and m2.stop_reason == "end_turn"
    assert m2.usage.cache_read_input_tokens > 0


def test_stream_event_order_and_tool_round_trip(client):
    user = {"role": "user", "content": "RAW:Looking. " + CALL}
    with client.messages.stream(model="script", max_tokens=200, messages=[user], tools=TOOLS) as s:
        raw = [e for e in s if e.type in ("message_start", "content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    types = [e.type for e in raw]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    # text block 0, then tool_use block 1, each start -> deltas -> stop
    blocks = [(e.type, getattr(e, "index", None)) for e in raw[1:-2]]
    assert blocks[0] == ("content_block_start", 0) and blocks[-1] == ("content_block_stop", 1)
    i = blocks.index(("content_block_stop", 0))
    assert all(b == ("content_block_delta", 0) for b in blocks[1:i])
    assert blocks[i + 1:] == [("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert raw[i + 2].content_block.type == "tool_use" and raw[i + 3].delta.type == "input_json_delta"
    assert raw[-2].delta.stop_reason == "tool_use"
    assert final.content[0].text == "Looking. " and final.content[1].input == {"city": "Paris"}
    tu = final.content[1]
    msgs = [user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "windy"}]}]
    with client.messages.stream(model="script", max_tokens=200, messages=msgs, tools=TOOLS) as s:
        text = "".join(s.text_stream)
        final2 = s.get_final_message()
    assert text == "Answer: windy" and final2.stop_reason == "end_turn"


def test_stop_sequences_and_max_tokens(client):
    m = send(client, "stop here please", stop_sequences=["please", "here"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "here"
    assert m.content[0].text == "Echo: stop "
    m = send(client, "a longer question", max_tokens=2)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    with client.messages.stream(model="script", max_tokens=200, messages=[{"role": "user", "content": "x y"}],
                                stop_sequences=["y"]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "y"


def test_count_tokens_matches_usage(client):
    msgs = [{"role": "user", "content": "count me"}]
    n = client.messages.count_tokens(model="script", messages=msgs, system="S.", tools=TOOLS).input_tokens
    m = send(client, None, messages=msgs, system="S.", tools=TOOLS)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model="script", messages=msgs).input_tokens < n


def test_errors_in_anthropic_format(srv, client):
    body = {"model": "script", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    for headers in ({"x-api-key": "wrong"}, {}):
        r = httpx.post(srv.url + "/v1/messages", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": r.json()["error"]["message"]}}
    assert httpx.post(srv.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**body)
    r = httpx.post(srv.url + "/v1/messages", json={"model": "script", "messages": body["messages"]},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        send(client, None, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    # a model name the server does not have is answered by the served model (serve --strict-models: 404)
    assert client.messages.create(model="no-such-model", max_tokens=5, messages=body["messages"]).model == "script"
    r = httpx.post(srv.url + "/v1/messages/count_tokens", json={"messages": body["messages"]},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(srv.url + "/v1/messages", content=b"hello", headers={"x-api-key": KEY,
                                                                      "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"  # refused before the route: same format


def test_too_long_prompt_in_anthropic_words(srv, client):
    """A prompt past the model's context is a 400 worded as the Anthropic API words it
    ("prompt is too long: N tokens > M maximum"): Claude Code matches that text (and
    these numbers) to tell it from other errors. Streamed or not, exact count or the
    bound from a long text's length; other APIs keep their own wording."""
    pattern = r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)"  # Claude Code 2.1.197's
    for words, stream in ((3000, False), (3000, True), (40000, False)):
        msgs = [{"role": "user", "content": "hello world " * words}]
        with pytest.raises(anthropic.BadRequestError) as e:
            if stream:
                with client.messages.stream(model="script", max_tokens=5, messages=msgs) as s:
                    s.get_final_message()
            else:
                send(client, None, messages=msgs, max_tokens=5)
        m = re.search(pattern, e.value.body["error"]["message"])
        assert m and int(m.group(1)) > int(m.group(2)) == 4096, e.value.body  # the scripted model's context
        assert "\n" not in e.value.body["error"]["message"]
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "script", "messages": msgs, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "prompt is too long" not in r.json()["error"]["message"]


def test_second_conversation_cached(srv, client):
    system = "You are a coding agent working in a repository. Follow the rules. " * 4
    send(client, "first task", system=system, tools=TOOLS)
    warm = send(client, "second task", system=system, tools=TOOLS)
    assert warm.usage.cache_read_input_tokens > 40
    srv.worker.store.clear()
    cold = send(client, "second task", system=system, tools=TOOLS)
    assert cold.usage.cache_read_input_tokens == 0
    assert cold.usage.input_tokens == warm.usage.input_tokens + warm.usage.cache_read_input_tokens
    assert warm.content[0].text == cold.content[0].text == "Echo: second task"


def test_claude_code_fields_are_accepted(client):
    """What Claude Code sends besides the basics: context_management, tool
    extras, output_config effort, cache_control, thinking, metadata."""
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}, "defer_loading": False,
              "input_examples": [{"city": "Rome"}], "strict": False}]
    m = client.messages.create(
        model="script", max_tokens=200, tools=tools, metadata={"user_id": "u1"},
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "RAW:" + CALL,
                                                "cache_control": {"type": "ephemeral"}}]}],
        thinking={"type": "disabled"},
        extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                    "output_config": {"effort": "high"}})
    assert m.stop_reason == "tool_use" and m.content[0].input == {"city": "Paris"}
    assert m.model_dump()["context_management"] == {"applied_edits": []}


def test_output_format_is_a_constrained_decode(client):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = send(client, 'RAW:{"ok":true}', extra_body={"output_config": {"format": {"type": "json_schema",
                                                                                  "schema": schema}}})
    assert json.loads(m.content[0].text) == {"ok": True} and m.model_dump()["dflash"]["mode"] == "dflash"  # inside the verify
    m = send(client, 'RAW:{"fine":1}', max_tokens=4,
             extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert m.content[0].text.startswith('{"') and "fine" not in m.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="json_schema"):
        send(client, "x", extra_body={"output_format": {"type": "xml"}})


@pytest.mark.slow
def test_fuzz_never_500(srv):
    import random

    from scripted import mutations

    rng = random.Random(7)
    body = {"model": "script", "max_tokens": 8, "system": [{"type": "text", "text": "S"}], "tools": TOOLS,
            "tool_choice": {"type": "auto"}, "stop_sequences": ["x"],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Rome"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "ok"}]}]}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for b in mutations(body, rng, 40):
            if path.endswith("count_tokens"):
                b = {k: v for k, v in b.items() if k not in ("max_tokens", "stop_sequences")}
            r = httpx.post(srv.url + path, json=b, headers={"x-api-key": KEY}, timeout=60)
            assert r.status_code in (200, 400, 404), (b, r.text)
            if r.status_code != 200:
                assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text
