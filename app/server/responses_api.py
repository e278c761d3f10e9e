"""OpenAI's Responses API, /v1/responses: input items (messages, function and
custom tool calls and their outputs), instructions, tools (responses_items),
previous_response_id (conversations kept in memory, bounded), usage with cached
tokens, and the typed event stream (response.created ... response.completed)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import List, Literal, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from .errors import APIError, bad_request
from .relay import ClientGone, Result, collect, events, progress_comment, start, stats_fields
from .responses_items import (
    NamedTool,
    Tools,
    call_item,
    history_turn,
    msg_item,
    reasoning_item,
    to_messages,
    tool_choice,
)
from .schemas import Schema, effort_thinks, thinking_kwargs, unsupported
from .tools import GenRequest

MAX_STORED = 256  # responses kept for previous_response_id (least recently used go first)
MAX_STORED_CHARS = 64 << 20  # and at most this much of their JSON, all together


class TextFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Schema):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # a hint to OpenAI models; nothing to apply


class ResponsesRequest(Schema):
    model: Optional[str] = None
    input: Union[str, List[dict]]
    instructions: Optional[str] = None
    tools: Optional[List[dict]] = None  # function, custom (freeform) and built-in tools (responses_items)
    tool_choice: Union[Literal["auto", "none", "required"], NamedTool, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    metadata: Optional[dict] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[dict] = None  # {"effort": ...}: the template's enable_thinking (effort_thinks)
    # Other fields (include, prompt_cache_key, client_metadata, service_tier, truncation,
    # ...) are accepted and not applied: no encrypted reasoning exists, the prompt cache
    # matches every prompt by prefix, a prompt over the context is a 400, never cut.
    # These would change the answer and cannot be honoured here:
    background: Optional[bool] = None
    conversation: Union[str, dict, None] = None
    prompt: Optional[dict] = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.background:
            raise unsupported("background", "background responses are not supported; send background: false")
        if self.conversation is not None:
            raise unsupported("conversation", "conversations are not stored here; use previous_response_id")
        if self.prompt is not None:
            raise unsupported("prompt", "stored prompt templates are not available here; send input")
        return self

    def thinks(self) -> Optional[bool]:
        r = self.reasoning
        return effort_thinks(r.get("effort")) if isinstance(r, dict) else None


def _usage(end: dict) -> dict:
    s = end["stats"]
    return {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.reused_tokens},
            "output_tokens": s.generation_tokens,
            "output_tokens_details": {"reasoning_tokens": end.get("reasoning_tokens", 0)},
            "total_tokens": s.prompt_tokens + s.generation_tokens}


def register(app, ctx) -> None:
    stored: "OrderedDict[str, tuple]" = OrderedDict()  # response id -> (conversation so far, body, size)

    def base(rid: str, req: ResponsesRequest, mid: str, created: int, status: str, tools: Tools) -> dict:
        choice = req.tool_choice
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": mid,
                "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "store": req.store, "text": {"format": {"type": "text"}},
                "tool_choice": choice.model_dump() if isinstance(choice, NamedTool) else (choice or "auto"),
                "tools": tools.echo, "truncation": "disabled",
                "usage": None}

    def finish(body: dict, end: dict, history: List[dict], out: Result, req: ResponsesRequest,
               tools: Tools) -> dict:
        incomplete = end["finish_reason"] == "length"
        stats = stats_fields(end)["dflash"]
        if tools.not_offered:
            stats["tools_not_offered"] = tools.not_offered
        body.update(status="incomplete" if incomplete else "completed", usage=_usage(end),
                    incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                    completed_at=int(time.time()), dflash=stats)
        if req.store:
            conv = history + [history_turn(out.text, body["output"])]
            stored[body["id"]] = (conv, body, len(json.dumps(conv)) + len(json.dumps(body)))
            while len(stored) > 1 and (len(stored) > MAX_STORED or sum(v[2] for v in stored.values()) > MAX_STORED_CHARS):
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
            history = list(stored[req.previous_response_id][0])
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        history += to_messages(items)
        if not history:
            raise bad_request("input is empty", "input")
        msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
        tools = Tools.parse(req.tools)
        choice = tool_choice(req.tool_choice, tools)
        g = GenRequest(req.model, msgs, tools.template or None, choice, req.parallel_tool_calls is not False,
                       req.max_output_tokens, req.temperature, req.top_p, stream=req.stream, response_format=fmt,
                       template_kwargs=thinking_kwargs(req.thinks()))
        return g, history, tools

    def lookup(rid: str):
        if rid not in stored:
            raise APIError(404, f"response '{rid}' is not stored here (the last {MAX_STORED} with store "
                                "true are kept in memory while the server runs)", None, "not_found")
        return stored[rid]

    @app.get("/v1/responses/{rid}", dependencies=[Depends(ctx.auth)])
    async def retrieve(rid: str):
        return JSONResponse(lookup(rid)[1])

    @app.delete("/v1/responses/{rid}", dependencies=[Depends(ctx.auth)])
    async def delete(rid: str):
        lookup(rid)
        del stored[rid]
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses", dependencies=[Depends(ctx.auth)])
    async def responses(request: Request):
        req = await ctx.parse(request, ResponsesRequest)
        g, history, tools = build(req)
        try:
            job, mid, _ = await start(ctx, request, "chat", g, req.model)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        rid, created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        if req.stream:
            return StreamingResponse(stream(job, request, req, rid, mid, created, history, tools),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await collect(ctx, job, request)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        body = base(rid, req, mid, created, "completed", tools)
        if out.reasoning:
            body["output"].append(reasoning_item(out.reasoning))
        if out.text:
            body["output"].append(msg_item(out.text))
        body["output"] += [call_item(c, tools) for c in out.calls]
        body["output_text"] = out.text
        return JSONResponse(finish(body, out.end, history, out, req, tools))

    async def stream(job, request, req, rid, mid, created, history, tools):
        seq = 0

        def ev(kind: str, **data) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        body = base(rid, req, mid, created, "in_progress", tools)
        yield ev("response.created", response=body)
        yield ev("response.in_progress", response=body)
        out, msg, text = Result(), None, []  # msg: the open message item
        thought, thinking = None, []  # the open reasoning item, its text so far

        def close_msg():
            nonlocal msg
            idx, full = len(body["output"]) - 1, "".join(text)
            done = msg_item(full, iid=msg["id"])
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

        def close_thought():
            nonlocal thought
            idx, full = len(body["output"]) - 1, "".join(thinking)
            done = reasoning_item(full, iid=thought["id"])
            body["output"][idx] = done
            parts = [ev("response.reasoning_text.done", item_id=thought["id"], output_index=idx, content_index=0,
                        text=full),
                     ev("response.content_part.done", item_id=thought["id"], output_index=idx, content_index=0,
                        part=done["content"][0]),
                     ev("response.output_item.done", output_index=idx, item=done)]
            thought = None
            thinking.clear()
            return parts

        try:
            async for kind, v in events(ctx, job, request, poll=False, progress=True):
                if kind == "progress":
                    yield progress_comment(*v)
                    continue
                if kind != "reasoning" and thought is not None:
                    for e in close_thought():
                        yield e
                if kind == "reasoning":
                    if msg is not None:
                        for e in close_msg():
                            yield e
                    if thought is None:
                        thought = reasoning_item("")
                        thought["content"] = []
                        body["output"].append(thought)
                        idx = len(body["output"]) - 1
                        yield ev("response.output_item.added", output_index=idx, item=thought)
                        yield ev("response.content_part.added", item_id=thought["id"], output_index=idx,
                                 content_index=0, part={"type": "reasoning_text", "text": ""})
                    thinking.append(v)
                    out.reasoning += v
                    yield ev("response.reasoning_text.delta", item_id=thought["id"],
                             output_index=len(body["output"]) - 1, content_index=0, delta=v)
                elif kind == "text":
                    if msg is None:
                        msg = msg_item("", "in_progress")
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
                    item = call_item(v, tools)
                    idx = len(body["output"])
                    body["output"].append(item)
                    key, kind = ("arguments", "function_call_arguments") if item["type"] == "function_call" \
                        else ("input", "custom_tool_call_input")
                    yield ev("response.output_item.added", output_index=idx,
                             item={**item, "status": "in_progress", key: ""})
                    yield ev(f"response.{kind}.delta", item_id=item["id"], output_index=idx, delta=item[key])
                    yield ev(f"response.{kind}.done", item_id=item["id"], output_index=idx,
                             **({"name": item["name"]} if key == "arguments" else {}), **{key: item[key]})
                    yield ev("response.output_item.done", output_index=idx, item=item)
                else:
                    if msg is not None:
                        for e in close_msg():
                            yield e
                    finish(body, v, history, out, req, tools)
                    # response.completed even when the answer was cut (the body's status says
                    # "incomplete"): the OpenAI SDK's stream helper and Codex take no other
                    # event as the end of a response (README)
                    yield ev("response.completed", response=body)
        except ClientGone:
            return
        except APIError as e:  # after the headers: in-band, as OpenAI does
            body.update(status="failed", error={"code": e.code or "server_error", "message": e.message})
            yield ev("error", code=e.code, message=e.message, param=e.param)
            yield ev("response.failed", response=body)
