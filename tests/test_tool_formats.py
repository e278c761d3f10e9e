"""Tool-call grammars for formats other than JSON in tags (issue 37): Qwen3-Coder's
XML (`<function=NAME><parameter=KEY>`, mlx-lm's qwen3_coder parser), on the embedded
target's weights and tokenizer with a Qwen3-Coder chat template. Names and keys are
constrained and values held to their schema where it says a type; forced calls parse
with mlx-lm's own parser and validate (jsonschema); greedy DFlash with the grammar in
its verify is token for token mlx-lm's generate_step with the same grammar."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json
import os
import shutil

import mlx.core as mx
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from mlx_lm.generate import generate_step  # noqa: E402

from app.server import tool_grammar  # noqa: E402
from app.server.tools import GenRequest, ToolStream, forced_prefix, parser_name  # noqa: E402
from mlx_dflash import DecodeConfig, load, stream_generate  # noqa: E402
from mlx_dflash.models.discovery import models_dir  # noqa: E402
from tiers import fast_first  # noqa: E402

pytestmark = pytest.mark.timeout(900)
N = 160

QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call a function, write:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'system' and loop.first %}{%- else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOLS = {
    "set_timer": {"type": "object", "properties": {"minutes": {"type": "integer"}, "loud": {"type": "boolean"},
                                                   "label": {"type": "string", "maxLength": 12}},
                  "required": ["minutes", "loud", "label"]},
    "convert": {"type": "object", "properties": {"value": {"type": "number"},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["value", "unit"], "additionalProperties": False},
    "tag_files": {"type": "object", "properties": {
        "paths": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "where": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"],
                  "additionalProperties": False},
        "note": {"type": "string"}},  # optional free text: the model may leave it out
        "required": ["paths", "where"]},
}


def tools_for(*names):
    return [{"type": "function", "function": {"name": n, "parameters": TOOLS[n]}} for n in names]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """(model, tokenizer, drafter): the embedded pair, its tokenizer with a Qwen3-Coder template."""
    d = tmp_path_factory.mktemp("coder")
    src = models_dir() / "target"
    for f in ("config.json", "tokenizer.json", "special_tokens_map.json"):
        shutil.copy(src / f, d / f)
    os.symlink(src / "model.safetensors", d / "model.safetensors")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg["tool_parser_type"] = "qwen3_coder"  # (mlx-lm would infer it from the template; the embedded config names its own)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(QWEN3_CODER_TEMPLATE)
    model, tok, drafter = load(str(d), str(models_dir() / "dflash2"))
    assert parser_name(tok) == "qwen3_coder" and tool_grammar.unsupported(tok) is None
    return model, tok, drafter


def prompt_for(tok, tools, choice=None, q="Set a timer for the tea."):
    req = GenRequest(model=None, messages=[], tools=tools, tool_choice=choice)
    msgs = [{"role": "user", "content": q}]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    prefix = forced_prefix(req, tok)
    return req, prefix, tok.encode(text + prefix, add_special_tokens=False)


def plain(model, tok, prompt, procs, n=N):
    out = []
    for (y, _), _i in zip(generate_step(mx.array(prompt), model, logits_processors=procs, max_tokens=n), range(n)):
        if int(y) in tok.eos_token_ids:
            break
        out.append(int(y))
    return out


def test_the_grammar_holds_names_keys_and_typed_values(coder):
    _, tok, _ = coder
    tools = tools_for("set_timer", "convert")
    req, _, prompt = prompt_for(tok, tools)
    start = tok.encode("<tool_call>", add_special_tokens=False)

    def allowed(body):
        proc = tool_grammar.call_grammar(req, tok, 4096, prompt)
        ids = start + tok.encode(body, add_special_tokens=False)
        logits = mx.zeros((1, 4096))
        ok = [bool(proc(mx.array(prompt + ids[:i]), logits)[0, t].item() > -float("inf")) for i, t in enumerate(ids)]
        return all(ok)

    good = "\n<function=convert>\n<parameter=value>\n-3.5\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert allowed(good)
    assert allowed("\n<function=set_timer>\n<parameter=minutes>\n5\n</parameter>\n<parameter=loud>\ntrue\n"
                   "</parameter>\n<parameter=label>\ngreen tea\n</parameter>\n</function>\n</tool_call>")
    for bad in (good.replace("convert", "calculator"),  # not offered
                good.replace("-3.5", "cold"),  # a number
                good.replace("celsius", "kelvin"),  # not in the enum
                good.replace("<parameter=value>\n-3.5\n</parameter>\n", ""),  # a required key left out
                good.replace("unit>", "units>"),  # not a key of the tool
                "\n<function=set_timer>\n<parameter=minutes>\n5\n</parameter>\n<parameter=loud>\nyes\n"):
        assert not allowed(bad), bad


@pytest.mark.parametrize("name", fast_first(list(TOOLS)))
def test_forced_calls_parse_with_mlx_lms_parser_and_validate(coder, name):
    model, tok, _ = coder
    tools = tools_for(*TOOLS)
    for choice in ({"name": name}, "required"):
        req, prefix, prompt = prompt_for(tok, tools if choice == "required" else tools_for(name), choice)
        out = plain(model, tok, prompt, [tool_grammar.call_grammar(req, tok, 4096, prompt)])
        ts = ToolStream(tok, tools, prefix)
        calls = [e[1] for e in ts.feed(tok.decode(out)) + ts.finish() if e[0] == "call"]
        assert calls, (choice, tok.decode(out))
        want = name if choice != "required" else calls[0]["name"]
        assert calls[0]["name"] == want and want in TOOLS
        jsonschema.validate(calls[0]["arguments"], TOOLS[want])


@pytest.mark.slow
@pytest.mark.parametrize("width", [3, 5])
def test_dflash_with_the_xml_grammar_is_mlx_lm_with_it(coder, width):
    model, tok, drafter = coder
    for names, choice, q in ((("set_timer", "convert"), None, "Set a timer for the tea."),
                             (("tag_files",), {"name": "tag_files"}, "Tag my files."),
                             (("convert",), "required", "What is 40 F in C?")):
        req, _, prompt = prompt_for(tok, tools_for(*names), choice, q)
        want = plain(model, tok, prompt, [tool_grammar.call_grammar(req, tok, 4096, prompt)], 64)
        cfg = DecodeConfig(max_tokens=64, block_size=width, verify_mode="dflash",
                           logits_processors=[tool_grammar.call_grammar(req, tok, 4096, prompt)])
        rs = list(stream_generate(model, tok, prompt, drafter, config=cfg))
        got = [r.token for r in rs if r.token not in tok.eos_token_ids]
        assert got == want, (tok.decode(got), tok.decode(want))
        assert rs[-1].stats.mode == "dflash" and rs[-1].stats.cycles > 0
