"""`mlx-dflash serve`: a local OpenAI-compatible server (FastAPI on uvicorn).

One worker thread owns the loaded model and its PromptCache (the engine runs
one generation at a time); HTTP handlers validate a request, put it on a
bounded queue (429 when full) and relay the worker's events, as SSE or as one
JSON body. Every response carries `usage`, llama.cpp-style `timings` and a
`dflash` object. No option is ignored: those the DFlash path cannot honour
(logprobs, penalties, logit_bias) run on plain decoding, which applies them,
and `dflash.mode` / `dflash.fallback` say so; anything else unknown is a 400.

    mlx-dflash serve [--model M] [--host H] [--port P] [--api-key K]
                     [--cors ORIGIN ...] [--queue-size N]

Endpoints: GET /health, GET /v1/models (targets), POST /v1/chat/completions,
POST /v1/completions (both streaming or not), GET /metrics (per-model counters).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

import mlx_dflash  # noqa: F401  (fast BLAS before anything imports mlx)
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_STOP = 16
MAX_BODY = 64 << 20  # bytes; far above any context this runs
MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-6


# -- errors -------------------------------------------------------------------------------

class APIError(Exception):
    """An error reported to the client in OpenAI's format."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


# -- requests -----------------------------------------------------------------------------
# strict: "0.5" is not a number and true is not 1; extra="forbid": an unknown
# field is an option we would otherwise silently ignore.

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None  # the caller's end-user id: metadata, nothing to apply
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    logit_bias: Optional[Dict[str, float]] = None

    @model_validator(mode="after")
    def _check(self):
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            # logits / t overflows float32 below this: sampling would return garbage
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        for k, v in (self.logit_bias or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got '{k}'")
            if not -100 <= v <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
        return self

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_lp(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def limit(self):
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = Field(False, strict=True)
    best_of: int = Field(1, ge=1, le=1)

    @model_validator(mode="after")
    def _check_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("one prompt per request (batches are not supported)")
            self.prompt = p[0]
        if isinstance(self.prompt, list) and any(t < 0 for t in self.prompt):
            raise ValueError("token ids must be >= 0")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def limit(self):
        return self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return self.logprobs


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_message(e: ValidationError) -> APIError:
    errs = e.errors()
    err = max(errs, key=lambda x: len(x.get("loc", ())))  # the most specific (unions report each branch)
    # drop pydantic's union-branch labels ("str", "list[TextPart]") from the path
    loc = ".".join(str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x in _TYPES)))
    if err.get("type") == "extra_forbidden":
        return _bad(f"unsupported field '{loc}'", loc, "unsupported_parameter")
    if err.get("type") == "missing":
        return _bad(f"missing required field '{loc}'", loc)
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return _bad(f"{loc}: {msg}" if loc else msg, loc or None)


# -- models ---------------------------------------------------------------------------------

class ManagerCatalog:
    """The models the model manager knows (mlx_dflash.manager); ids are its ids."""

    def __init__(self, store=None):
        from mlx_dflash.settings import SettingsStore

        self.store = store or SettingsStore()

    def targets(self) -> List[dict]:
        from mlx_dflash.manager import list_targets

        return [{"id": e.id, "owned_by": e.source, "drafters": list(e.compatible_drafters)}
                for e in list_targets(self.store)]

    def default(self) -> str:
        from mlx_dflash.manager import resolve

        return resolve(None, self.store).id

    def settings(self, model_id: str):
        return self.store.model(model_id)

    def load(self, model_id: str):
        from mlx_dflash.manager import load_model

        return load_model(model_id, self.store)


def _context_limit(model) -> Optional[int]:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


# -- jobs and the worker --------------------------------------------------------------------

