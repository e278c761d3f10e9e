"""Tool calls: the request shape every API is turned into (`GenRequest`), the
tool_choice rules, and `ToolStream`, which splits a model's streamed text into
content and calls using the tokenizer's own markers and mlx-lm's parser for
its format. A call that does not parse comes back as text, as the model wrote it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from .errors import bad_request


@dataclass
class GenRequest:
    """One chat generation, whatever API asked for it. `messages` are the dicts
    the chat template takes (tool calls with dict arguments); `tools` are
    OpenAI-style function tools ({"type": "function", "function": {...}})."""

    model: Optional[str]
    messages: List[dict]
    tools: Optional[List[dict]] = None
    tool_choice: Union[str, dict, None] = None  # "auto" | "none" | "required" | {"name": ...}
    parallel_tool_calls: bool = True
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    logprobs: Optional[int] = None  # None: not asked for; n: that many alternatives
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    template_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking
    response_format: Any = None  # structured.Format: a constrained decode (inside the verify)

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def stops(self) -> List[str]:
        return list(self.stop)

    def n_logprobs(self) -> Optional[int]:
        return self.logprobs

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def forced_name(choice) -> Optional[str]:
    return choice.get("name") if isinstance(choice, dict) else None


def check_tool_choice(tools: Optional[list], choice, param: str = "tool_choice") -> None:
    names = [t["function"]["name"] for t in tools or []]
    if choice in (None, "auto", "none"):
        return
    if not names:
        raise bad_request(f"{param} '{forced_name(choice) or choice}' needs tools", param)
    name = forced_name(choice)
    if name is not None and name not in names:
        raise bad_request(f"{param} names function '{name}', which is not in tools", param)


def template_tools(req: GenRequest) -> Optional[List[dict]]:
    """The tools the model is shown: none for tool_choice "none", only the
    named one when a function is forced."""
    if not req.uses_tools():
        return None
    name = forced_name(req.tool_choice)
    return [t for t in req.tools if t["function"]["name"] == name] if name else list(req.tools)


def forced_prefix(req: GenRequest, tok) -> str:
    """Text put after the generation prompt so the model starts a call
    ("required" / a named function); its distribution from there is untouched."""
    if not req.uses_tools() or req.tool_choice in (None, "auto"):
        return ""
    prefix = tok.tool_call_start
    name = forced_name(req.tool_choice)
    if name and parser_name(tok) == "json_tools":  # the format is known: name the function too
        prefix += "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
    elif name and parser_name(tok) == "qwen3_coder":
        prefix += f"\n<function={name}>\n"
    return prefix


def parser_name(tok) -> Optional[str]:
    p = getattr(tok, "tool_parser", None)
    return getattr(p, "__module__", "").rsplit(".", 1)[-1] if p is not None else None


def arguments_dict(args) -> Any:
    """Arguments as templates want them (a dict); a string that is not a JSON object stays as it is."""
    if isinstance(args, str):
        try:
            v = json.loads(args)
        except ValueError:
            return args
        return v if isinstance(v, dict) else args
    return args


def call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


class ToolStream:
    """Feed text pieces; get back ("text", s) and ("call", {"name", "arguments"})
    events. Text that may be the start of a call marker is held back until it
    is known not to be one."""

    def __init__(self, tok, tools: Optional[list], prefix: str = ""):
        self.start, self.end = tok.tool_call_start, tok.tool_call_end
        self.parser = tok.tool_parser
        self.tools = tools
        self.buf = ""
        self.inside = False
        self.calls = 0
        if prefix:  # already in the prompt: a call is open; not echoed unless it fails to parse
            self.buf = prefix[len(self.start):]
            self.inside = True

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while True:
            if not self.inside:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = partial_marker(self.buf, self.start)
                    if len(self.buf) > keep:
                        out.append(("text", self.buf[: len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append(("text", self.buf[:i]))
                self.buf, self.inside = self.buf[i + len(self.start):], True
            j = self.buf.find(self.end) if self.end else -1
            if j < 0:
                return out
            body, self.buf, self.inside = self.buf[:j], self.buf[j + len(self.end):], False
            out += self._parse(body, closed=True)

    def finish(self) -> list:
        """The end of generation: what is held back, or an unclosed call."""
        if self.inside:
            body, self.buf, self.inside = self.buf, "", False
            return self._parse(body, closed=False)
        out = [("text", self.buf)] if self.buf else []
        self.buf = ""
        return out

    def _parse(self, body: str, closed: bool) -> list:
        raw = self.start + body + (self.end if closed else "")
        try:
            parsed = self.parser(body, self.tools)
        except Exception:  # any parser failure: the model's text, as written
            return [("text", raw)]
        calls = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for c in calls:
            if not (isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"]):
                return [("text", raw)]
            args = c.get("arguments", {})
            if isinstance(args, str):
                args = arguments_dict(args)
            if not isinstance(args, dict):
                return [("text", raw)]
            out.append(("call", {"name": c["name"], "arguments": args}))
        self.calls += len(out)
        return out


def partial_marker(s: str, marker: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of `marker`."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0
