"""Forced tool calls hold to their tool's schema (issue 37): with the embedded model
and default settings, a call that tool_choice forces (required, or a named tool)
validates against that tool's parameters schema, checked with the jsonschema library,
for the schemas real clients send (tests/data/client_tools/: captured from Claude Code,
Codex, opencode, `llm`, LiteLLM and the OpenAI / Anthropic SDKs' helpers by
tests/data/client_tools/capture.py) and for open and strict schemas of every shape
(SHAPES), in chat completions, Messages and Responses; with tool_choice auto the
model's choice to call or not stays its own."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import copy
import json
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from mlx_lm.generate import generate_step  # noqa: E402
from scripted import EmbeddedCatalog, LocalServer  # noqa: E402

from app.server import tool_grammar, tool_schema  # noqa: E402
from app.server.tools import GenRequest, ToolStream, forced_prefix  # noqa: E402
from mlx_dflash import load  # noqa: E402
from mlx_dflash.models.discovery import models_dir  # noqa: E402
from mlx_dflash.settings.schema import ModelSettings  # noqa: E402
from tiers import fast_first  # noqa: E402

pytestmark = pytest.mark.timeout(1200)
DATA = Path(__file__).parent / "data" / "client_tools"
V = 4096
N = 200  # tokens a forced call may take (the longest the embedded model wrote: ~80)


def client_tools():
    """(client, name, parameters, strict) of every function tool the clients sent."""
    out = []
    for f in sorted(DATA.glob("*.json")):
        d = json.loads(f.read_text())
        for api, tools in d["tools"].items():
            for t in tools:
                if api == "messages" and isinstance(t.get("input_schema"), dict):
                    out.append((d["client"], t["name"], t["input_schema"], t.get("strict")))
                elif api == "responses" and t.get("type") == "function":
                    out.append((d["client"], t["name"], t.get("parameters"), t.get("strict")))
                elif api == "chat" and t.get("type") == "function":
                    fn = t["function"]
                    out.append((d["client"], fn["name"], fn.get("parameters"), fn.get("strict")))
    return out


def _closed(schema):
    """The strict form of an open schema: every object closed, every key required."""
    s = copy.deepcopy(schema)

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("properties"), dict):
                x["additionalProperties"] = False
                x["required"] = list(x["properties"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(s)
    return s


OPEN = {  # open schemas (no additionalProperties: other keys allowed), one shape each
    "types": {"type": "object", "properties": {"path": {"type": "string"}, "count": {"type": "integer"},
                                               "ratio": {"type": "number"}, "force": {"type": "boolean"}},
              "required": ["path", "count"]},
    "enums": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                               "level": {"enum": [1, 2, 3]}}, "required": ["unit", "level"]},
    "arrays": {"type": "object", "properties": {"paths": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 1, "maxItems": 4}}, "required": ["paths"]},
    "nested": {"type": "object", "properties": {"where": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "integer"}}, "required": ["city"]}}, "required": ["where"]},
    "anyof": {"type": "object", "properties": {"query": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                               "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
              "required": ["query", "note"]},
    "oneof": {"type": "object", "properties": {"target": {"oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}, "required": ["target"]},
    "refs": {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
             "$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string"},
                                                                 "qty": {"type": "integer", "minimum": 1}},
                                "required": ["name", "qty"]}}},
    "untyped": {"properties": {"filePath": {"type": "string"}}, "required": ["filePath"]},  # no "type": object
}
SHAPES = [(f"open_{k}", v, None) for k, v in OPEN.items()] + [(f"strict_{k}", _closed(v), True) for k, v in OPEN.items()]


def validate(args, schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls(schema).validate(args)


@pytest.fixture(scope="module")
def pair():
    return load(str(models_dir() / "target"), str(models_dir() / "dflash2"))


def forced_call(model, tok, name, schema, strict, choice):
    """The call the embedded model writes under tool_choice `choice` with this one tool
    (mlx-lm's own decoding with the grammar), parsed as the server parses it."""
    fn = {"name": name, "parameters": schema}
    if strict is not None:
        fn["strict"] = strict
    tools = [{"type": "function", "function": fn}]
    req = GenRequest(model=None, messages=[], tools=tools, tool_choice=choice)
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "What is in hello.txt?"}]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    prefix = forced_prefix(req, tok)
    prompt = tok.encode(text + prefix, add_special_tokens=False)
    proc = tool_grammar.call_grammar(req, tok, V, prompt)
    assert proc is not None, name
    out = []
    for (y, _), _i in zip(generate_step(mx.array(prompt), model, logits_processors=[proc], max_tokens=N), range(N)):
        if int(y) in tok.eos_token_ids:
            break
        out.append(int(y))
    ts = ToolStream(tok, tools, prefix)
    return [e[1] for e in ts.feed(tok.decode(out)) + ts.finish() if e[0] == "call"], tok.decode(out)


