"""The worker: the thread that loads models and admits requests, and the
threads that serve them. Each loaded model has one engine (engines.py: the
catalog makes it; LocalEngine, or a split target's SplitEngine) that owns its
decoding and its prompt store; the worker turns a request into prompt ids and
a decode config, reads the engine's responses and shapes them into the API's
events: tool calls split from the text here (tools.ToolStream), so every API
gets the same ("token" | "call" | "end") events. Jobs, counters and the model
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
from .processors import fallback_reason, logits_processors, logprob_entry
from .prompt_ids import max_new_tokens, prompt_ids, text_chars, too_long, user_cap
from .reasoning import ThinkStream, opens_thinking
from .tool_grammar import call_grammar
from .tools import ToolStream, template_tools

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
        lm = engine.lm
        tok, req = lm.tokenizer, job.req
        t_start = time.perf_counter()
        settings = self._settings(lm)
        if job.prepared is None and text_chars(req) > OFF_WORKER_CHARS:
            self.long_prompts.put((job, lm, settings))  # measured and tokenized there, then queued again
            return
        ids, prefix = job.prepared or prompt_ids(job, lm, settings)
        if job.kind == "count":
            job.send("count", len(ids))
            return
        ctx = context_limit(lm.model)
        if ctx is not None and len(ids) >= ctx:
            raise too_long(len(ids), ctx, job)
        max_tokens = max_new_tokens(req.limit(), len(ids), ctx, user_cap(self.catalog, lm.id),
                                    settings.max_tokens)
        self._reserve(job, lm, len(ids), max_tokens, settings)
        fallback = fallback_reason(req)
        n_lp = req.n_logprobs()

        def progress(done: int, total: int) -> None:  # after each prefill chunk (the engine's thread)
            if total > cfg.prefill_step_size and not job.cancel.is_set():  # a long prompt: streams show it
                job.send("progress", done, total)

        n_vocab = Target(lm.model).vocab_size
        procs = logits_processors(req, tok, n_vocab, len(ids), max_tokens)
        if job.kind == "chat" and req.uses_tools() and getattr(settings, "tool_grammar", True) and engine.processors:
            calls = call_grammar(req, tok, n_vocab, ids)
            if calls is not None:
                procs.append(calls)
        cfg = DecodeConfig.from_settings(settings, lm.drafter, temperature=req.temperature, top_p=req.top_p,
                                         top_k=req.top_k, min_p=req.min_p, max_tokens=max_tokens, seed=req.seed,
                                         stop=req.stops() or None, logits_processors=procs,
                                         logprobs=n_lp is not None, plain_reason=fallback, prefill_progress=progress)
        job.send("start", {"prompt_tokens": len(ids)})
        gen = engine.stream(ids, cfg, job.cancel.is_set)
        tools = ToolStream(tok, template_tools(req), prefix) if job.kind == "chat" and req.uses_tools() else None
        think = ThinkStream(tok, opens_thinking(tok, ids, prefix)) if job.kind == "chat" and \
            getattr(tok, "has_thinking", False) and req.response_format is None else None  # (constrained: all answer)
        eos = set(tok.eos_token_ids)
        r, first, cancelled, cut = None, None, False, False
        raw, gen_ids = [], []
        try:
            for r in gen:
                if first is None:
                    first = time.perf_counter()
                if job.cancel.is_set():
                    cancelled = True
                    break
                is_eos = r.finish_reason == "stop" and r.token in eos
                raw.append(r.text)
                if not is_eos:
                    gen_ids.append(r.token)
                text, calls, reasoning = r.text, [], ""
                if think is not None:  # reasoning first: a call inside it is part of the thought
                    reasoning, text = think.feed(r.text)
                    if r.finish_reason:
                        done = think.finish()
                        reasoning, text = reasoning + done[0], text + done[1]
                if tools is not None:
                    evs = tools.feed(text) + (tools.finish() if r.finish_reason else [])
                    text = "".join(e[1] for e in evs if e[0] == "text")
                    calls = [e[1] for e in evs if e[0] == "call"]
                lp = logprob_entry(tok, r.token, r.logprobs, n_lp) if n_lp is not None and not is_eos else None
                if reasoning:
                    job.send("think", reasoning)
                job.send("token", text, None if is_eos else r.token, lp)
                for c in calls:
                    job.send("call", c)
                if calls and not req.parallel_tool_calls and not r.finish_reason:
                    cut = True  # one call asked for: the rest would be dropped, so stop here
                    break
        finally:
            gen.close()
        if r is not None and r.finish_reason is None and not cut and job.cancel.is_set():
            cancelled = True  # the engine saw the client leave first (its gone() check) and ended the stream
        if r is None:  # cancelled during the prefill
            with self.lock:
                self.counters(job.model_id).cancelled += 1
            if self.closing:
                job.send("error", _closing("the server is shutting down; the generation was stopped"))
            return
        s = r.stats
        with self.lock:
            c = self.counters(job.model_id)
            c.requests += 1
            c.cancelled += cancelled
            c.add(s)
        if cancelled:
            if self.closing:  # stopped by the shutdown, not by the client: say so
                job.send("error", _closing("the server is shutting down; the generation was stopped"))
            return
        finish = r.finish_reason
        if cut or (finish == "stop" and tools is not None and tools.calls):
            finish = "tool_calls"
        stop_seq = None
        if r.finish_reason == "stop" and r.token not in eos and cfg.stop:  # which stop string ended it
            full, n = tok.decode(gen_ids), len("".join(raw))  # the text was cut where the stop began
            hits = sorted((i, x) for x in cfg.stop if (i := full.find(x, max(0, n - len(x)))) >= 0)
            stop_seq = hits[0][1] if hits else None
        job.send("end", {"finish_reason": finish, "stats": s, "stop_sequence": stop_seq,
                         "reasoning_tokens": think.tokens if think is not None else 0,
                         "ttft_ms": (first - t_start) * 1000, "queue_ms": (t_start - job.received) * 1000})

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
