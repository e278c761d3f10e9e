"""What agents and the SDKs' helpers send and expect (issue 22), with the
official `openai` and `anthropic` clients against a real server on the
scripted target (tests/scripted.py): unknown fields accepted, system and
developer messages anywhere, Codex's namespace tools, the reasoning split,
stream helpers on cut answers and tool use, compact structured output."""

import json
import logging
import uuid

import anthropic
import httpx
import openai
import pydantic
import pytest
from scripted import LocalServer, ScriptCatalog, script_server, tool_call_text, tool_tokenizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.server]

KEY = "sk-test"
FN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}]
ANT_TOOLS = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]

# Qwen3-like: opens <think> in the generation prompt (an empty block when enable_thinking
# is false), and refuses a system message anywhere but first
THINK_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


srv = script_server(KEY)


def think_tokenizer(src, out):
    """The test pair's tokenizer with <think> / </think> tokens (mlx-lm then has
    think markers for it) and THINK_TEMPLATE."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(src)
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    hf.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def think_srv(pairs, tmp_path_factory):
    tok = think_tokenizer(pairs() / "target", tmp_path_factory.mktemp("think-tok"))
    assert tok.has_thinking and tok.think_start == "<think>"
    with LocalServer(ScriptCatalog(tok), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ant(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def think_oai(think_srv):
    return openai.OpenAI(base_url=think_srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def think_ant(think_srv):
    return anthropic.Anthropic(base_url=think_srv.url, api_key=KEY, max_retries=0, timeout=60)


# -- tolerant requests --------------------------------------------------------------------

@pytest.mark.slow
def test_unknown_and_unused_fields_are_accepted(oai, ant, caplog):
    odd = "frobnicate_" + uuid.uuid4().hex[:6]  # a field no API has: named in the debug log
    caplog.set_level(logging.DEBUG, logger="mlx_dflash.server")
    msgs = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="script", messages=msgs, metadata={"k": "v"}, reasoning_effort="low",
                                    store=True, user="u1", service_tier="auto", prompt_cache_key="p",
                                    safety_identifier="s", verbosity="low",
                                    stream_options={"include_usage": True},  # without stream: ignored
                                    extra_body={odd: 1, "client_metadata": {"a": "b"}})
    assert r.choices[0].message.content == "Echo: hi"
    assert any(odd in rec.getMessage() for rec in caplog.records)
    c = oai.completions.create(model="script", prompt="x", max_tokens=2, user="u", extra_body={odd + "_c": 1})
    assert c.usage.completion_tokens == 2
    rr = oai.responses.create(model="script", input="hi", store=False, include=["reasoning.encrypted_content"],
                              reasoning={"effort": "medium", "summary": "auto"}, prompt_cache_key="k",
                              service_tier="auto", parallel_tool_calls=False, truncation="auto",
                              text={"verbosity": "low"}, metadata={"n": "1"},
                              extra_body={"client_metadata": {"x-codex": "1"}, odd: [1]})
    assert rr.status == "completed" and rr.output_text == "Echo: hi"
    m = ant.messages.create(model="script", max_tokens=50, messages=msgs, metadata={"user_id": "u"},
                            service_tier="auto", extra_body={"context_management": {"edits": []}, odd: {},
                                                             "container": "c"},
                            tools=ANT_TOOLS + [{"type": "web_search_20250305", "name": "web_search"}])
    assert m.content[0].text == "Echo: hi"


def test_known_fields_that_would_change_the_answer_are_refused_by_name(srv, oai):
    msgs = [{"role": "user", "content": "hi"}]
    for kw, param in (({"n": 2}, "n"), ({"modalities": ["text", "audio"]}, "modalities"),
                      ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="script", messages=msgs, **kw)
        assert e.value.body["param"] == param and "\n" not in e.value.body["message"]
    for kw, param in (({"background": True}, "background"), ({"conversation": "conv_1"}, "conversation")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="script", input="hi", **kw)
        assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_parameter"


# -- system and developer messages anywhere -----------------------------------------------------

def test_system_messages_anywhere_render_in_place_or_merged(pairs, tmp_path):
    from app.server.render import render

    msgs = [{"role": "system", "content": "LEAD"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "system", "content": "MID"},
            {"role": "user", "content": "u2"}]
    in_place = render(tool_tokenizer(pairs() / "target", tmp_path / "a"), msgs)  # the template takes it
    assert in_place.index("a1") < in_place.index("<|im_start|>system\nMID") < in_place.index("u2")
    merged = render(think_tokenizer(pairs() / "target", tmp_path / "b"), msgs)  # it raises: merged
    assert merged.startswith("<|im_start|>system\nLEAD\n\nMID<|im_end|>") and merged.count("system") == 1
    merged = render(think_tokenizer(pairs() / "target", tmp_path / "c"), msgs[1:])  # no leading one
    assert merged.startswith("<|im_start|>system\nMID<|im_end|>")


@pytest.mark.parametrize("which", ["tool", "think"])
def test_mid_conversation_system_and_developer_messages(which, oai, ant, think_oai, think_ant):
    o, a = (oai, ant) if which == "tool" else (think_oai, think_ant)
    ok = "RAW:ok" if which == "tool" else "RAW:<think>\nx</think>ok"
    r = o.chat.completions.create(model="script", messages=[
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
        {"role": "developer", "content": "D"}, {"role": "user", "content": ok}])
    assert r.choices[0].message.content == "ok"
    # Claude Code's shape: a system message inside `messages`
    m = a.messages.create(model="script", max_tokens=50, system="S", messages=[
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]}, {"role": "user", "content": ok}])
    assert [b.text for b in m.content if b.type == "text"] == ["ok"]
    rr = o.responses.create(model="script", instructions="I", input=[
        {"role": "user", "content": "u1"}, {"role": "developer", "content": "D"}, {"role": "user", "content": ok}])
    assert rr.output_text == "ok"


# -- Codex tools ----------------------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "mcp__files", "description": "Tools in the mcp__files namespace.",
     "tools": [{"type": "function", "name": "read_file", "description": "Read a file", "strict": False,
                "defer_loading": True,
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation", "output_format": "png"},
    {"type": "local_shell"},
    {"type": "tool_search", "execution": "client", "description": "d", "parameters": {"type": "object"}},
]


def test_codex_namespace_tools_and_built_ins(oai):
    call = tool_call_text("read_file", {"path": "README.md"})
    r = oai.responses.create(model="script", input="RAW:" + call, tools=CODEX_TOOLS, tool_choice="auto",
                             parallel_tool_calls=False, store=False)
    [fc] = r.output
    assert fc.type == "function_call" and fc.name == "read_file" and fc.namespace == "mcp__files"
    assert json.loads(fc.arguments) == {"path": "README.md"}
    d = r.model_dump()["dflash"]
    assert sorted(d["tools_not_offered"]) == ["image_generation", "local_shell", "tool_search", "web_search"]
    # the round trip as Codex sends it: the whole conversation, the call with its namespace
    items = [{"role": "user", "content": [{"type": "input_text", "text": "RAW:" + call}]},
             {"type": "reasoning", "summary": [], "encrypted_content": None},
             {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "namespace": fc.namespace,
              "arguments": fc.arguments},
             {"type": "function_call_output", "call_id": fc.call_id, "output": "# readme"},
             {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "q"}}]
    r2 = oai.responses.create(model="script", input=items, tools=CODEX_TOOLS, store=False)
    assert r2.output_text == "Answer: # readme"


# -- reasoning --------------------------------------------------------------------------------------

THOUGHT = "RAW:<think>\nLet me see.</think>\n\nIt is 4."


def test_reasoning_in_chat_completions(think_oai):
    msgs = [{"role": "user", "content": THOUGHT}]
    r = think_oai.chat.completions.create(model="script", messages=msgs)
    m = r.choices[0].message
    assert m.content == "It is 4." and m.model_dump()["reasoning_content"] == "Let me see."
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(think_oai.chat.completions.create(model="script", messages=msgs, stream=True))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_answer:])  # thinking comes first
    # reasoning_effort "none" turns the template's thinking off: an empty block in the prompt
    plain = [{"role": "user", "content": "RAW:<think>\n\n</think>\n\nplain"}]
    off = think_oai.chat.completions.create(model="script", reasoning_effort="none", messages=plain)
    assert off.choices[0].message.content == "plain" and "reasoning_content" not in off.choices[0].message.model_dump()
    on = think_oai.chat.completions.create(model="script", reasoning_effort="high", messages=plain)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote the closed block
    assert on.choices[0].message.content == "plain"  # (an empty thought is no reasoning)


def test_reasoning_in_messages(think_ant):
    msgs = [{"role": "user", "content": THOUGHT}]
    m = think_ant.messages.create(model="script", max_tokens=100, messages=msgs,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me see." and m.content[1].text == "It is 4."
    with think_ant.messages.stream(model="script", max_tokens=100, messages=msgs) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me see."
    assert "thinking" in kinds and final.content[1].text == "It is 4."
    off = think_ant.messages.create(model="script", max_tokens=100, thinking={"type": "disabled"},
                                    messages=[{"role": "user", "content": "RAW:<think>\n\n</think>\n\nplain"}])
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "plain"


@pytest.mark.slow
def test_reasoning_in_responses(think_oai):
    r = think_oai.responses.create(model="script", input=THOUGHT)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me see." and r.output_text == "It is 4."
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with think_oai.responses.stream(model="script", input=THOUGHT) as s:
        evs = list(s)
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "It is 4."
    assert "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta") == "Let me see."
    # the next turn (previous_response_id) carries the answer, not the reasoning
    r2 = think_oai.responses.create(model="script", previous_response_id=r.id,
                                    input="RAW:<think>\n.</think>again", reasoning={"effort": "high"})
    assert r2.output_text == "again" and r2.usage.input_tokens > r.usage.input_tokens
    cut = think_oai.responses.create(model="script", input=THOUGHT, max_output_tokens=2)
    assert cut.status == "incomplete" and [o.type for o in cut.output] == ["reasoning"]


# -- stream helpers on cut answers and tool use ----------------------------------------------

def test_responses_stream_helper_on_a_cut_answer(oai):
    with oai.responses.stream(model="script", input="a long enough question", max_output_tokens=3) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 3 and final.output_text == "Echo: a long enough question"[:len(final.output_text)]
    assert final.output_text and types[-1] == "response.completed"
    # and a tool call streamed
    with oai.responses.stream(model="script", input="RAW:" + tool_call_text(), tools=[
            {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output[0].type == "function_call"


def test_anthropic_stream_helper_on_a_cut_answer_and_tool_use(ant):
    with ant.messages.stream(model="script", max_tokens=3, messages=[{"role": "user", "content": "long question"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert final.content[0].text == text and "Echo: long question".startswith(text) and text
    with ant.messages.stream(model="script", max_tokens=200, tools=ANT_TOOLS,
                             messages=[{"role": "user", "content": "RAW:On it. " + tool_call_text()}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.content[1].name == "get_weather"
    n = ant.messages.count_tokens(model="script", tools=ANT_TOOLS, messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens > 0


def test_chat_stream_helper(oai):
    with oai.chat.completions.stream(model="script", messages=[{"role": "user", "content": "RAW:" + tool_call_text()}],
                                     tools=FN_TOOLS) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"


# -- compact structured output --------------------------------------------------------------------

class Place(pydantic.BaseModel):
    city: str
    population: int
    capital: bool


def test_parse_with_a_pydantic_model_is_compact(srv, oai):
    pytest.importorskip("llguidance")
    want = '{"city":"Oslo","population":700000,"capital":true}'
    r = oai.chat.completions.parse(model="script", messages=[{"role": "user", "content": "RAW:" + want}],
                                   response_format=Place, max_tokens=64)
    p = r.choices[0].message.parsed
    assert p == Place(city="Oslo", population=700000, capital=True) and r.choices[0].message.content == want
    tok = srv.worker.lm.tokenizer
    assert r.usage.completion_tokens <= len(tok.encode(want, add_special_tokens=False)) + 1  # + the end token


def test_grammar_allows_no_padding(pairs, tmp_path):
    llg = pytest.importorskip("llguidance")
    import llguidance.hf

    from app.server.structured import parse_format

    tok = tool_tokenizer(pairs() / "target", tmp_path / "tok")
    fmt = parse_format("json_schema", Place.model_json_schema(), "response_format")
    llt = llguidance.hf.from_tokenizer(tok._tokenizer, n_vocab=len(tok.get_vocab()))

    def accepts(text):
        m = llg.LLMatcher(llt, fmt.grammar)
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and not m.is_error()

    assert accepts('{"city":"A b","population":1,"capital":false}')  # spaces inside a string are content
    for padded in ('{ "city"', '{"city": "A"', '{"city":"A",\n', '{\n  "city"'):
        assert not accepts(padded), padded


def test_clients_keep_working_after_all_of_it(srv):
    # nothing above left the server unable to answer plainly over raw HTTP
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "script", "messages": [{"role": "user", "content": "bye"}], "seed": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Echo: bye"



def test_agent_history_blocks(ant):
    """A tool result with an image (Claude Code's Read on a picture) and an earlier turn
    that used a server tool: rendered as text, never a 400."""
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    m = ant.messages.create(model="script", max_tokens=100, tools=ANT_TOOLS, messages=[
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "shot:"}, img]}]}])
    assert m.content[0].text == "Answer: shot:[image left out: this model reads text only]"
    with pytest.raises(anthropic.BadRequestError, match="image"):  # a user's own image: said, not dropped
        ant.messages.create(model="script", max_tokens=10, messages=[{"role": "user", "content": [img]}])


def test_structured_output_on_a_thinking_model(think_oai):
    """The grammar allows no reasoning: the template's thinking is switched off (unless
    the request says otherwise) and the constrained output is all answer."""
    pytest.importorskip("llguidance")
    want = '{"city":"Oslo","population":1,"capital":true}'
    r = think_oai.chat.completions.parse(model="script", response_format=Place, messages=[
        {"role": "user", "content": "RAW:<think>\n\n</think>\n\n" + want}])
    assert r.choices[0].message.parsed == Place(city="Oslo", population=1, capital=True)
    assert "reasoning_content" not in r.choices[0].message.model_dump()
