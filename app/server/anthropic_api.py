"""Anthropic's Messages API, /v1/messages and /v1/messages/count_tokens:
system, content blocks, tool_use / tool_result, stop_sequences, streaming in
Anthropic's event order, and errors in Anthropic's format. This is what Claude
Code talks to (ANTHROPIC_BASE_URL=http://127.0.0.1:8000)."""

from __future__ import annotations

import json
import uuid
from typing import List, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from .errors import APIError, ContextTooLong, bad_request
from .relay import ClientGone, collect, count, events, progress_comment, start, stats_fields
from .schemas import MAX_STOP, Schema, ignored, thinking_kwargs
from .tools import GenRequest, check_tool_choice

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_response(e: APIError) -> JSONResponse:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": error_message(e)}}
    return JSONResponse(body, status_code=e.status)


def error_message(e: APIError) -> str:
    """`e`'s message as a Messages client reads it: an over-long prompt in the
    Anthropic API's words ("prompt is too long: N tokens > M maximum"), which
    Claude Code matches to tell a too-long prompt from other errors."""
    if isinstance(e, ContextTooLong):
        return f"prompt is too long: {e.tokens} tokens > {e.limit} maximum ({e.message}); /compact or start a new " \
               "conversation"
    return e.message


class Tool(Schema):
    """A client tool. Others fields Claude Code sends (cache_control, defer_loading,
    input_examples, ...) are accepted and not applied: every tool is in the prompt,
    the prompt cache matches every prefix. `strict` makes the tool-call grammar
    hold the input to `input_schema` (tool_grammar.py)."""

    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict
    strict: Optional[bool] = None
    type: Optional[Literal["custom"]] = None


class _WithTools(Schema):
    @model_validator(mode="before")
    @classmethod
    def _client_tools(cls, data):
        """Server tools (web search, code execution, ...: a `type` other than custom)
        run at Anthropic: not offered to the model, named in the log."""
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list):
            keep = [t for t in tools if not isinstance(t, dict) or t.get("type") in (None, "custom")]
            if len(keep) < len(tools):
                ignored("tools", {str(t.get("type")) for t in tools if t not in keep})
                data = {**data, "tools": keep}
        return data


class OutputConfig(Schema):
    effort: Optional[str] = None  # a hint to Anthropic models; nothing to apply here
    format: Optional[dict] = None  # {"type": "json_schema", "schema": {...}}: a constrained decode


class ToolChoice(Schema):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(Schema):
    type: str  # enabled / adaptive / disabled: the template's enable_thinking
    budget_tokens: Optional[int] = None  # not applied: reasoning ends where the model ends it

    def on(self) -> Optional[bool]:
        return {"enabled": True, "adaptive": True, "disabled": False}.get(self.type)


class MessagesRequest(_WithTools):
    model: Optional[str] = None
    messages: List[dict] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, List[dict], None] = None
    stop_sequences: Optional[List[str]] = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    metadata: Optional[dict] = None  # user_id: the caller's metadata, nothing to apply
    thinking: Optional[Thinking] = None  # passed to the template as enable_thinking
    output_config: Optional[OutputConfig] = None
    output_format: Optional[dict] = None  # the older name of output_config.format
    # Claude Code sends it; no context edits are made (the response says so in
    # context_management.applied_edits)
    context_management: Optional[dict] = None


class CountRequest(_WithTools):
    model: Optional[str] = None
    messages: List[dict] = Field(min_length=1)
    system: Union[str, List[dict], None] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


# -- Anthropic messages -> template messages ----------------------------------------------