@dataclass
class Job:
    kind: str  # "chat" | "completion"
    model_id: str
    req: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
    checked: float = 0.0  # when the handler last asked whether the client is still there

    def send(self, *ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    fallbacks: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    cycles: int = 0
    cycle_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_time: float = 0.0
    generation_time: float = 0.0

    def add(self, s) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.reused_prompt_tokens += s.reused_tokens
        self.completion_tokens += s.generation_tokens
        self.cycles += s.cycles
        self.cycle_tokens += s.cycle_tokens
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.prompt_time += s.prompt_time
        self.generation_time += s.generation_time
        self.fallbacks += s.fallback is not None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(tau=self.cycle_tokens / self.cycles if self.cycles else 0.0,
                 acceptance=self.accepted / self.drafted if self.drafted else 0.0,
                 tokens_per_second=self.completion_tokens / self.generation_time if self.generation_time else 0.0,
                 prompt_tokens_per_second=(self.prompt_tokens - self.reused_prompt_tokens) / self.prompt_time
                 if self.prompt_time else 0.0)
        return d


class Worker:
    """The one thread that loads models and generates."""

    def __init__(self, catalog, queue_size: int = 8):
        self.catalog = catalog
        self.jobs: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.lm = None  # the LoadedModel in use
        self.lm_key = None  # the id it was asked for (a folder path resolves to another id)
        self.cache = None  # its PromptCache
        self.metrics: Dict[str, Counters] = {}
        self.lock = threading.Lock()  # guards metrics
        self.thread = threading.Thread(target=self._loop, name="mlx-dflash-worker", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy ({self.jobs.maxsize} requests queued); retry later",
                           code="queue_full") from None

    def counters(self, model_id: str) -> Counters:
        return self.metrics.setdefault(model_id, Counters())

    def snapshot(self) -> dict:
        with self.lock:
            return {m: c.to_dict() for m, c in self.metrics.items()}

    def _loop(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.kind == "warm":
                try:
                    self._ensure(job.model_id)
                except Exception as e:  # the first request will report it to its client
                    sys.stderr.write(f"mlx-dflash: {getattr(e, 'message', e)}\n")
                continue
            if job.cancel.is_set():  # the client left while queued
                with self.lock:
                    self.counters(job.model_id).cancelled += 1
                continue
            try:
                self._serve(job)
            except APIError as e:
                self._fail(job, e)
            except ValueError as e:  # the engine's one-line complaint about a request
                self._fail(job, _bad(_line(e) or "invalid request"))
            except BaseException as e:  # a bug (or a native panic): report it, keep serving
                traceback.print_exc(file=sys.stderr)
                self.cache = None  # the KV cache may be half-written
                self._fail(job, APIError(500, f"internal error: {type(e).__name__}: {_line(e)}"))

    def _fail(self, job, e: APIError):
        with self.lock:
            self.counters(job.model_id).errors += 1
        job.send("error", e)

    def _ensure(self, model_id: str):
        if self.lm is not None and self.lm_key == model_id:
            return self.lm
        if self.lm is not None:  # one model in memory at a time: drop the old one first
            import mlx.core as mx

            self.lm = self.cache = self.lm_key = None
            gc.collect()
            mx.clear_cache()
        try:
            self.lm = self.catalog.load(model_id)
        except ValueError as e:  # HubError / SettingsError / DrafterError: one line
            raise APIError(503, f"model '{model_id}' cannot be loaded: {_line(e)}",
                           "model", "model_unavailable") from None
        self.cache, self.lm_key = None, model_id
        with self.lock:
            self.counters(model_id)  # listed in /metrics from now on
        return self.lm

    # -- one request ---------------------------------------------------------------------
    def _serve(self, job: Job):
        from mlx_dflash import PromptCache

        lm = self._ensure(job.model_id)
        tok, req = lm.tokenizer, job.req
        t_start = time.perf_counter()
        settings = self._settings(lm)
        ids = self._prompt_ids(job, lm, settings)
        ctx = _context_limit(lm.model)
        if ctx is not None and len(ids) >= ctx:
            raise _bad(f"the prompt has {len(ids)} tokens; this model's context is {ctx} tokens",
                       "messages" if job.kind == "chat" else "prompt", "context_length_exceeded")
        kw = settings.generation_kwargs()
        if lm.drafter is not None:  # as load_model fits it to the drafter
            kw["block_size"] = min(kw["block_size"], lm.drafter.block_size)
        for k in ("temperature", "top_p", "top_k", "min_p"):
            v = getattr(req, k)
            if v is not None:
                kw[k] = v
        if req.limit() is not None:
            kw["max_tokens"] = req.limit()
        if ctx is not None:  # generation ends at the end of the context (finish_reason "length")
            kw["max_tokens"] = max(1, min(kw["max_tokens"], ctx - len(ids)))
        kw.update(seed=req.seed, stop=req.stops() or None)

        fallback = self._fallback_reason(req)
        job.send("start", {"prompt_tokens": len(ids)})
        if fallback:
            gen = self._plain(lm, ids, kw, req, fallback, tok)
        else:
            from mlx_dflash import stream_generate

            if self.cache is None:
                self.cache = PromptCache()
            gen = stream_generate(lm.model, tok, ids, lm.drafter, prompt_cache=self.cache, **kw)
        eos = set(tok.eos_token_ids)
        n_lp = req.n_logprobs()
        r, first, cancelled = None, None, False
        try:
            for item in gen:
                r, lp = item if fallback else (item, None)
                if first is None:
                    first = time.perf_counter()
                if job.cancel.is_set():
                    cancelled = True
                    break
                is_eos = r.finish_reason == "stop" and r.token in eos
                job.send("token", r.text, None if is_eos else r.token, lp if n_lp is not None and not is_eos else None)
        except BaseException:
            if not fallback:
                self.cache = None
            raise
        finally:
            gen.close()
        s = r.stats
        with self.lock:
            c = self.counters(job.model_id)
            c.requests += 1
            c.cancelled += cancelled
            c.add(s)
        if cancelled:
            return
        job.send("end", {"finish_reason": r.finish_reason, "stats": s,
                         "ttft_ms": (first - t_start) * 1000, "queue_ms": (t_start - job.received) * 1000})

    def _settings(self, lm):
        """The model's settings, read per request so edits apply at once; those
        it was loaded with if the file cannot be read now."""
        try:
            return self.catalog.settings(lm.id)
        except ValueError as e:
            sys.stderr.write(f"mlx-dflash: {_line(e)}; using the settings {lm.id} was loaded with\n")
            return lm.settings

    def _prompt_ids(self, job: Job, lm, settings) -> List[int]:
        tok, req = lm.tokenizer, job.req
        vocab = _vocab_size(lm)
        if job.kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise _bad(f"model '{lm.id}' has no chat template; use /v1/completions", "messages")
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                     **({"name": m.name} if m.name is not None else {})} for m in req.messages]
            system = settings.system_prompt
            if system and not any(m["role"] == "system" for m in msgs):
                msgs.insert(0, {"role": "system", "content": system})
            try:
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja raise_exception(): e.g. roles that must alternate
                raise _bad(f"the chat template rejected these messages: {_line(e)}",
                           "messages") from None
            ids = _encode(tok, text)
        elif isinstance(req.prompt, str):
            ids = _encode(tok, req.prompt)
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if vocab is not None and t >= vocab]
            if bad:
                raise _bad(f"token id {bad[0]} is outside the vocabulary (size {vocab})", "prompt")
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        for k in (req.logit_bias or {}):
            if vocab is not None and int(k) >= vocab:
                raise _bad(f"logit_bias token id {k} is outside the vocabulary (size {vocab})", "logit_bias")
        return ids

    @staticmethod
    def _fallback_reason(req) -> Optional[str]:
        """Why this request needs plain decoding (options DFlash's verify step cannot apply)."""
        why = []
        if req.n_logprobs() is not None:
            why.append("logprobs")
        for k in ("frequency_penalty", "presence_penalty"):
            if getattr(req, k):
                why.append(k)
        if req.repetition_penalty not in (None, 1.0):
            why.append("repetition_penalty")
        if req.logit_bias:
            why.append("logit_bias")
        return f"{', '.join(why)} requested (plain decoding applies {'them' if len(why) > 1 else 'it'})" \
            if why else None

    def _plain(self, lm, ids, kw, req, reason, tok):
        """Plain decoding with logits processors and log-probabilities (mlx-lm's
        generate_step), sampled with the same rules as the DFlash path. Yields
        (GenerationResponse, logprobs entry)."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_logits_processors

        from mlx_dflash.generate import GenerationStats, Emitter
        from mlx_dflash.sampling import SamplingParams, probs, sample

        sp = SamplingParams(kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"], kw["seed"])
        if kw["seed"] is not None:
            mx.random.seed(kw["seed"])
        n_prompt, span = len(ids), len(ids) + kw["max_tokens"] + 1
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        procs = make_logits_processors(bias or None, req.repetition_penalty if req.repetition_penalty != 1.0 else None,
                                       span)
        # OpenAI's presence / frequency penalties count generated tokens only
        gen_only = make_logits_processors(None, None, None, req.presence_penalty or None, span,
                                          req.frequency_penalty or None, span)
        for p in gen_only:
            procs.append(lambda toks, logits, p=p: p(toks[n_prompt:], logits) if toks.size > n_prompt else logits)

        def sampler(logprobs):
            if sp.greedy:
                return mx.argmax(logprobs, axis=-1)
            return sample(probs(logprobs, sp))

        stats = GenerationStats(mode="off", fallback=reason, prompt_tokens=n_prompt, block_size=1)
        emit = Emitter(tok, kw["stop"], kw["max_tokens"], stats)
        n_top = req.n_logprobs() or 0
        tic = time.perf_counter()
        steps = generate_step(mx.array(ids), lm.model, max_tokens=kw["max_tokens"] + 1, sampler=sampler,
                              logits_processors=procs or None)
        try:
            for i, (token, logprobs) in enumerate(steps):
                token = int(token)
                now = time.perf_counter()
                if i == 0:
                    stats.prompt_time, gen_tic = now - tic, now
                else:
                    stats.cycles += 1
                    stats.cycle_tokens += 1
                    stats.generation_time = now - gen_tic
                lp = _logprob_entry(tok, token, logprobs, n_top) if req.n_logprobs() is not None else None
                resp = emit.push(token, False)
                yield resp, lp
                if emit.done:
                    return
        finally:
            steps.close()


def _vocab_size(lm) -> Optional[int]:
    n = getattr(getattr(lm.model, "args", None), "vocab_size", None)
    return int(n) if isinstance(n, int) else None


def _encode(tok, text: str) -> List[int]:
    # like the engine: the template may already carry the BOS token
    bos = tok.bos_token
    try:
        return tok.encode(text, add_special_tokens=bos is None or not text.startswith(bos))
    except (TypeError, ValueError) as e:
        raise _bad(f"the tokenizer cannot encode this text: {_line(e)}", "prompt") from None


def _logprob_entry(tok, token: int, logprobs, n_top: int) -> dict:
    import mlx.core as mx

    def piece(t):
        s = tok.decode([t])
        return {"token": s, "logprob": _finite(float(logprobs[t].item())), "bytes": list(s.encode("utf-8"))}

    e = piece(token)
    e["top_logprobs"] = []
    if n_top:
        top = mx.argsort(-logprobs)[:n_top].tolist()
        e["top_logprobs"] = [piece(t) for t in top]
    return e


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (OpenAI uses -9999.0 likewise)


# -- response bodies -----------------------------------------------------------------------

def _report(stats, end: dict) -> dict:
    """usage + llama.cpp `timings` + `dflash`, from the engine's GenerationStats."""
    s = stats
    prompt_n = s.prompt_tokens - s.reused_tokens
    return {
        "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generation_tokens,
                  "total_tokens": s.prompt_tokens + s.generation_tokens,
                  "prompt_tokens_details": {"cached_tokens": s.reused_tokens}},
        "timings": {"cache_n": s.reused_tokens, "prompt_n": prompt_n, "prompt_ms": s.prompt_time * 1000,
                    "prompt_per_token_ms": s.prompt_time * 1000 / prompt_n if prompt_n else 0.0,
                    "prompt_per_second": s.prompt_tps,
                    "predicted_n": s.generation_tokens, "predicted_ms": s.generation_time * 1000,
                    "predicted_per_token_ms": 1000 / s.generation_tps if s.generation_tps else 0.0,
                    "predicted_per_second": s.generation_tps,
                    "draft_n": s.drafted, "draft_n_accepted": s.accepted},
        "dflash": {"tau": s.tau, "cycles": s.cycles, "verify_width": s.block_size, "mode": s.mode,
                   "fallback": s.fallback, "acceptance_rate": s.acceptance_rate,
                   "reused_prompt_tokens": s.reused_tokens, "ttft_ms": end["ttft_ms"],
                   "queue_ms": end["queue_ms"]},
    }


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


