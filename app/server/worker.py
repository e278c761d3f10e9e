"""The worker: the thread that loads models and admits requests, and the
threads that serve them. Each loaded model has one engine (engines.py: the
catalog makes it; LocalEngine, or a split target's SplitEngine) that owns its
decoding and its prompt store; the worker turns a request into prompt ids and
a decode config, and hands the engine's responses to the request's Reply
(reply.py), which shapes them into the events every API gets ("think" |
"token" | "call"); the "end" event is sent here. Jobs, counters and the model
catalog are in catalog.py."""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
import traceback
from typing import Dict, Optional

import mlx.core as mx

from mlx_dflash import DecodeConfig
from mlx_dflash.cache.memory import MemoryBudget, Refused, footprint, warn_if_over
from mlx_dflash.engine.batch_costs import auto_max_batch, prefill_together_pays
from mlx_dflash.engine.calibrate import DEFAULT as CALIBRATION
from mlx_dflash.target.adapter import Target

from .catalog import Counters, Job, context_limit
from .errors import APIError, bad_request, error_line
from .processors import fallback_reason, logits_processors
from .prompt_ids import max_new_tokens, prompt_ids, text_chars, too_long, user_cap
from .reply import Reply
from .tool_grammar import call_grammar

OFF_WORKER_CHARS = 256 << 10  # a request with more text than this is tokenized on its own thread
# ModelSettings fields that manager.load_model applies (the others apply per request), and verify_mode off or not
LOAD_SETTINGS = ("dflash_enabled", "drafter", "drafter_quant_bits", "drafter_quant_group_size",
                 "drafter_activation_dtype", "dtype")


