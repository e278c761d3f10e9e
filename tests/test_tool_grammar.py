"""The tool-call grammar (app/server/tool_grammar.py): once the model opens a
call, every token keeps it a call the client can run. Checked token by token
with llguidance's own matcher semantics on the embedded target's tokenizer
(Qwen3's single-token `<tool_call>` markers), against the model through
mlx-lm's own `generate_step`, and through the server with the OpenAI SDK."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json
import random
from types import SimpleNamespace

import mlx.core as mx
import pytest

pytest.importorskip("llguidance")

from mlx_lm.generate import generate_step  # noqa: E402

from app.server import tool_grammar  # noqa: E402
from app.server.tools import GenRequest, ToolStream  # noqa: E402
from mlx_dflash import DecodeConfig, load, stream_generate  # noqa: E402
from mlx_dflash.models.discovery import models_dir  # noqa: E402
from mlx_dflash.settings.schema import ModelSettings  # noqa: E402
from scripted import EmbeddedCatalog, LocalServer  # noqa: E402

V = 4096
READ = {"type": "function", "function": {
    "name": "Read", "description": "Reads a file from the local filesystem.",
    "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"},
                                                    "limit": {"type": "number"}},
                   "required": ["file_path"], "additionalProperties": False}}}
BASH = {"type": "function", "function": {"name": "Bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}  # other keys allowed
STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
ODD = {"type": "function", "function": {"name": "Look", "parameters": {  # keys JSON must escape, or not ASCII
    "type": "object", "properties": {"naïve": {"type": "string"}, 'q"uote': {"type": "string"}},
    "additionalProperties": False}}}
WIDE = {"type": "function", "function": {"name": "Wide", "parameters": {  # declared keys in the schema's order
    "type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(8)},
    "required": ["k2"], "additionalProperties": False}}}
TOOLS = [READ, BASH, STRICT, WIDE, ODD]


@pytest.fixture(scope="module")
def pair():
    model, tok, drafter = load(str(models_dir() / "target"), str(models_dir() / "dflash2"))
    return model, tok, drafter


@pytest.fixture(scope="module")
def tok(pair):
    return pair[1]


def call_ids(tok, body: str):
    return tok.encode(body, add_special_tokens=False)


def grammar_for(tok, tools=TOOLS, prompt=None):
    req = GenRequest(model=None, messages=[], tools=tools)
    return tool_grammar.call_grammar(req, tok, V, prompt or [1, 2, 3])


def allowed_path(proc, prompt, gen):
    """Whether each token of `gen` is allowed by the processor's mask at its position."""
    logits = mx.zeros((1, V))
    out = []
    for i, t in enumerate(gen):
        m = proc(mx.array(prompt + gen[:i]), logits)
        out.append(bool(m[0, t].item() > -float("inf")))
    return out


VALID = [
    '\n{"name": "Read", "arguments": {"file_path": "/tmp/a.txt"}}\n</tool_call>',
    '\n{"name": "Read", "arguments": {"file_path": "a b", "offset": 1, "limit": 3}}\n</tool_call>',
    '{"name":"Read","arguments":{"file_path":"x"}}</tool_call>',
    '\n{\n  "name": "Bash",\n  "arguments": {"command": "ls", "timeout": [1, {"a": null}]}\n}\n</tool_call>',
    '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    '\n{"name": "Wide", "arguments": {"k0": 1, "k2": 2, "k7": 3}}\n</tool_call>',
    '\n{"arguments": {"file_path": "x"}, "name": "Read"}\n</tool_call>',
    '\n{"name": "Look", "arguments": {"naïve": "b", "q\\"uote": "a"}}\n</tool_call>',
]
INVALID = [  # (text, the piece the grammar must refuse)
    ('\n{"name": "calculator", "arguments": {}}\n</tool_call>', "calculator"),  # not offered
    ('\n{"name": "Read", "arguments": {"file_path": "x", "file_path": "y"}}\n</tool_call>', ', "file_path": "y"'),
    ('\n{"name": "Read", "arguments": {"offset": 3}}\n</tool_call>', "offset"),  # file_path (required) first
    ('\n{"name": "Read", "arguments": {"expression": "3*2"}}\n</tool_call>', "expression"),  # not a key of Read
    ('\n{"name": "Bash", "arguments": {"expression": "3*2"}}\n</tool_call>', "expression"),  # command first: required
    ('\n{"name": "Bash", "arguments": {"command": 3}}\n</tool_call>', "3"),  # a declared key by its schema
    ('\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}\n</tool_call>', '"2"'),  # strict
    ('\n{"name": "Wide", "arguments": {"k2": 2, "k0": 1}}\n</tool_call>', "k0"),  # out of the schema's order
    ('\n{"name": "Read", "arguments": {"file_path":\n\n\n "x"}}\n</tool_call>', "\n\n"),  # blank lines
    ('\n{"name": "Read", "arguments": {"file_path": "x"}}', None),  # unclosed: EOS is not allowed
]