# -- the app -------------------------------------------------------------------------------

def create_app(catalog=None, *, api_key: Optional[str] = None, cors: tuple = (), queue_size: int = 8,
               model: Optional[str] = None, store=None) -> FastAPI:
    """The FastAPI app. `catalog` (default: the model manager's) provides
    targets(), default(), settings(id) and load(id) -> LoadedModel. `model`,
    when given, is loaded at startup and is the default for requests that
    name none."""
    from contextlib import asynccontextmanager

    catalog = catalog or ManagerCatalog(store)
    worker = Worker(catalog, queue_size)
    known: Dict[str, dict] = {}

    def refresh() -> Dict[str, dict]:
        try:
            found = {m["id"]: m for m in catalog.targets()}
        except ValueError as e:  # e.g. a corrupt settings file: the server's problem, not the client's
            raise APIError(503, f"cannot list models: {_line(e)}", code="model_catalog_unavailable") from None
        known.clear()
        known.update(found)
        return known

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        if model is not None:  # load now so the first request does not wait for it
            loop = asyncio.get_running_loop()
            worker.submit(Job("warm", model, None, loop))
        yield
        worker.stop()

    app = FastAPI(title="mlx-dflash", version=mlx_dflash.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    if cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return _bad(f"invalid request: {e.errors()[0].get('msg', '')}").response()

    @app.exception_handler(Exception)
    async def _internal(request, e):
        traceback.print_exception(e, file=sys.stderr)
        return APIError(500, f"internal error: {type(e).__name__}").response()

    async def auth(request: Request):
        if api_key is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != api_key:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def parse(request: Request, cls):
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, f"the request body is over {MAX_BODY >> 20} MiB")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # includes UnicodeDecodeError
            raise _bad("the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise _bad("the request body must be a JSON object")
        try:  # JSON may escape lone surrogates, which no tokenizer accepts
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad("the request contains invalid Unicode (an unpaired surrogate)") from None
        except (ValueError, RecursionError):
            raise _bad("the request body is not valid JSON") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _validation_message(e) from None
        except (ValueError, RecursionError) as e:
            raise _bad(_line(e) or "invalid request") from None

    async def model_id(name: Optional[str]) -> str:
        from starlette.concurrency import run_in_threadpool

        if name is None:
            if model is not None:
                return model
            try:
                return await run_in_threadpool(catalog.default)
            except ValueError as e:
                raise APIError(404, f"no default model: {_line(e)}", "model", "model_not_found") from None
        if name in known or name == model or name in await run_in_threadpool(refresh):
            return name
        raise APIError(404, f"model '{name}' does not exist; GET /v1/models lists the models", "model",
                       "model_not_found")

    async def next_event(job: Job, request: Request, poll: bool = True):
        """The worker's next event; a client that left (checked a few times a
        second while tokens flow, and while waiting) cancels the job."""
        while True:
            now = time.monotonic()
            if poll and now - job.checked > 0.2:
                job.checked = now
                if await request.is_disconnected():
                    job.cancel.set()
                    return None
            try:
                return await asyncio.wait_for(job.events.get(), 0.2)
            except asyncio.TimeoutError:
                pass

    async def complete(request: Request, kind: str, req):
        mid = await model_id(req.model)
        job = Job(kind, mid, req, asyncio.get_running_loop())
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
        text, lps = [], []
        try:
            while True:
                ev = await next_event(job, request)
                if ev is None:
                    return JSONResponse({}, status_code=499)
                if ev[0] == "error":
                    return ev[1].response()
                if ev[0] == "token":
                    text.append(ev[1])
                    if ev[3] is not None:
                        lps.append(ev[3])
                    continue
                end = ev[1]
                break
        finally:
            job.cancel.set()  # no-op once done; stops the worker if this handler was cancelled
        lp = _lp_block(kind, lps) if req.n_logprobs() is not None else None
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                      "logprobs": lp, "finish_reason": end["finish_reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": lp, "finish_reason": end["finish_reason"]}
            obj = "text_completion"
        body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [choice],
                **_report(end["stats"], end)}
        return JSONResponse(body)

    async def sse(job, request, req, kind, rid, created, mid):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        want_lp = req.n_logprobs() is not None

        def chunk(delta_text=None, finish=None, lp=None, role=False, extra=None):
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if delta_text is None else {"content": delta_text})
                ch = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                ch = {"index": 0, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [ch]}
            if extra:
                body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

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
                if ev[0] == "token":
                    _, text, token, lp = ev
                    if token is None:  # EOS: not a token of the text, only flushes it
                        leftover += text
                        continue
                    yield chunk(text, lp=_lp_block(kind, [lp]) if want_lp and lp else None)
                    continue
                end = ev[1]
                rep = _report(end["stats"], end)
                yield chunk(leftover or None, end["finish_reason"],
                            extra={"timings": rep["timings"], "dflash": rep["dflash"]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": mid, "choices": [], **rep}
                    yield f"data: {json.dumps(body)}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client left (or we are done): stop generating

    @app.get("/health")
    async def health():
        lm = worker.lm
        return {"status": "ok", "model": lm.id if lm is not None else None,
                "queued": worker.jobs.qsize(), "queue_size": worker.jobs.maxsize}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        from starlette.concurrency import run_in_threadpool

        ms = await run_in_threadpool(refresh)
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0,
                                            "owned_by": m.get("owned_by", "mlx-dflash"),
                                            "drafters": m.get("drafters", [])} for m in ms.values()]}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics():
        return {"models": worker.snapshot(), "loaded": worker.lm.id if worker.lm is not None else None}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(request: Request):
        return await complete(request, "chat", await parse(request, ChatRequest))

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(request: Request):
        return await complete(request, "completion", await parse(request, CompletionRequest))

    return app