class Worker:
    """Loads models and admits requests (one thread); serves each on a thread of its own."""

    def __init__(self, catalog, queue_size: int = 8, max_batch=1):
        self.catalog = catalog
        # max_batch: requests decoding together; "auto": the size measured for each model
        # loaded (batch_costs.auto_max_batch: 1 where batching does not pay)
        self.auto = max_batch == "auto"
        self.max_batch = 1 if self.auto else max(1, max_batch)
        self.picked: Optional[tuple] = None  # auto: (batch size, why) for the model loaded now
        self.prefill: Optional[tuple] = None  # (new prompts prefilled together?, why) for the model loaded now
        self.engine = None  # the loaded model's engine (engines.py)
        self.memory: Optional[MemoryBudget] = None  # the memory budget of the model loaded (None: no budget)
        self.inflight: Dict[int, Job] = {}  # id -> job, for the jobs being served
        self.slots = threading.Condition()
        self.jobs: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.lm = None  # the LoadedModel in use
        self.lm_key = None  # the id it was asked for (a folder path resolves to another id)
        self.lm_load = None  # the settings it was loaded with that only a load applies (_load_key)
        self.refused = None  # the last refusal of changed settings (logged once)
        self.metrics: Dict[str, Counters] = {}
        self.lock = threading.Lock()  # guards metrics
        self.closing = False  # shutting down: no new jobs, queued ones answered 503
        self.parked = threading.Event()  # set once the thread took the stop sentinel
        self.thread = threading.Thread(target=self._loop, name="mlx-dflash-worker", daemon=True)
        self.long_prompts: queue.Queue = queue.Queue()  # (job, lm, settings) to tokenize off the worker
        threading.Thread(target=self._tokenize_loop, name="mlx-dflash-tokenize", daemon=True).start()

    def start(self):
        self.thread.start()

    def stop(self):
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass
        if self.engine is not None:  # (a cost measurement under way gives way: its memory and cores)
            self.engine.stop_measuring()

    def close(self, grace: float) -> None:
        """First step of a shutdown: refuse new jobs, answer the queued ones 503,
        let the running ones go on for `grace` seconds, then cancel them."""
        self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.kind != "warm":
                self._fail(job, _closing())
        self.stop()
        t = threading.Timer(grace, self.halt)
        t.daemon = True
        t.start()

    def halt(self) -> None:
        """Cancel the running jobs now (shutdown: after the grace period, or a second Ctrl-C)."""
        self.closing = True
        with self.slots:
            for j in self.inflight.values():
                j.cancel.set()

    def submit(self, job: Job) -> None:
        if self.closing:
            raise _closing()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy ({self.jobs.maxsize} requests queued); retry later",
                           code="queue_full") from None

    @property
    def store(self):
        """The loaded model's prompt store (None: none)."""
        return self.engine.store if self.engine is not None else None

    def counters(self, model_id: str) -> Counters:
        return self.metrics.setdefault(model_id, Counters())

    def snapshot(self) -> dict:
        with self.lock:
            out = {m: c.to_dict() for m, c in self.metrics.items()}
        eng, key = self.engine, self.lm_key
        cached = eng.store_summary() if eng is not None else None
        if cached is not None and key in out:
            out[key]["prompt_cache"] = cached
        return out

    # -- admission ----------------------------------------------------------------------------
    def _loop(self):
        while True:
            job = None  # the last job (and its prompt, maybe megabytes) is not kept while waiting
            with self.slots:  # (the jobs behind stay in the queue: counted in /metrics, 429 once it is full)
                self._wait_for_row(self.engine)
            job = self.jobs.get()
            if job is None:
                # Park, never return: when this thread exits, MLX's thread-local
                # compile cache is freed and needs the GIL; at interpreter exit
                # that aborts the process ("terminate called", rc -6).
                self.parked.set()
                threading.Event().wait()
            if self.closing:
                if job.kind != "warm":
                    self._fail(job, _closing())
                continue
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
            self._admit(job)

    def _wait_for_row(self, engine) -> None:
        """Wait, holding self.slots, while every row of `engine` (None: none loaded) is served."""
        while engine is not None and len(self.inflight) >= engine.max_batch:
            self.slots.wait()

    def _admit(self, job):
        """Serve `job` on a thread of its own, its tokens from the model's engine,
        once fewer than the engine's rows are served: the worker waits for a free
        row, so later jobs wait in the queue (429 only past it). A model (or load
        setting) change waits for the running requests to end first."""
        try:
            engine = self._ensure(job.model_id)
        except APIError as e:
            self._fail(job, e)
            return
        with self.slots:
            self._wait_for_row(engine)
            self.inflight[id(job)] = job
        threading.Thread(target=self._run, args=(job, engine), daemon=True).start()

    def _run(self, job, engine):
        try:
            self._serve(job, engine)
        except Refused as e:  # the memory budget: 413 (can never fit) or 429 (not now)
            self._fail(job, APIError(e.status, e.message, code="memory_budget"))
        except APIError as e:
            self._fail(job, e)
        except ValueError as e:  # the engine's one-line complaint about a request
            self._fail(job, bad_request(error_line(e) or "invalid request"))
        except BaseException as e:  # a bug (or a native panic): report it, keep serving
            traceback.print_exc(file=sys.stderr)
            self._fail(job, APIError(500, f"internal error: {type(e).__name__}: {error_line(e)}"))
        finally:
            if self.memory is not None:
                self.memory.release(id(job))
            with self.slots:
                self.inflight.pop(id(job), None)
                self.slots.notify_all()

    def _new_budget(self, lm) -> Optional[MemoryBudget]:
        """The memory budget for `lm` (just loaded: its footprint is measured here, by the thread that owns it)."""
        limit = self.catalog.memory_limit()
        if limit is None:
            return None
        try:
            fp = footprint(lm.model, lm.drafter)
        except Exception as e:  # noqa: BLE001 - a model the probe fails on is served without a budget
            sys.stderr.write(f"mlx-dflash: no memory budget for '{lm.id}' (its footprint could not be measured: "
                             f"{type(e).__name__}: {error_line(e)})\n")
            return None
        b = MemoryBudget(limit, fp, store=lambda: self.store)
        warn_if_over(b)
        return b

    def _reserve(self, job, lm, prompt: int, max_tokens: int, settings) -> None:
        """Admission by the request's projected memory (may wait; Refused if it cannot fit)."""
        if self.memory is None:
            return
        window = getattr(settings, "drafter_window", None) if lm.drafter is not None else 0
        need = self.memory.project(prompt, max_tokens, window=window, sink=getattr(settings, "drafter_sink", 0))
        self.memory.admit(id(job), need, f" ({prompt} prompt tokens + max_tokens {max_tokens})")

    def quiesce(self, timeout: float) -> bool:
        """Last step of a shutdown, once the server answers no more: cancel what
        still runs, and wait until no thread is inside MLX (this one and the
        engine's parked, the prompt store's writes done), within `timeout`
        seconds. Python's exit with a thread inside MLX aborts the process (rc -6):
        False tells the caller to exit without it."""
        end = time.monotonic() + timeout
        self.halt()
        self.stop()
        if not self.parked.wait(timeout):  # (still inside MLX: a model load)
            return False
        return self.engine is None or self.engine.quiesce(max(0.0, end - time.monotonic()))

    def _drain(self):
        with self.slots:
            while self.inflight:
                self.slots.wait()

    def _batch_size(self, lm) -> int:
        """Rows decoding together for `lm`: max_batch, or with auto the size
        measured for it (once per load; the measured curves are cached on disk)."""
        if not self.auto:
            return self.max_batch
        if self.picked is None:
            try:
                size, why = auto_max_batch(lm.model, lm.drafter, CALIBRATION.book)
            except Exception as e:  # noqa: BLE001 - a model the measurement fails on still serves, alone
                size, why = 1, f"measuring failed ({type(e).__name__}: {error_line(e)})"
            self.picked = (size, why)
            sys.stderr.write(f"mlx-dflash: max_batch auto for '{lm.id}': {size} ({why})\n")
        return self.picked[0]

    def _prefill_together(self, lm, size: int) -> bool:
        """Whether requests that arrive together are prefilled in one batched
        forward: measured once per load (batch_costs.prefill_together_pays;
        a few short prefills, then cached on disk), so a GPU gets it and a CPU
        that gains nothing does not."""
        if size < 2:
            return False
        if self.prefill is None:
            try:
                self.prefill = prefill_together_pays(lm.model, lm.drafter, size, CALIBRATION.book)
            except Exception as e:  # noqa: BLE001 - the probe failing only keeps prefills one at a time
                self.prefill = (False, f"measuring failed ({type(e).__name__}: {error_line(e)})")
            sys.stderr.write(f"mlx-dflash: prefill of new requests for '{lm.id}': {self.prefill[1]}\n")
        return self.prefill[0]

    def batch_summary(self) -> Optional[dict]:
        """The engine's occupancy for /metrics (None: requests run one at a time)."""
        eng = self.engine
        if not self.auto and self.max_batch <= 1:
            return None
        size = self.picked[0] if self.auto and self.picked is not None else self.max_batch
        out = eng.summary() if eng is not None else {"max_batch": size, "rows": 0}
        if self.auto:
            out["auto"] = f"{self.picked[0]} ({self.picked[1]})" if self.picked is not None else "not measured yet"
        if self.prefill is not None:
            out["prefill"] = self.prefill[1]
        with self.slots:
            out["serving"] = len(self.inflight)
        return out

    def _tokenize_loop(self):
        """Long prompts are measured and tokenized here, so the jobs queued behind
        one are served meanwhile; a prompt that cannot fit is refused as soon as
        that is certain (prompt_ids.encode). The job then goes back to the worker's queue."""
        while True:
            job = lm = settings = None  # the last prompt is not kept while waiting
            job, lm, settings = self.long_prompts.get()
            if job.cancel.is_set():
                continue
            try:
                job.prepared = prompt_ids(job, lm, settings)
            except APIError as e:
                self._fail(job, e)
                continue
            except ValueError as e:
                self._fail(job, bad_request(error_line(e) or "invalid request"))
                continue
            except Exception as e:  # a bug: report it, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail(job, APIError(500, f"internal error: {type(e).__name__}: {error_line(e)}"))
                continue
            while not job.cancel.is_set():
                if self.closing:
                    self._fail(job, _closing())
                    break
                try:
                    self.jobs.put(job, timeout=0.5)
                    break
                except queue.Full:
                    pass

    def _fail(self, job, e: APIError):
        with self.lock:
            self.counters(job.model_id).errors += 1
        job.send("error", e)

    def _ensure(self, model_id: str):
        """The engine of `model_id`, loaded now if another model (or none) is, or
        if a setting that only a load applies (drafter, DFlash on/off, precision)
        changed since: the running requests end first. Changed settings that fail
        their check are refused, with the line `generate` prints, and the model
        loaded before stays in use."""
        if self.lm is not None and self.lm_key == model_id:
            want = self._load_key(self.lm.id)
            if want is None or want == self.lm_load:
                return self.engine
            try:  # checked again per request: a missing drafter may be downloaded meanwhile
                self.catalog.check(self.lm.id, self.catalog.settings(self.lm.id))
            except ValueError as e:
                err = APIError(503, f"the settings of '{self.lm.id}' cannot be used: {error_line(e)}; fix them "
                                    "(mlx-dflash settings); the model stays loaded as it was", "model",
                               "settings_invalid")
                if self.refused != err.message:
                    self.refused = err.message
                    sys.stderr.write(f"mlx-dflash: {err.message}\n")
                raise err from None
            sys.stderr.write(f"mlx-dflash: the settings of '{self.lm.id}' changed; loading it again\n")
        if self.lm is not None:  # one model in memory at a time: drop the old one first
            self._drain()
            self.engine.close()
            self.engine = self.lm = self.lm_key = self.lm_load = self.memory = None
            gc.collect()
            mx.clear_cache()
        try:
            lm = self.catalog.load(model_id)
        except Exception as e:  # HubError / SettingsError / DrafterError, or corrupt files (any error)
            why = error_line(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {error_line(e)}"
            raise APIError(503, f"model '{model_id}' cannot be loaded: {why}",
                           "model", "model_unavailable") from None
        self.picked = self.prefill = None  # measured again for this model
        self.memory = self._new_budget(lm)
        size = self._batch_size(lm)
        self.engine = self.catalog.engine(lm, size, self._prefill_together(lm, size))
        self.lm, self.lm_key, self.refused = lm, model_id, None
        self.lm_load = self._load_key(lm.id)
        with self.lock:
            self.counters(model_id)  # listed in /metrics from now on
        return self.engine

    def _load_key(self, model_id: str):
        """The settings of `model_id` that only loading the model applies; None if unreadable."""
        try:
            s = self.catalog.settings(model_id)
        except ValueError:
            return None
        return tuple(getattr(s, k, None) for k in LOAD_SETTINGS) + (getattr(s, "verify_mode", None) == "off",)

    # -- one request ---------------------------------------------------------------------
    def _serve(self, job: Job, engine):
        """Prompt ids (a long prompt's on the tokenizer thread), room, config;
        then the engine's stream through the request's Reply, and how it ended."""
        lm = engine.lm
        t_start = time.perf_counter()
        settings = self._settings(lm)
        if job.prepared is None and text_chars(job.req) > OFF_WORKER_CHARS:
            self.long_prompts.put((job, lm, settings))  # measured and tokenized there, then queued again
            return
        ids, prefix = job.prepared or prompt_ids(job, lm, settings)
        if job.kind == "count":
            job.send("count", len(ids))
            return
        max_tokens = self._room(job, lm, ids, settings)
        cfg = self._config(job, engine, settings, ids, max_tokens)
        job.send("start", {"prompt_tokens": len(ids)})
        reply = Reply(job, lm.tokenizer, ids, prefix, cfg.stop)
        gen = engine.stream(ids, cfg, job.cancel.is_set)
        r, first, cancelled = None, None, False
        try:
            for r in gen:
                if first is None:
                    first = time.perf_counter()
                if job.cancel.is_set():
                    cancelled = True
                    break
                if not reply.feed(r):
                    break
        finally:
            gen.close()
        if r is not None and r.finish_reason is None and not reply.cut and job.cancel.is_set():
            cancelled = True  # the engine saw the client leave first (its gone() check) and ended the stream
        self._count(job, r, cancelled)
        if r is None or cancelled:  # (r None: cancelled during the prefill)
            if self.closing:  # stopped by the shutdown, not by the client: say so
                job.send("error", _closing("the server is shutting down; the generation was stopped"))
            return
        finish, stop_seq = reply.ending(r)
        job.send("end", {"finish_reason": finish, "stats": r.stats, "stop_sequence": stop_seq,
                         "reasoning_tokens": reply.reasoning_tokens,
                         "ttft_ms": (first - t_start) * 1000, "queue_ms": (t_start - job.received) * 1000})

    def _room(self, job: Job, lm, ids, settings) -> int:
        """The request's max_tokens within the model's context (too_long past
        it), once its projected memory is admitted (may wait; Refused if it cannot fit)."""
        ctx = context_limit(lm.model)
        if ctx is not None and len(ids) >= ctx:
            raise too_long(len(ids), ctx, job)
        max_tokens = max_new_tokens(job.req.limit(), len(ids), ctx, user_cap(self.catalog, lm.id),
                                    settings.max_tokens)
        self._reserve(job, lm, len(ids), max_tokens, settings)
        return max_tokens

    def _config(self, job: Job, engine, settings, ids, max_tokens: int) -> DecodeConfig:
        """The request's decode config: the model's settings, its sampling, stops
        and processors (a tool call's grammar among them), and the prefill's
        progress streamed for a long prompt."""
        req, lm = job.req, engine.lm
        tok, n_vocab = lm.tokenizer, Target(lm.model).vocab_size
        procs = logits_processors(req, tok, n_vocab, len(ids), max_tokens)
        if job.kind == "chat" and req.uses_tools() and getattr(settings, "tool_grammar", True) and engine.processors:
            calls = call_grammar(req, tok, n_vocab, ids)
            if calls is not None:
                procs.append(calls)

        def progress(done: int, total: int) -> None:  # after each prefill chunk (the engine's thread)
            if total > cfg.prefill_step_size and not job.cancel.is_set():  # a long prompt: streams show it
                job.send("progress", done, total)

        cfg = DecodeConfig.from_settings(settings, lm.drafter, temperature=req.temperature, top_p=req.top_p,
                                         top_k=req.top_k, min_p=req.min_p, max_tokens=max_tokens, seed=req.seed,
                                         stop=req.stops() or None, logits_processors=procs,
                                         logprobs=req.n_logprobs() is not None, plain_reason=fallback_reason(req),
                                         prefill_progress=progress)
        return cfg

    def _count(self, job: Job, r, cancelled: bool) -> None:
        """The request in the model's counters (r None: cancelled during the prefill)."""
        with self.lock:
            c = self.counters(job.model_id)
            if r is None:
                c.cancelled += 1
                return
            c.requests += 1
            c.cancelled += cancelled
            c.add(r.stats)

    def _settings(self, lm):
        """The model's settings, read per request so edits apply at once; those
        it was loaded with if the file cannot be read now."""
        try:
            return self.catalog.settings(lm.id)
        except ValueError as e:
            sys.stderr.write(f"mlx-dflash: {error_line(e)}; using the settings {lm.id} was loaded with\n")
            return lm.settings

def _closing(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, code="server_shutting_down")