def _text(blocks, where: str, placeholders: bool = False) -> str:
    """The text of a string or text blocks. With `placeholders` (a tool's result,
    which the agent cannot choose), an image or document block becomes a line
    saying it was left out; otherwise it is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        elif placeholders and kind in ("image", "document"):
            out.append(f"[{kind} left out: this model reads text only]")
        else:
            raise bad_request(f"{where}[{j}]: block type '{kind}' is not supported here (text only)", where)
    return "".join(out)


def _messages(req) -> List[dict]:
    msgs: List[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role, content = m.get("role") if isinstance(m, dict) else None, m.get("content") if isinstance(m, dict) else None
        if role in ("system", "developer"):  # mid-conversation (Claude Code): the worker places it
            msgs.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user, assistant or system", where)
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", where)
        text, calls = [], []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif t == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                        or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{w}: tool_use needs id and name (strings) and input (an object)", w)
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input") or {}}})
            elif t == "tool_result" and role == "user":
                if text:  # keep the order: text before the result is its own turn
                    msgs.append({"role": "user", "content": "".join(text)})
                    text = []
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad_request(f"{w}: tool_result needs tool_use_id", w)
                out = _text(b.get("content", ""), f"{w}.content", placeholders=True)
                if b.get("is_error"):
                    out = "Error: " + out
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": out})
            elif t in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning: templates drop it too
            elif role == "assistant" and t in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                                               "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                                               "container_upload"):
                ignored("assistant block", [t])  # server tools' turns (run at Anthropic): nothing to render
            else:
                raise bad_request(f"{w}: block type '{t}' is not supported in a {role} message", w)
        if role == "assistant" and (text or calls):
            turn = {"role": "assistant", "content": "".join(text)}
            if calls:
                turn["tool_calls"] = calls
            msgs.append(turn)
        elif text:
            msgs.append({"role": role, "content": "".join(text)})
    return msgs


def _gen(req) -> GenRequest:
    tools = [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description else {}),
                                               "parameters": t.input_schema, **({"strict": True} if t.strict else {})}}
             for t in req.tools] if req.tools else None
    tc = req.tool_choice
    choice, parallel = "auto", True
    if tc is not None:
        choice = {"auto": "auto", "any": "required", "none": "none", "tool": {"name": tc.name}}[tc.type]
        parallel = not tc.disable_parallel_tool_use
        if tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice type 'tool' needs a name", "tool_choice")
    check_tool_choice(tools, choice)
    kw = thinking_kwargs(req.thinking.on() if req.thinking else None)
    g = GenRequest(req.model, _messages(req), tools, choice, parallel, template_kwargs=kw)
    if isinstance(req, MessagesRequest):
        from .structured import parse_format

        g.max_tokens, g.temperature, g.top_p, g.top_k = req.max_tokens, req.temperature, req.top_p, req.top_k
        g.stop, g.stream = list(req.stop_sequences or []), req.stream
        fmt, param = req.output_format, "output_format"
        if req.output_config is not None and req.output_config.format is not None:
            fmt, param = req.output_config.format, "output_config.format"
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise bad_request(f"{param}.type must be 'json_schema'", param)
            g.response_format = parse_format("json_schema", fmt.get("schema"), param)
    return g


def _usage(end: dict) -> dict:
    s = end["stats"]
    return {"input_tokens": s.prompt_tokens - s.reused_tokens, "output_tokens": s.generation_tokens,
            "cache_read_input_tokens": s.reused_tokens, "cache_creation_input_tokens": 0}


def _thinking_block(text: str) -> dict:
    # the signature field is there because the SDK expects one; nothing here signs it
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_block(c: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": c["name"], "input": c["arguments"]}


def register(app, ctx) -> None:
    async def checked(request: Request, cls):
        """Auth and body in Anthropic's error format (x-api-key or a bearer token)."""
        await ctx.auth(request)
        return await ctx.parse(request, cls)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            req = await checked(request, MessagesRequest)
            g = _gen(req)
            job, mid, started = await start(ctx, request, "chat", g, req.model)
        except APIError as e:
            return error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        mid_ = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(stream(job, request, mid_, mid, started[1]["prompt_tokens"]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await collect(ctx, job, request)
        except APIError as e:
            return error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        content = ([_thinking_block(out.reasoning)] if out.reasoning else []) + \
            ([{"type": "text", "text": out.text}] if out.text else []) + [_tool_block(c) for c in out.calls]
        end = out.end
        body = {"id": mid_, "type": "message", "role": "assistant", "model": mid, "content": content,
                "stop_reason": _stop_reason(end), "stop_sequence": end.get("stop_sequence"),
                "usage": _usage(end), "dflash": stats_fields(end)["dflash"]}
        if req.context_management is not None:
            body["context_management"] = {"applied_edits": []}
        return JSONResponse(body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            req = await checked(request, CountRequest)
            n = await count(ctx, request, _gen(req), req.model)
        except APIError as e:
            return error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        return JSONResponse({"input_tokens": n})

    async def stream(job, request, msg_id, mid, n_prompt):
        def ev(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        head = {"id": msg_id, "type": "message", "role": "assistant", "model": mid, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": n_prompt, "output_tokens": 0}}
        yield ev("message_start", message=head)
        index, open_block = 0, None  # the kind of the open block: "text" | "reasoning" | None
        try:
            async for kind, v in events(ctx, job, request, poll=False, progress=True):
                if kind == "progress":
                    yield progress_comment(*v)
                    continue
                if open_block is not None and kind != open_block:
                    if open_block == "reasoning":
                        yield ev("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
                    yield ev("content_block_stop", index=index)
                    index, open_block = index + 1, None
                if kind == "text":
                    if open_block is None:
                        yield ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
                        open_block = kind
                    yield ev("content_block_delta", index=index, delta={"type": "text_delta", "text": v})
                    continue
                if kind == "reasoning":
                    if open_block is None:
                        yield ev("content_block_start", index=index, content_block=_thinking_block(""))
                        open_block = kind
                    yield ev("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": v})
                    continue
                if kind == "call":
                    b = _tool_block(v)
                    yield ev("content_block_start", index=index, content_block={**b, "input": {}})
                    yield ev("content_block_delta", index=index,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(v["arguments"])})
                    yield ev("content_block_stop", index=index)
                    index += 1
                    continue
                yield ev("message_delta", delta={"stop_reason": _stop_reason(v), "stop_sequence": v.get("stop_sequence")},
                         usage=_usage(v), dflash=stats_fields(v)["dflash"])
                yield ev("message_stop")
        except ClientGone:
            return
        except APIError as e:  # after the headers: Anthropic's in-band error event
            yield ev("error", error={"type": ERROR_TYPES.get(e.status, "api_error"), "message": error_message(e)})


def _stop_reason(end: dict) -> str:
    if end.get("stop_sequence"):
        return "stop_sequence"
    return STOP_REASONS.get(end["finish_reason"], "end_turn")


__all__ = ["register", "error_response", "MessagesRequest"]
