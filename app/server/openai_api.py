"""OpenAI's /v1/chat/completions and /v1/completions: JSON bodies and SSE
streams; tool calls (the worker's "call" events) as `tool_calls`, whole in a
body, one delta per call in a stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import List, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .catalog import Job
from .relay import progress_comment, report
from .schemas import ChatRequest, CompletionRequest
from .tools import call_id

# -- response bodies -----------------------------------------------------------------------

def _lp_block(kind: str, entries: List[dict]) -> Optional[dict]:
    if kind == "chat":
        return {"content": entries}
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": _offsets(entries)}


def _offsets(entries):
    out, n = [], 0
    for e in entries:
        out.append(n)
        n += len(e["token"])
    return out


def _tool_call(c: dict) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}


def register(app, ctx) -> None:
    """Add the two OpenAI endpoints. `ctx` (app.ServerContext) gives the worker,
    auth, request parsing, model-id resolution and the event relay."""
    worker, model_id, next_event, parse, auth = ctx.worker, ctx.model_id, ctx.next_event, ctx.parse, ctx.auth

    async def complete(request: Request, kind: str, req):
        mid = await model_id(req.model)
        job = Job(kind, mid, req.gen() if kind == "chat" else req, asyncio.get_running_loop())
        worker.submit(job)
        try:
            ev = await next_event(job, request)
        except BaseException:
            job.cancel.set()
            raise
        if ev is None:
            return JSONResponse({}, status_code=499)
        if ev[0] == "error":
            return ev[1].response()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(sse(job, request, req, kind, rid, created, mid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, lps, calls, reasoning = [], [], [], []
        try:
            while True:
                ev = await next_event(job, request)
                if ev is None:
                    return JSONResponse({}, status_code=499)
                if ev[0] == "error":
                    return ev[1].response()
                if ev[0] == "progress":
                    continue
                if ev[0] == "think":
                    reasoning.append(ev[1])
                    continue
                if ev[0] == "token":
                    text.append(ev[1])
                    if ev[3] is not None:
                        lps.append(ev[3])
                    continue
                if ev[0] == "call":
                    calls.append(_tool_call(ev[1]))
                    continue
                end = ev[1]
                break
        finally:
            job.cancel.set()  # no-op once done; stops the worker if this handler was cancelled
        lp = _lp_block(kind, lps) if req.n_logprobs() is not None else None
        if kind == "chat":
            msg = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": end["finish_reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": lp, "finish_reason": end["finish_reason"]}
            obj = "text_completion"
        body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [choice],
                **report(end["stats"], end)}
        return JSONResponse(body)

    async def sse(job, request, req, kind, rid, created, mid):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        want_lp = req.n_logprobs() is not None

        def chunk(delta_text=None, finish=None, lp=None, role=False, extra=None, tool_call=None, reasoning=None):
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if delta_text is None else {"content": delta_text})
                if tool_call is not None:
                    delta = {"tool_calls": [tool_call]}
                if reasoning is not None:
                    delta = {"reasoning_content": reasoning}
                ch = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                ch = {"index": 0, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [ch]}
            if extra:
                body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        n_calls = 0
        try:
            if kind == "chat":
                yield chunk(role=True)
            leftover = ""
            while True:
                ev = await next_event(job, request, poll=False)
                if ev is None:
                    return
                if ev[0] == "error":  # after the headers: report in-band, as OpenAI does
                    e = ev[1]
                    yield f"data: {json.dumps(json.loads(e.response().body))}\n\n"
                    break
                if ev[0] == "progress":
                    yield progress_comment(*ev[1:])
                    continue
                if ev[0] == "think":
                    yield chunk(reasoning=ev[1])
                    continue
                if ev[0] == "token":
                    _, text, token, lp = ev
                    if token is None:  # EOS: not a token of the text, only flushes it
                        leftover += text
                        continue
                    if text or (want_lp and lp):
                        yield chunk(text, lp=_lp_block(kind, [lp]) if want_lp and lp else None)
                    continue
                if ev[0] == "call":
                    if leftover:
                        yield chunk(leftover)
                        leftover = ""
                    yield chunk(extra=None, tool_call={**_tool_call(ev[1]), "index": n_calls})
                    n_calls += 1
                    continue
                end = ev[1]
                rep = report(end["stats"], end)
                yield chunk(leftover or None, end["finish_reason"],
                            extra={"timings": rep["timings"], "dflash": rep["dflash"]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [], **rep}
                    yield f"data: {json.dumps(body)}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client left (or we are done): stop generating

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(request: Request):
        return await complete(request, "chat", await parse(request, ChatRequest))

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(request: Request):
        return await complete(request, "completion", await parse(request, CompletionRequest))