def test_valid_calls_pass_as_written(tok):
    """A call the model writes validly (any layout, keys in any order) is never changed."""
    start = tok.encode("<tool_call>", add_special_tokens=False)
    for body in VALID:
        gen = start + call_ids(tok, body)
        assert all(allowed_path(grammar_for(tok), [1, 2, 3], gen)), body
        # before the call opens and after it closes, the model's text is untouched
        text = call_ids(tok, "Let me look. ")
        proc = grammar_for(tok)
        after = gen + text
        logits = mx.random.normal((1, V))
        for i in list(range(len(text))) + [len(after)]:
            h = (text[:i] if i < len(text) else after)
            assert mx.array_equal(proc(mx.array([1, 2, 3] + h), logits), logits)


def test_invalid_calls_are_refused_where_they_go_wrong(tok):
    start = tok.encode("<tool_call>", add_special_tokens=False)
    eos = tok.eos_token_ids
    for body, bad in INVALID:
        gen = start + call_ids(tok, body)
        ok = allowed_path(grammar_for(tok), [1, 2, 3], gen)
        if bad is None:  # complete as far as it goes, but it cannot end there
            assert all(ok)
            m = grammar_for(tok)(mx.array([1, 2, 3] + gen), mx.zeros((1, V)))
            assert all(m[0, e].item() == -float("inf") for e in eos)
            continue
        first = ok.index(False)
        full, before = tok.decode(gen), tok.decode(gen[:first])
        pos = full.index(bad)
        assert pos - 2 <= len(before) < pos + len(bad), (body, before)  # refused where `bad` begins


@pytest.mark.slow
def test_masks_follow_the_history_not_the_calls(tok):
    """The engine's contract: verify rows and rollbacks call a processor with
    histories that are not extensions of the last; the mask must be that of a
    fresh processor that sees the same history."""
    rng = random.Random(0)
    start = tok.encode("<tool_call>", add_special_tokens=False)
    seqs = [call_ids(tok, "Sure. ") + start + call_ids(tok, b) + call_ids(tok, " done") for b in VALID]
    seqs += [start + call_ids(tok, b) for b, _ in INVALID]
    seqs.append(start + call_ids(tok, VALID[0]) + start + call_ids(tok, VALID[4]))  # two calls
    prompt = [1, 2, 3]
    logits = mx.random.normal((1, V))
    for seq in seqs:
        proc = grammar_for(tok)
        n = 0
        for _ in range(40):
            n = max(0, min(len(seq), n + rng.randint(-6, 8)))
            h = seq[:n]
            if rng.random() < 0.2 and h:  # a rejected draft: a token no grammar would pick
                h = h[:-1] + [rng.randrange(V)]
            got = proc(mx.array(prompt + h), logits)
            want = grammar_for(tok)(mx.array(prompt + h), logits)
            assert mx.array_equal(got, want), (tok.decode(h), n)


def test_tool_choice_opens_the_call_in_the_prompt(tok):
    """tool_choice "required" / a named function put the call's start in the
    prompt: the grammar starts inside it."""
    prompt = [5, 6] + tok.encode('<tool_call>\n{"name": "Read", "arguments": ', add_special_tokens=False)
    req = GenRequest(model=None, messages=[], tools=TOOLS, tool_choice={"name": "Read"})
    proc = tool_grammar.call_grammar(req, tok, V, prompt)
    ok = allowed_path(proc, prompt, call_ids(tok, '{"file_path": "a"}}\n</tool_call>'))
    assert all(ok)
    assert not all(allowed_path(tool_grammar.call_grammar(req, tok, V, prompt), prompt, call_ids(tok, '{"command": "ls"}')))