# -- CLI ------------------------------------------------------------------------------------

def add_parser(sub):
    p = sub.add_parser("serve", help="run a local OpenAI-compatible server")
    p.add_argument("--model", default=None,
                   help="model id (or folder) to load at start and use by default (see `mlx-dflash models list`)")
    p.add_argument("--host", default=None, help="address to listen on (default from settings: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default from settings: 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default from settings: none)")
    p.add_argument("--cors", nargs="+", default=None, metavar="ORIGIN",
                   help="allow browser requests from these origins (default from settings: none)")
    p.add_argument("--queue-size", type=int, default=8, help="requests that may wait for the worker (default 8)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    import socket

    import uvicorn

    from mlx_dflash.settings import SettingsStore

    store = SettingsStore()
    g = store.globals()
    host = args.host or g.host
    port = args.port if args.port is not None else g.port
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if args.queue_size < 1:
        raise ValueError(f"--queue-size must be >= 1, got {args.queue_size}")
    key = args.api_key if args.api_key is not None else g.api_key
    cors = tuple(args.cors if args.cors is not None else g.cors_origins)
    catalog = ManagerCatalog(store)
    model = None
    if args.model is not None:  # an id or a model folder; fail now, in one line, if neither
        from mlx_dflash.manager import resolve

        entry = resolve(args.model, store)
        if entry.kind != "target":
            raise ValueError(f"'{entry.id}' is a {entry.kind_label}, not a model to serve; "
                            "pick a target from `mlx-dflash models list`")
        model = entry.id
    else:
        from mlx_dflash.manager import resolve

        try:
            resolve(None, store)
        except ValueError as e:  # still useful: requests can name any listed model
            sys.stderr.write(f"mlx-dflash: no default model ({_line(e)}); "
                             "requests must name a model\n")
    try:  # a clear message instead of uvicorn's log line when the port is taken
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    app = create_app(catalog, api_key=key, cors=cors, queue_size=args.queue_size, model=model)
    sys.stderr.write(f"mlx-dflash: serving on http://{host}:{port}/v1"
                     f"{' (API key required)' if key else ''}; Ctrl-C stops\n")
    uvicorn.run(app, host=host, port=port, log_level=args.log_level)
    return 0
