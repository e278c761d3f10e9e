"""The FastAPI app: errors, auth, request parsing, model ids, and the routes
shared by every API (health, models, metrics). Host, Origin, content type and
body size are checked before any of this (security.RequestGate)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

import mlx_dflash

from .anthropic_api import error_response as messages_error
from .anthropic_api import register as register_messages
from .catalog import Job, ManagerCatalog
from .errors import APIError, bad_request, error_line
from .openai_api import register as register_openai
from .responses_api import register as register_responses
from .schemas import validation_error
from .security import CUT_KEY, MAX_BODY, SENT_KEY, STATS_KEY, AccessRules, RequestGate, RequestLog, make_auth
from .worker import Worker

ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in a JSON body
NAMES_TTL = 10.0  # seconds a resolved model name is remembered (a newly downloaded model shows up after it)


def _render_error(path: str, e: APIError):
    """An error in the format of the API at `path` (for security.RequestGate)."""
    if path.startswith("/v1/messages"):
        return messages_error(e)
    return e.response()


@dataclass
class ServerContext:
    """What every API module needs from the app (each module's `register(app, ctx)`)."""

    worker: Worker
    auth: Callable  # FastAPI dependency: the API key check
    parse: Callable  # async (request, pydantic class) -> validated body
    model_id: Callable  # async (requested name or None) -> served model id
    next_event: Callable  # async (job, request, poll=True) -> the worker's next event or None


def create_app(catalog=None, *, api_key: Optional[str] = None, cors: tuple = (), queue_size: int = 8,
               max_batch=1, model: Optional[str] = None, preload: Optional[str] = None, store=None,
               allowed_hosts: tuple = (),
               max_body: int = MAX_BODY,
               log: bool = False, strict_models: bool = False) -> FastAPI:
    """The FastAPI app. `catalog` (default: the model manager's) provides
    targets(), default(), find(name, served), settings(id) and load(id) ->
    LoadedModel. `model`, when given, is loaded at startup and is the default for
    requests that name none; `preload`, when given, is loaded at startup too,
    without becoming the default (`serve` without --model: the settings' default
    model, which requests follow as the settings change). A request naming a
    model this server does not have (a client's own default, `gpt-4o`,
    `claude-...`) is answered by the default model, and the response's `model`
    says which; `strict_models` answers 404 instead. `allowed_hosts` / `cors` extend the Host and Origin allow-lists
    (security.AccessRules); `log` writes one line per request to stderr."""
    from contextlib import asynccontextmanager

    catalog = catalog or ManagerCatalog(store)
    worker = Worker(catalog, queue_size, max_batch)
    names: Dict[str, tuple] = {}  # requested name -> (served id or None if unknown, when resolved)
    request_log = RequestLog(sys.stderr if log else None)

    def refresh() -> Dict[str, dict]:
        try:
            found = {m["id"]: m for m in catalog.targets()}
        except Exception as e:  # a corrupt settings file or model folder: the server's problem, not the client's
            why = error_line(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {error_line(e)}"
            raise APIError(503, f"cannot list models: {why}", code="model_catalog_unavailable") from None
        return found

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        first = model if model is not None else preload
        if first is not None:  # load now (and measure what loading measures) so the first request does not wait
            loop = asyncio.get_running_loop()
            worker.submit(Job("warm", first, None, loop))
        yield
        worker.stop()

    app = FastAPI(title="mlx-dflash", version=mlx_dflash.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.request_log = request_log
    app.add_middleware(RequestGate, policy=AccessRules(tuple(allowed_hosts), tuple(cors), max_body), log=request_log,
                       render=_render_error)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):  # routing's own answers (404, 405 with its Allow header), as JSON
        r = APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()
        r.headers.update(e.headers or {})
        return r

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return bad_request(f"invalid request: {e.errors()[0].get('msg', '')}").response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e):  # the client left while sending its body: nothing to answer, no error
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request, e):
        traceback.print_exception(e, file=sys.stderr)
        return APIError(500, f"internal error: {type(e).__name__}").response()

    auth = make_auth(api_key)

    async def parse(request: Request, cls):
        raw = await request.body()  # RequestGate stops reading past max_body
        if len(raw) > max_body:
            raise APIError(413, f"the request body is over {max_body >> 20} MiB")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # includes UnicodeDecodeError
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        try:  # JSON may escape lone surrogates, which no tokenizer accepts (the copy only when it may)
            if ESCAPED_SURROGATE.search(raw):
                json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request contains invalid Unicode (an unpaired surrogate)") from None
        except (ValueError, RecursionError):
            raise bad_request("the request body is not valid JSON") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        except (ValueError, RecursionError) as e:
            raise bad_request(error_line(e) or "invalid request") from None

    async def default_id() -> str:
        if model is not None:
            return model
        try:
            return await run_in_threadpool(catalog.default)
        except ValueError as e:
            raise APIError(404, f"no default model: {error_line(e)}", "model", "model_not_found") from None
        except Exception as e:  # a corrupt model folder (see refresh)
            raise APIError(503, f"no default model: {type(e).__name__}: {error_line(e)}", "model",
                           "model_catalog_unavailable") from None

    def lookup(name: str) -> Optional[str]:
        """The served id for `name` (catalog.find: the resolution every command uses),
        remembered for NAMES_TTL seconds; None: no model here has that name."""
        hit = names.get(name)
        if hit is not None and time.monotonic() - hit[1] < NAMES_TTL:
            return hit[0]
        try:
            found = catalog.find(name, model)
        except ValueError as e:  # a drafter, an ambiguous name: the client's mistake, in one line
            raise APIError(404, error_line(e), "model", "model_not_found") from None
        except Exception as e:  # a corrupt model folder (see refresh)
            raise APIError(503, f"cannot list models: {type(e).__name__}: {error_line(e)}", "model",
                           "model_catalog_unavailable") from None
        if len(names) > 1024:  # clients may send any name: keep the memo small
            names.clear()
        names[name] = (found, time.monotonic())
        return found

    async def model_id(name: Optional[str]) -> str:
        if name is None or name == model:
            return await default_id() if name is None else name
        found = await run_in_threadpool(lookup, name)
        if found is not None:
            return found
        if strict_models:
            raise APIError(404, f"model '{name}' does not exist; GET /v1/models lists the models", "model",
                           "model_not_found")
        served = await default_id()
        request_log.once(f"model:{name}", f"model '{name[:100]}' is not served here; answering with '{served}' "
                                          "(serve --strict-models refuses such requests)")
        return served

    async def next_event(job: Job, request: Request, poll: bool = True):
        """The worker's next event; a client that left (checked a few times a
        second while tokens flow, and while waiting) cancels the job."""
        while True:
            now = time.monotonic()
            state = request.scope.setdefault("state", {})  # what the request's log line tells
            if poll and now - job.checked > 0.2:
                job.checked = now
                if await request.is_disconnected():
                    job.cancel.set()
                    return None
            try:
                ev = await asyncio.wait_for(job.events.get(), 0.2)
            except asyncio.TimeoutError:
                continue
            if ev[0] == "start":  # from here a request that gets no "end" was cut short: its tokens are counted
                state[SENT_KEY] = 0
            elif ev[0] == "token" and ev[2] is not None:
                state[SENT_KEY] = state.get(SENT_KEY, 0) + 1
            elif ev[0] == "end":
                state[STATS_KEY] = ev[1]["stats"]
            elif ev[0] == "error":  # why, in its log line
                why = getattr(ev[1], "message", str(ev[1]))
                state[CUT_KEY] = why if getattr(ev[1], "code", None) == "server_shutting_down" else f"error: {why}"
            return ev

    ctx = ServerContext(worker, auth, parse, model_id, next_event)
    app.state.ctx = ctx
    register_openai(app, ctx)
    register_responses(app, ctx)  # /v1/responses
    register_messages(app, ctx)  # /v1/messages, /v1/messages/count_tokens

    @app.get("/health")
    async def health():  # no key needed, so it tells nothing but that the server is up
        return {"status": "ok"}

    # clients probe the base URL before their first request (Claude Code sends HEAD /)
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        ms = dict(await run_in_threadpool(refresh))
        if model is not None and model not in ms:  # `serve --model FOLDER` outside the model folders
            ms = {model: {"id": model, "owned_by": "local"}, **ms}
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0,
                                            "owned_by": m.get("owned_by", "mlx-dflash"),
                                            "drafters": m.get("drafters", [])} for m in ms.values()]}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics():
        return {"models": worker.snapshot(), "loaded": worker.lm.id if worker.lm is not None else None,
                "queued": worker.jobs.qsize(), "queue_size": worker.jobs.maxsize, "batch": worker.batch_summary(),
                "memory": worker.memory.summary() if worker.memory is not None else None}

    for route in app.routes:  # HEAD wherever GET (clients probe URLs with it): the GET's answer without a body
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")
    return app
