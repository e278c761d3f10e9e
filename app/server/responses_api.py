"""OpenAI's Responses API, /v1/responses: input items (messages, function
calls and their outputs), instructions, function tools, previous_response_id
(conversations kept in memory, bounded), usage with cached tokens, and the
typed event stream (response.created ... response.completed)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Dict, List, Literal, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from . import relay
from .errors import APIError, _bad
from .schemas import _Strict
from .tools import GenRequest, call_id, check_tool_choice

MAX_STORED = 256  # responses kept for previous_response_id (least recently used go first)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class NamedTool(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # a hint to OpenAI models; nothing to apply


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, List[dict]]
    instructions: Optional[str] = None
    tools: Optional[List[FunctionTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedTool, None] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    metadata: Optional[Dict[str, str]] = None
    text: Optional[TextConfig] = None
    # accepted, documented as having no effect on a local model: reasoning effort
    # (the model reasons as its template does), include (no encrypted reasoning
    # exists), prompt_cache_key (the prompt cache matches every prompt by prefix)
    reasoning: Optional[dict] = None
    include: Optional[List[str]] = None
    prompt_cache_key: Optional[str] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None


# -- input items -> template messages ---------------------------------------------------

def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of parts", where)
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise _bad(f"{where}.content[{j}]: content type '{kind}' is not supported (text only)", where)
        out.append(p["text"])
    return "".join(out)


def _messages(items: List[dict]) -> List[dict]:
    msgs: List[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad(f"{where} must be an object", where)
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant", where)
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(it.get("content"), where)})
        elif t == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"{where}: a function_call needs call_id, name and arguments (strings)", where)
            from .tools import arguments_dict

            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": arguments_dict(it["arguments"])}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # parallel calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif t == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output needs call_id", where)
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        elif t == "reasoning":  # an earlier turn's reasoning: templates drop it too
            continue
        else:
            raise _bad(f"{where}: input item type '{t}' is not supported", where)
    return msgs


# -- output ---------------------------------------------------------------------------------

def _msg_item(text: str, status: str = "completed", iid: Optional[str] = None) -> dict:
    return {"type": "message", "id": iid or "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(c: dict, status: str = "completed", args: Optional[str] = None) -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": c.get("call_id") or call_id(),
            "name": c["name"], "status": status,
            "arguments": args if args is not None else json.dumps(c["arguments"], ensure_ascii=False)}


def _usage(end: dict) -> dict:
    s = end["stats"]
    return {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.reused_tokens},
            "output_tokens": s.generation_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + s.generation_tokens}


def register(app, ctx) -> None:
    stored: "OrderedDict[str, List[dict]]" = OrderedDict()  # response id -> the conversation so far

    def base(rid: str, req: ResponsesRequest, mid: str, created: int, status: str) -> dict:
        choice = req.tool_choice
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": mid,
                "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "store": req.store, "text": {"format": {"type": "text"}},
                "tool_choice": choice.model_dump() if isinstance(choice, NamedTool) else (choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "truncation": "disabled",
                "usage": None}

    def finish(body: dict, end: dict, history: List[dict], out: relay.Result, req: ResponsesRequest) -> dict:
        incomplete = end["finish_reason"] == "length"
        body.update(status="incomplete" if incomplete else "completed", usage=_usage(end),
                    incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                    completed_at=int(time.time()), **{"dflash": relay.stats_fields(end)["dflash"]})
        if req.store:
            turn = {"role": "assistant", "content": out.text}
            calls = [i for i in body["output"] if i["type"] == "function_call"]
            if calls:
                turn["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
                    "name": c["name"], "arguments": json.loads(c["arguments"])}} for c in calls]
            stored[body["id"]] = history + [turn]
            while len(stored) > MAX_STORED:
                stored.popitem(last=False)
        return body

    def build(req: ResponsesRequest):
        from .structured import parse_format

        tf = req.text.format if req.text is not None else None
        fmt = parse_format(tf.type if tf else None, tf.schema_ if tf else None, "text.format")
        history: List[dict] = []
        if req.previous_response_id is not None:
            if req.previous_response_id not in stored:
                raise APIError(404, f"previous response '{req.previous_response_id}' is not stored here "
                               f"(responses are kept in memory, the last {MAX_STORED}, while the server runs)",
                               "previous_response_id", "not_found")
            stored.move_to_end(req.previous_response_id)
            history = list(stored[req.previous_response_id])
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        history += _messages(items)
        if not history:
            raise _bad("input is empty", "input")
        msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in req.tools] if req.tools else None
        choice = {"name": req.tool_choice.name} if isinstance(req.tool_choice, NamedTool) else req.tool_choice
        check_tool_choice(tools, choice)
        g = GenRequest(req.model, msgs, tools, choice, req.parallel_tool_calls is not False,
                       req.max_output_tokens, req.temperature, req.top_p, stream=req.stream, response_format=fmt)
        return g, history

    @app.post("/v1/responses", dependencies=[Depends(ctx.auth)])
    async def responses(request: Request):
        req = await ctx.parse(request, ResponsesRequest)
        g, history = build(req)
        try:
            job, mid, _ = await relay.start(ctx, request, "chat", g, req.model)
        except relay.ClientGone:
            return JSONResponse({}, status_code=499)
        rid, created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        if req.stream:
            return StreamingResponse(stream(job, request, req, rid, mid, created, history),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await relay.collect(ctx, job, request)
        except relay.ClientGone:
            return JSONResponse({}, status_code=499)
        body = base(rid, req, mid, created, "completed")
        if out.text:
            body["output"].append(_msg_item(out.text))
        body["output"] += [_call_item(c) for c in out.calls]
        body["output_text"] = out.text
        return JSONResponse(finish(body, out.end, history, out, req))

    async def stream(job, request, req, rid, mid, created, history):
        seq = 0

        def ev(kind: str, **data) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        body = base(rid, req, mid, created, "in_progress")
        yield ev("response.created", response=body)
        yield ev("response.in_progress", response=body)
        out, msg, text = relay.Result(), None, []  # msg: the open message item

        def close_msg():
            nonlocal msg
            idx, full = len(body["output"]) - 1, "".join(text)
            done = _msg_item(full, iid=msg["id"])
            body["output"][idx] = done
            part = done["content"][0]
            parts = [ev("response.output_text.done", item_id=msg["id"], output_index=idx, content_index=0,
                        text=full, logprobs=[]),
                     ev("response.content_part.done", item_id=msg["id"], output_index=idx, content_index=0,
                        part=part),
                     ev("response.output_item.done", output_index=idx, item=done)]
            msg = None
            text.clear()
            return parts

        try:
            async for kind, v in relay.events(ctx, job, request, poll=False):
                if kind == "text":
                    if msg is None:
                        msg = _msg_item("", "in_progress")
                        msg["content"] = []
                        body["output"].append(msg)
                        idx = len(body["output"]) - 1
                        yield ev("response.output_item.added", output_index=idx, item=msg)
                        yield ev("response.content_part.added", item_id=msg["id"], output_index=idx,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})
                    text.append(v)
                    out.text += v
                    yield ev("response.output_text.delta", item_id=msg["id"], output_index=len(body["output"]) - 1,
                             content_index=0, delta=v, logprobs=[])
                elif kind == "call":
                    if msg is not None:
                        for e in close_msg():
                            yield e
                    item = _call_item(v)
                    idx = len(body["output"])
                    body["output"].append(item)
                    yield ev("response.output_item.added", output_index=idx,
                             item={**item, "status": "in_progress", "arguments": ""})
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                             delta=item["arguments"])
                    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             name=item["name"], arguments=item["arguments"])
                    yield ev("response.output_item.done", output_index=idx, item=item)
                else:
                    if msg is not None:
                        for e in close_msg():
                            yield e
                    finish(body, v, history, out, req)
                    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                    yield ev(kind, response=body)
        except relay.ClientGone:
            return
        except APIError as e:  # after the headers: in-band, as OpenAI does
            body.update(status="failed", error={"code": e.code or "server_error", "message": e.message})
            yield ev("error", code=e.code, message=e.message, param=e.param)
            yield ev("response.failed", response=body)