def test_formats_without_a_grammar_are_left_alone(tok, monkeypatch):
    plain = SimpleNamespace(has_tool_calling=False)
    assert "no tool-call format" in tool_grammar.unsupported(plain)
    other = SimpleNamespace(has_tool_calling=True, tool_parser=SimpleNamespace(__module__="mlx_lm.tool_parsers.kimi_k2"),
                            tool_call_start="<tool_call>", tool_call_end="</tool_call>")
    assert "kimi_k2" in tool_grammar.unsupported(other)
    assert grammar_for(tok) is not None
    monkeypatch.setattr(tool_grammar, "llguidance", None)  # a platform without its wheel: calls as written
    assert "llguidance" in tool_grammar.unsupported(tok) and grammar_for(tok) is None


def generated(model, tok, prompt, procs, n=60):
    out = []
    for (y, _), _i in zip(generate_step(mx.array(prompt), model, logits_processors=procs, max_tokens=n), range(n)):
        y = int(y)
        if y in tok.eos_token_ids:
            break
        out.append(y)
    return out


def agent_prompt(tok, tools, question="What is hello.txt for?"):
    msgs = [{"role": "system", "content": "You are a coding agent. To read a file, call the Read tool with its file_path."},
            {"role": "user", "content": question}]
    return tok.encode(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


@pytest.mark.slow
def test_the_embedded_model_calls_an_offered_tool(pair):
    """mlx-lm's own decoding with the processor: the embedded model's call (to
    `calculator`, a tool of its training, when left alone) names an offered tool
    with that tool's keys, and parses."""
    model, tok, _ = pair
    for tools in ([READ], [READ, BASH]):
        prompt = agent_prompt(tok, tools)
        req = GenRequest(model=None, messages=[], tools=tools)
        out = generated(model, tok, prompt, [tool_grammar.call_grammar(req, tok, V, prompt)])
        ts = ToolStream(tok, tools)
        calls = [e[1] for e in ts.feed(tok.decode(out)) + ts.finish() if e[0] == "call"]
        assert calls, tok.decode(out)
        names = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for c in calls:
            assert c["name"] in names
            props = names[c["name"]].get("properties", {})
            if names[c["name"]].get("additionalProperties") is False:
                assert set(c["arguments"]) <= set(props) and "file_path" in c["arguments"]


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4, 8])
def test_dflash_with_the_grammar_is_mlx_lm_with_it(pair, width):
    """Greedy DFlash with the tool grammar in its verify = mlx-lm's generate_step
    with the same processor, token for token, on prompts that call and that do not."""
    model, tok, drafter = pair
    for tools, q in (([READ], "What is hello.txt for?"), ([READ, BASH, STRICT], "What is 3 times 2?"),
                     ([BASH], "Say hi.")):
        prompt = agent_prompt(tok, tools, q)
        req = GenRequest(model=None, messages=[], tools=tools)
        want = generated(model, tok, prompt, [tool_grammar.call_grammar(req, tok, V, prompt)], 48)
        cfg = DecodeConfig(max_tokens=48, block_size=width, verify_mode="dflash",
                           logits_processors=[tool_grammar.call_grammar(req, tok, V, prompt)])
        rs = list(stream_generate(model, tok, prompt, drafter, config=cfg))
        got = [r.token for r in rs if r.token not in tok.eos_token_ids]
        assert got == want, (tok.decode(got), tok.decode(want))
        assert rs[-1].stats.mode == "dflash" and rs[-1].stats.cycles > 0


def test_grammar_json_is_valid_lark(tok):
    text = tool_grammar.grammar(tok, TOOLS)
    import llguidance

    assert not llguidance.LLMatcher.validate_grammar(text)
    assert json.dumps(json.dumps("Read")) in text  # the name as a literal of the grammar


