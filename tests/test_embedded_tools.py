"""The embedded target talks to agents (issue 22): mlx-lm sees its tool-call format
(Qwen3's `<tool_call>` JSON, single tokens that decode as text), its chat template
renders tools, calls and results the Qwen3 way, every byte still round-trips through
the reshaped tokenizer, and its context is 32k by YaRN as published models configure it."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tools.embedded import target_tools as TT
from mlx_dflash.models.discovery import models_dir

TARGET = models_dir() / "target"
TOOLS = [TT.tool_schema("calculator"), TT.tool_schema("read_file")]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TARGET, eos_token_ids=[2, 0])


def test_mlx_lm_knows_the_tool_format(tok):
    assert tok.has_tool_calling
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tok.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    for t in TT.TOOL_TOKENS:  # one id each, decoded as the text itself (not dropped as special)
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == t
    assert len(tok.get_vocab()) == json.loads((TARGET / "config.json").read_text())["vocab_size"] == 4096


def test_every_byte_round_trips(tok):
    text = bytes(range(1, 256)).decode("latin-1") + " .<| |> ?<| a<|b|>c <tool_call x> def f(x):\n\treturn  x\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_template_renders_tools_calls_and_results(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 48/2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                              "arguments": {"expression": "48/2"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "24"},
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": [{"type": "text", "text": "And 2+2?"}]}]
    out = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    head = "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    assert out.startswith(head)
    assert "\n<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>\n" in out
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call><|im_end|>\n'
    assert call in out
    assert "<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n" in out
    # a later system message stays in place; list content is its text parts
    assert out.endswith("<|im_start|>system\nAnswer in one line.<|im_end|>\n"
                        "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # the body of the rendered call is what mlx-lm's parser reads back
    body = out.split("<tool_call>")[-1].split("</tool_call>")[0]
    assert tok.tool_parser(body, TOOLS) == {"name": "calculator", "arguments": {"expression": "48/2"}}
    # no tools: the plain ChatML of the original template, byte for byte
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(plain, tokenize=False) == \
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain)


def test_context_is_32k_by_yarn():
    from mlx_lm import load

    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 32768
    assert cfg["rope_scaling"]["rope_type"] == "yarn"
    assert cfg["rope_scaling"]["factor"] * cfg["rope_scaling"]["original_max_position_embeddings"] >= 32768
    model, _ = load(str(TARGET))
    assert type(model.layers[0].self_attn.rope).__name__ == "YarnRoPE"


def test_freed_tokens_are_unused_leaves():
    """Only tokens no other merge builds on are freed, least used first; a token whose
    only user was freed becomes a candidate."""
    j = {"model": {"vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "bc": 5, "cc": 6},
                   "merges": [["a", "b"], ["ab", "c"], ["b", "c"], ["c", "c"]]}}
    counts = {3: 0, 4: 1, 5: 7, 6: 3}
    assert TT.freed_tokens(j, counts, 1) == ["abc"]  # "ab" is used by the "abc" merge
    assert TT.freed_tokens(j, counts, 2) == ["abc", "ab"]
    assert TT.freed_tokens(j, counts, 3) == ["abc", "ab", "cc"]


def test_gsm_annotations_become_calculator_calls():
    import numpy as np

    a = "He has 3*4 = <<3*4=12>>12 eggs.\nAnd 12+1 = <<12+1=13>>13.\n#### 13"
    msgs, tools = TT.gsm_tool_conv("Q?", a, np.random.default_rng(0))
    calls = [m for m in msgs if m.get("tool_calls")]
    assert [c["tool_calls"][0]["function"]["arguments"] for c in calls] == [{"expression": "3*4"},
                                                                             {"expression": "12+1"}]
    assert [m["content"] for m in msgs if m["role"] == "tool"] == ["12", "13"]
    assert calls[1]["content"] == "He has 3*4 = 12 eggs."
    assert msgs[-1] == {"role": "assistant", "content": "And 12+1 = 13.\n#### 13"}
    assert "calculator" in [t["function"]["name"] for t in tools]