def test_every_client_schema_is_compiled_whole():
    """Every function tool a client sent gets its whole schema as its grammar
    (exactly, or with the keywords llguidance does not implement ignored), not a relaxed one."""
    tools = client_tools()
    assert {c.split()[0] for c, *_ in tools} >= {"claude-code", "codex", "opencode", "llm", "litellm", "openai"}
    for client, name, schema, strict in tools:
        fn = {"name": name, "parameters": schema}
        want = tool_schema.object_schema(schema)
        assert tool_schema.arguments(fn) in (tool_schema.json_rule(want), tool_schema.json_rule(want, tool_schema.LENIENT)), \
            (client, name)


@pytest.mark.parametrize("name,schema,strict", fast_first(SHAPES, unpack=True), ids=[s[0] for s in SHAPES])
def test_forced_calls_of_every_shape_validate(pair, name, schema, strict):
    model, tok, _ = pair
    for choice in ("required", {"name": name}):
        calls, text = forced_call(model, tok, name, schema, strict, choice)
        assert calls and calls[0]["name"] == name, (choice, text)
        validate(calls[0]["arguments"], schema)


@pytest.mark.slow
def test_forced_calls_of_every_client_tool_validate(pair):
    """Every call the model closes validates. The 11M demo model may loop inside a
    string or an array no schema bounds (Claude Code's WebFetch url, a list of places)
    until N tokens: those calls are unclosed, not invalid, and must stay the exception."""
    model, tok, _ = pair
    bad, unclosed, tools = [], [], client_tools()
    for client, name, schema, strict in tools:
        calls, text = forced_call(model, tok, name, schema, strict, {"name": name})
        if not calls and tok.tool_call_end not in text:
            unclosed.append((client, name))
            continue
        try:
            assert calls and calls[0]["name"] == name, text[-200:]
            validate(calls[0]["arguments"], schema)
        except (AssertionError, jsonschema.ValidationError) as e:
            bad.append((client, name, str(e)[:200]))
    assert not bad, bad
    assert len(unclosed) <= len(tools) // 10, unclosed


# -- through the server, in the three APIs ---------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with LocalServer(EmbeddedCatalog(ModelSettings()), model="embedded/target") as srv:
        yield httpx.Client(base_url=srv.url, timeout=300)


USER = "What is in hello.txt?"


def _chat(c, name, schema, strict, choice):
    fn = {"name": name, "parameters": schema, **({"strict": strict} if strict else {})}
    tc = {"type": "function", "function": {"name": name}} if choice == "named" else "required"
    r = c.post("/v1/chat/completions", json={"model": "embedded/target", "max_tokens": N, "tool_choice": tc,
                                              "messages": [{"role": "user", "content": USER}],
                                              "tools": [{"type": "function", "function": fn}]}).json()
    return [(t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in r["choices"][0]["message"].get("tool_calls") or []]


def _messages(c, name, schema, strict, choice):
    tc = {"type": "tool", "name": name} if choice == "named" else {"type": "any"}
    r = c.post("/v1/messages", json={"model": "embedded/target", "max_tokens": N, "tool_choice": tc,
                                      "messages": [{"role": "user", "content": USER}],
                                      "tools": [{"name": name, "input_schema": schema}]}).json()
    return [(b["name"], b["input"]) for b in r["content"] if b["type"] == "tool_use"]


def _responses(c, name, schema, strict, choice):
    tc = {"type": "function", "name": name} if choice == "named" else "required"
    tool = {"type": "function", "name": name, "parameters": schema, **({"strict": strict} if strict else {})}
    r = c.post("/v1/responses", json={"model": "embedded/target", "max_output_tokens": N, "tool_choice": tc,
                                       "input": USER, "tools": [tool], "store": False}).json()
    return [(o["name"], json.loads(o["arguments"])) for o in r["output"] if o["type"] == "function_call"]


@pytest.mark.slow
@pytest.mark.parametrize("api", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
def test_forced_calls_validate_in_every_api(server, api):
    for name, schema, strict in SHAPES:
        for choice in ("named", "required"):
            calls = api(server, name, schema, strict, choice)
            assert calls and calls[0][0] == name, (api.__name__, name, choice)
            validate(calls[0][1], schema)


@pytest.mark.slow
def test_the_choice_to_call_stays_the_models(pair):
    """tool_choice auto: the grammar only acts inside a call the model opened, so the
    model's text, and whether it calls, are those of decoding without it."""
    model, tok, _ = pair
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s, _ in SHAPES[:4]]
    for q in ("Say hi.", "What is 3 times 2?", USER):
        msgs = [{"role": "user", "content": q}]
        prompt = tok.encode(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        req = GenRequest(model=None, messages=[], tools=tools)
        runs = []
        for procs in ([], [tool_grammar.call_grammar(req, tok, V, prompt)]):
            out = []
            for (y, _), _i in zip(generate_step(mx.array(prompt), model, logits_processors=procs, max_tokens=64),
                                  range(64)):
                if int(y) in tok.eos_token_ids:
                    break
                out.append(int(y))
            runs.append(tok.decode(out))
        free, held = runs
        before = free.split(tok.tool_call_start)[0]
        assert held.split(tok.tool_call_start)[0] == before  # the same text up to a call
        assert (tok.tool_call_start in held) == (tok.tool_call_start in free)  # and the same choice to call