AGENT_SYSTEM = "You are a coding agent. To read a file, call the Read tool with its file_path."


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False])
def test_server_calls_through_the_grammar(pair, on):
    """Through the server and the real SDKs: with the setting on (the default) the
    call names an offered tool with its keys; off, the answer is mlx-lm's own."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    model, tok, _ = pair
    settings = ModelSettings(max_tokens=48, tool_grammar=on)
    msgs = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": "What is hello.txt for?"}]
    with LocalServer(EmbeddedCatalog(settings), model="embedded/target") as srv:
        oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = oa.chat.completions.create(model="embedded/target", messages=msgs, tools=[READ])
        prompt = agent_prompt(tok, [READ])
        free = tok.decode(generated(model, tok, prompt, [], 48))
        if on:
            [c] = r.choices[0].message.tool_calls
            args = json.loads(c.function.arguments)
            assert c.function.name == "Read" and "file_path" in args and set(args) <= {"file_path", "offset", "limit"}
            assert r.choices[0].finish_reason == "tool_calls"
        else:  # as the model writes it: its call (to a tool of its training) or its text
            ts = ToolStream(tok, [READ])
            want = [e[1] for e in ts.feed(free) + ts.finish() if e[0] == "call"]
            got = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                   for c in r.choices[0].message.tool_calls or []]
            assert got == want
        ac = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
        tool = {"name": "Read", "description": READ["function"]["description"],
                "input_schema": READ["function"]["parameters"]}
        m = ac.messages.create(model="claude-haiku-4-5", max_tokens=48, system=AGENT_SYSTEM, tools=[tool],
                               messages=[{"role": "user", "content": "What is hello.txt for?"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        if on:
            assert [u.name for u in uses] == ["Read"] and "file_path" in uses[0].input and m.stop_reason == "tool_use"
        else:
            assert all(u.name != "Read" or "file_path" in u.input for u in uses)


def odd_schema(rng, depth=0):
    """A JSON schema of the kinds clients send, odd ones included."""
    leaf = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "boolean"},
            {"type": "null"}, {"type": ["string", "null"]}, {"enum": ["a", 1, None]}, {"const": "x"},
            {"type": "string", "format": "date-time"}, {"type": "string", "pattern": "^[a-z]+$"}, {},
            {"$ref": "#/$defs/nowhere"}, {"type": "string", "minLength": 5, "maxLength": 2}, {"not": {}},
            {"type": "weird"}, {"oneOf": [{"type": "string"}, {"type": "integer"}]}, True]
    if depth > 2 or rng.random() < 0.5:
        return rng.choice(leaf)
    if rng.random() < 0.3:
        return {"type": "array", "items": odd_schema(rng, depth + 1), "maxItems": rng.choice([1, 3])}
    props = {rng.choice(["path", "q", "n", "é", "a b", "x\"y", "k"]) + str(i): odd_schema(rng, depth + 1)
             for i in range(rng.randint(0, 9))}
    return {"type": "object", "properties": props, "required": rng.sample(list(props) + ["missing"], k=min(2, len(props))),
            "additionalProperties": rng.choice([True, False, {"type": "string"}]),
            "$defs": {"x": {"type": "string"}}}


@pytest.mark.slow
def test_any_tool_schema_gives_a_grammar_or_none(tok):
    """Tools as clients send them, odd schemas included: the request gets a grammar
    (a call can still be completed) or none (its calls go as written), never an error."""
    rng = random.Random(1)
    start = tok.encode("<tool_call>", add_special_tokens=False)
    got = 0
    for _ in range(40):
        tools = [{"type": "function", "function": {"name": f"t{i}", "strict": rng.random() < 0.3,
                                                   "parameters": odd_schema(rng)}} for i in range(rng.randint(1, 4))]
        proc = grammar_for(tok, tools)
        if proc is None:
            continue
        got += 1
        h = start + call_ids(tok, '\n{"name": "t0", "arguments": ')
        logits = mx.zeros((1, V))
        for i in range(len(h) + 1):
            m = proc(mx.array([1, 2, 3] + h[:i]), logits)
        assert (m[0] > -float("inf")).any()  # something may follow
    assert got > 30


def test_an_unclosed_call_earlier_in_the_conversation_opens_nothing(tok):
    """With tool_choice auto the grammar starts outside a call, whatever earlier
    turns hold (an unclosed call the model once wrote, kept as text)."""
    prompt = [1] + tok.encode('<tool_call>\n{"name": "Read", "arguments": {"file_pa', add_special_tokens=False) + [5]
    proc = grammar_for(tok, prompt=prompt)
    logits = mx.random.normal((1, V))
    assert mx.array_equal(proc(mx.array(prompt), logits), logits)
