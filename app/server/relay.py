"""Running one generation for an API handler: submit the job, wait for its
start (errors before any output become the API's own error response), then
either collect everything or iterate the events for a stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import List, Optional

from .catalog import Job
from .errors import APIError


class ClientGone(Exception):
    """The client disconnected; nothing more to send."""


@dataclass
class Result:
    text: str = ""
    reasoning: str = ""  # the model's thinking (reasoning.ThinkStream), apart from the answer
    calls: List[dict] = field(default_factory=list)  # {"name", "arguments": dict}, in order
    end: Optional[dict] = None  # the worker's "end" event (finish_reason, stats, timings)


async def start(ctx, request, kind: str, req, model: Optional[str]):
    """(job, model id, the "start" event) once the worker has begun; raises
    APIError for anything the worker refused, ClientGone if the client left."""
    mid = await ctx.model_id(model)
    job = Job(kind, mid, req, asyncio.get_running_loop())
    ctx.worker.submit(job)
    try:
        ev = await ctx.next_event(job, request)
    except BaseException:
        job.cancel.set()
        raise
    if ev is None:
        raise ClientGone()
    if ev[0] == "error":
        raise ev[1]
    return job, mid, ev


def progress_comment(done: int, total: int) -> str:
    """A long prompt's prefill progress on an SSE stream: a comment line, which
    every SSE client skips, so the stream is not idle while the prompt is read."""
    return f": prefill {done}/{total}\n\n"


async def events(ctx, job, request, poll: bool = True, progress: bool = False):
    """The job's remaining events: ("text", s), ("reasoning", s), ("call", c), ("end", info),
    with `progress` also ("progress", (done, total)) during a long prefill; an in-band
    error raises APIError. Cancels the job when the consumer stops."""
    try:
        while True:
            ev = await ctx.next_event(job, request, poll=poll)
            if ev is None:
                raise ClientGone()
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "token":
                if ev[1]:
                    yield "text", ev[1]
            elif ev[0] == "think":
                yield "reasoning", ev[1]
            elif ev[0] == "call":
                yield "call", ev[1]
            elif ev[0] == "progress":
                if progress:
                    yield "progress", ev[1:]
            elif ev[0] == "end":
                yield "end", ev[1]
                return
    finally:
        job.cancel.set()  # no-op once done; stops the worker if the client left


async def collect(ctx, job, request) -> Result:
    r, text, reasoning = Result(), [], []
    async for kind, v in events(ctx, job, request):
        if kind == "text":
            text.append(v)
        elif kind == "reasoning":
            reasoning.append(v)
        elif kind == "call":
            r.calls.append(v)
        else:
            r.end = v
    r.text, r.reasoning = "".join(text), "".join(reasoning)
    return r


async def count(ctx, request, req, model: Optional[str]) -> int:
    """Prompt tokens of a chat request, as the worker would render it."""
    mid = await ctx.model_id(model)
    job = Job("count", mid, req, asyncio.get_running_loop())
    ctx.worker.submit(job)
    ev = await ctx.next_event(job, request)
    if ev is None:
        raise ClientGone()
    if ev[0] == "error":
        raise ev[1]
    return ev[1]


def stats_fields(end: dict) -> dict:
    """The `dflash` object and cached-token count every API reports."""
    rep = report(end["stats"], end)
    return {"dflash": rep["dflash"], "timings": rep["timings"], "cached": end["stats"].reused_tokens,
            "prompt": end["stats"].prompt_tokens, "completion": end["stats"].generation_tokens}


__all__ = ["APIError", "ClientGone", "Result", "start", "events", "collect", "count", "stats_fields",
           "progress_comment"]


def report(stats, end: dict) -> dict:
    """usage + llama.cpp `timings` + `dflash`, from the engine's GenerationStats."""
    s = stats
    prompt_n = s.prompt_tokens - s.reused_tokens
    return {
        "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generation_tokens,
                  "total_tokens": s.prompt_tokens + s.generation_tokens,
                  "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
                  "completion_tokens_details": {"reasoning_tokens": end.get("reasoning_tokens", 0)}},
        "timings": {"cache_n": s.reused_tokens, "prompt_n": prompt_n, "prompt_ms": s.prompt_time * 1000,
                    "prompt_per_token_ms": s.prompt_time * 1000 / prompt_n if prompt_n else 0.0,
                    "prompt_per_second": s.prompt_tps,
                    "predicted_n": s.generation_tokens, "predicted_ms": s.generation_time * 1000,
                    "predicted_per_token_ms": 1000 / s.generation_tps if s.generation_tps else 0.0,
                    "predicted_per_second": s.generation_tps,
                    "draft_n": s.drafted, "draft_n_accepted": s.accepted},
        "dflash": {"tau": s.tau, "cycles": s.cycles, "max_width": s.max_width, "width": s.width, "guard": s.guard, "mode": s.mode,
                   "fallback": s.fallback, "policy": s.policy, "lookup_cycles": s.lookup_cycles,
                   "acceptance_rate": s.acceptance_rate,
                   "reused_prompt_tokens": s.reused_tokens, "ttft_ms": end["ttft_ms"],
                   "queue_ms": end["queue_ms"],
                   **({"distributed": s.distributed} if getattr(s, "distributed", None) else {}),  # split target
                   **({"prompt_cache": s.prompt_cache} if getattr(s, "prompt_cache", None) else {})},  # its tier
    }
