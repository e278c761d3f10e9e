"""Responses API items and tools, to and from the chat-template form.

Tools: `function` tools as they are; `custom` (freeform) tools, such as Codex's
apply_patch, are shown to the model as a function with one string parameter
`input`, and its calls come back as `custom_tool_call` items carrying that
string; the function and custom tools inside a `namespace` tool (Codex groups
MCP tools so) are offered like the others, and their calls name the namespace.
Built-in tools (web_search, file_search, code_interpreter, image_generation,
...) and any other type run at OpenAI, not here: they are not offered to the
model, and the response lists them under `dflash.tools_not_offered`."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import List, Literal, Optional

from pydantic import Field, ValidationError

from .errors import bad_request
from .schemas import Schema, ignored, validation_error
from .tools import arguments_dict, call_id, check_tool_choice


class FunctionTool(Schema):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class CustomTool(Schema):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    format: Optional[dict] = None  # text or a grammar: described to the model, not enforced


class NamedTool(Schema):
    type: Literal["function", "custom"]
    name: str


@dataclass
class Tools:
    """The request's tools, split by kind."""

    template: List[dict] = field(default_factory=list)  # for the chat template
    custom: set = field(default_factory=set)  # names of freeform tools
    not_offered: List[str] = field(default_factory=list)  # built-in and unknown tool types (run at OpenAI)
    echo: List[dict] = field(default_factory=list)  # as the client sent them, for the response body
    namespace: dict = field(default_factory=dict)  # tool name -> the namespace tool it came in

    @classmethod
    def parse(cls, raw: Optional[list]) -> "Tools":
        t = cls()
        for i, d in enumerate(raw or []):
            if not isinstance(d, dict):
                raise bad_request(f"tools[{i}] must be an object", f"tools[{i}]")
            t._add(d, f"tools[{i}]")
            t.echo.append(d)
        if t.not_offered:
            ignored("tools", t.not_offered)
        return t

    def _add(self, d: dict, where: str, namespace: Optional[str] = None) -> None:
        kind = d.get("type")
        try:
            if kind == "function":
                f = FunctionTool.model_validate(d)
                self.template.append({"type": "function", "function": f.model_dump(exclude={"type"}, exclude_none=True)})
            elif kind == "custom":
                c = CustomTool.model_validate(d)
                desc = (c.description or "") + _format_note(c.format)
                self.template.append({"type": "function", "function": {
                    "name": c.name, "description": desc.strip(),
                    "parameters": {"type": "object", "properties": {"input": {
                        "type": "string", "description": "the raw input, as text (not JSON)"}},
                        "required": ["input"]}}})
                self.custom.add(c.name)
            elif kind == "namespace" and namespace is None and isinstance(d.get("tools"), list):
                for j, sub in enumerate(d["tools"]):
                    if isinstance(sub, dict):
                        self._add(sub, f"{where}.tools[{j}]", str(d.get("name") or ""))
                return
            else:
                self.not_offered.append(str(kind))
                return
        except ValidationError as e:
            err = validation_error(e)
            err.message, err.param = f"{where}: {err.message}", where
            raise err from None
        if namespace:
            self.namespace[self.template[-1]["function"]["name"]] = namespace


def _format_note(fmt) -> str:
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        return ""
    return f"\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt.get('definition', '')}"


def tool_choice(choice, tools: Tools):
    """The request's tool_choice in GenRequest form, checked against the tools."""
    if isinstance(choice, NamedTool):
        choice = {"name": choice.name}
    elif isinstance(choice, dict):  # e.g. {"type": "web_search"}: a built-in, not offered here
        ignored("tool_choice", [str(choice.get("type"))])
        choice = "auto"
    check_tool_choice(tools.template or None, choice)
    return choice


# -- input items -> template messages ---------------------------------------------------

def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", where)
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad_request(f"{where}.content[{j}]: content type '{kind}' is not supported (text only)", where)
        out.append(p["text"])
    return "".join(out)


def _add_call(msgs: List[dict], call: dict) -> None:
    last = msgs[-1] if msgs else None
    if last is not None and last["role"] == "assistant":  # parallel calls: one assistant turn
        last.setdefault("tool_calls", []).append(call)
    else:
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})


def to_messages(items: List[dict]) -> List[dict]:
    msgs: List[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(f"{where} must be an object", where)
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", where)
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(it.get("content"), where)})
        elif t in ("function_call", "custom_tool_call"):
            key = "arguments" if t == "function_call" else "input"
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", key)):
                raise bad_request(f"{where}: a {t} needs call_id, name and {key} (strings)", where)
            args = arguments_dict(it[key]) if t == "function_call" else {"input": it[key]}
            _add_call(msgs, {"id": it["call_id"], "type": "function",
                             "function": {"name": it["name"], "arguments": args}})
        elif t in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str):
                raise bad_request(f"{where}: a {t} needs call_id", where)
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        elif t == "reasoning":  # an earlier turn's reasoning: templates drop it too
            continue
        else:  # built-in tool calls (web_search_call, ...), compaction, item references: nothing to render
            ignored("input item", [str(t)])
    return msgs


# -- output items ------------------------------------------------------------------------------

def msg_item(text: str, status: str = "completed", iid: Optional[str] = None) -> dict:
    return {"type": "message", "id": iid or "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, status: str = "completed", iid: Optional[str] = None) -> dict:
    """The model's thinking as a reasoning item (its text in `content`; no summary is written)."""
    return {"type": "reasoning", "id": iid or "rs_" + uuid.uuid4().hex[:24], "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def call_item(c: dict, tools: Tools) -> dict:
    """A parsed call as a function_call item, or a custom_tool_call with its raw input."""
    if c["name"] in tools.custom:
        args = c["arguments"]
        strings = [v for v in args.values() if isinstance(v, str)]
        raw = args["input"] if isinstance(args.get("input"), str) else \
            (strings[0] if len(args) == 1 and strings else json.dumps(args, ensure_ascii=False))
        return {"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex[:24], "call_id": call_id(),
                "name": c["name"], "input": raw, "status": "completed"}
    item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call_id(),
            "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False), "status": "completed"}
    if c["name"] in tools.namespace:
        item["namespace"] = tools.namespace[c["name"]]
    return item


def history_turn(text: str, output: List[dict]) -> dict:
    """The assistant turn a response adds to its conversation (previous_response_id)."""
    turn = {"role": "assistant", "content": text}
    calls = [{"id": i["call_id"], "type": "function", "function": {
        "name": i["name"], "arguments": arguments_dict(i["arguments"]) if i["type"] == "function_call"
        else {"input": i["input"]}}} for i in output if i["type"] in ("function_call", "custom_tool_call")]
    if calls:
        turn["tool_calls"] = calls
    return turn
