"""The server's engines: one interface (`stream(ids, config)` -> the request's
GenerationResponses) with its implementations, each owning what it needs
around the decode engine. The worker (worker.py) only shapes responses.

- `LocalEngine`: the model in this process. One thread alone drives
  mlx_dflash's Engine (a set of one request or many, up to `max_batch`: a
  lone request decodes in its own caches, exactly as `generate` does), and
  hands each request's responses to the thread serving it. Its prompt store
  (mlx_dflash.cache.prompt_store): a request takes its longest cached prefix
  and its caches go back when it leaves, whether it ran alone or beside
  others; on a recurrent target, a conversation that branches from a cached
  one is first prefilled to the branch and a copy stored there (such a cache
  cannot be cut back), so the next conversation from there starts from it.
- `SplitEngine`: a target split over mlx.launch ranks (split.py): every rank
  runs the request; no prompt store (it would differ between ranks) and no
  logits processors (functions stay on rank 0)."""

from __future__ import annotations

import atexit
import copy
import dataclasses
import queue
import sys
import threading
import time
import traceback
from typing import Callable, Dict, Iterator, List, Optional

from mlx_dflash.cache.prompt_store import PromptStore
from mlx_dflash.engine.batch import BatchEngine, BatchError
from mlx_dflash.engine.calibrate import DEFAULT as CALIBRATION
from mlx_dflash.engine.engine import Engine
from mlx_dflash.engine.measuring import Interrupted
from mlx_dflash.engine.stats import GenerationResponse
from mlx_dflash.policy.costs import curve_name

MIN_BRANCH = 32  # shortest shared prefix worth a checkpoint of its own (recurrent targets)
IDLE_S = 1.0  # idle this long before measuring (requests sent back to back, as agents send them, come first)
_END = object()
# A curve measured while idle runs on an engine thread (a daemon): the process
# must not exit in the middle of one (MLX aborts when a thread is killed inside a
# computation), so exiting waits for the one under way and starts no other.
_MEASURING = threading.Lock()
_EXITING = threading.Event()


@atexit.register
def _let_measurement_end(timeout: float = 120.0) -> None:
    _EXITING.set()
    if _MEASURING.acquire(timeout=timeout):
        _MEASURING.release()


class LocalEngine:
    """See the module docstring. `store`: the model's prompt store (None: none)."""

    processors = True  # runs logits processors (inside the verify)

    def __init__(self, lm, max_batch: int = 1, store: Optional[PromptStore] = None, prefill_together: bool = False):
        self.lm, self.max_batch, self.prefill_together = lm, max_batch, prefill_together
        self.why_not = None  # why this model decodes one request at a time, when it must
        try:
            self.engine: Engine = self._make()
        except BatchError as e:
            self.why_not = str(e)
            sys.stderr.write(f"mlx-dflash: {e}; requests run one at a time\n")
            self.max_batch = 1
            self.engine = self._make()
        if self.engine.costs is not None:  # measured while idle, never inside a request (cost_source.py)
            self.engine.costs.prepare(self.max_batch)
        self.measuring = [0, 0, 0.0]  # curves got while idle: [read from the cache, measured, seconds]
        self.costs_ready = threading.Event()  # set whenever no curve is wanted (and said in the log)
        self.last_busy = time.monotonic()
        self.piece = threading.Lock()  # held while a curve is measured
        self.quiet = False  # no more measuring (the server is stopping)
        if not self._costs_wanted():
            self.costs_ready.set()
        self.store = store
        self.cv = threading.Condition()
        self.inbox: List[tuple] = []  # (ids, config, reply queue)
        self.cancels: List[int] = []
        self.outs: Dict[int, queue.Queue] = {}
        self.gone: Dict[int, Callable[[], bool]] = {}  # uid -> whether its client left
        self.last: List[tuple] = []  # (queue, final response): delivered once its cache is stored
        self.reused: Dict[int, tuple] = {}  # uid -> (tokens, seconds) its branch checkpoint prefilled
        self.closed = False  # replaced (another model): the thread ends once idle, dropping the model
        self.exiting = False  # the process is exiting: once idle the thread parks instead of ending
        self.parked = threading.Event()  # set once the thread parked
        self.peak = 0  # most rows decoding together
        self.thread = threading.Thread(target=self._loop, name="mlx-dflash-engine", daemon=True)
        self.thread.start()

    def _make(self) -> Engine:
        lm, opts = self.lm, dict(calibration=CALIBRATION, defer_costs=True)
        if self.max_batch > 1:
            return BatchEngine(lm.model, lm.tokenizer, lm.drafter, max_batch=self.max_batch,
                               prefill_together=self.prefill_together, **opts)
        return Engine(lm.model, lm.tokenizer, lm.drafter, **opts)

    # -- the serving threads' side -------------------------------------------------------------
    def stream(self, ids: List[int], config, gone: Callable[[], bool] = lambda: False
               ) -> Iterator[GenerationResponse]:
        """The responses of one request, as stream_generate yields them. It is
        cancelled at the next step (a prefill chunk is one) once `gone()` says
        its client left, or when the generator is closed early."""
        q: queue.Queue = queue.Queue()
        with self.cv:
            self.inbox.append((ids, config, q, gone))
            self.cv.notify()
        uid = q.get()
        if isinstance(uid, BaseException):
            raise uid
        done = False
        try:
            while True:
                r = q.get()
                if r is _END:
                    done = True
                    return
                if isinstance(r, BaseException):
                    done = True
                    raise r
                yield r
                if r.finish_reason:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(uid)

    def cancel(self, uid: int) -> None:
        with self.cv:
            self.cancels.append(uid)
            self.cv.notify()

    def close(self) -> None:
        """The thread ends once idle; a cost measurement under way gives way first (waited for here:
        its memory and cores are the next model's)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.stop_measuring()

    def stop_measuring(self) -> None:
        """No more cost measurement while idle; one under way gives way (waited for: the server is stopping)."""
        self.quiet = True
        with self.piece:
            pass

    def quiesce(self, timeout: float) -> bool:
        """The process is exiting: wait until no thread of this engine is inside
        MLX: its thread parked (once idle: the last cancelled rows handed back
        and stored), then the prompt store's writes to disk done. False if
        `timeout` seconds pass first."""
        end, store = time.monotonic() + timeout, self.store
        with self.cv:
            self.exiting = True
        self.close()
        if not self.parked.wait(timeout):
            return False
        return store is None or store.close(max(0.0, end - time.monotonic()))

    def summary(self) -> dict:
        """Occupancy for /metrics."""
        out = {"max_batch": self.max_batch, "peak_rows": self.peak, **self.engine.summary()}
        costs = self.engine.costs
        if costs is not None:  # what the guard prices with: requests that need a missing curve decode plain
            out["costs"] = "ready" if not costs.wanted else \
                f"measuring while idle: {', '.join(curve_name(k) for k in list(costs.wanted))}"
        if self.why_not:
            out["batching"] = f"off: {self.why_not}"
        return out

    def store_summary(self) -> Optional[dict]:
        return self.store.summary() if self.store is not None else None

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self):
        while True:
            with self.cv:
                while not (self.inbox or self.cancels or len(self.engine)):
                    if self.closed and self.exiting:
                        # park, never return: when this thread ends, MLX frees its thread-local compile
                        # cache, which needs the GIL; at the interpreter's exit that aborts (rc -6)
                        self.parked.set()
                        threading.Event().wait()
                    if self.closed:
                        self.engine = self.lm = self.store = None
                        return
                    wanted = self._costs_wanted()
                    if wanted and time.monotonic() - self.last_busy >= IDLE_S:
                        break
                    self.cv.wait(IDLE_S if wanted else None)
                inbox, self.inbox = self.inbox, []
                cancels, self.cancels = self.cancels, []
            for ids, cfg, q, gone in inbox:  # (one that must run alone waits in the engine for an empty set)
                self._submit(ids, cfg, q, gone)
            cancels += [uid for uid, gone in self.gone.items() if gone()]
            for uid in cancels:
                self.engine.cancel(uid)
                self.gone.pop(uid, None)
                q = self.outs.pop(uid, None)
                if q is not None:
                    q.put(_END)
            if len(self.engine):
                self._step()
            self._store_released()
            for q, r in self.last:  # (a client that sends its next turn at once finds this one stored)
                q.put(r)
            self.last = []
            if inbox or cancels or len(self.engine):
                self.last_busy = time.monotonic()
            elif self._costs_wanted():
                self._measure_idle()

    def _interrupts(self) -> bool:
        """Whether a measurement under way should give way (read without the lock: a hint, checked again)."""
        return bool(self.inbox or self.cancels) or self.closed or self.quiet or _EXITING.is_set()

    def _costs_wanted(self) -> bool:
        return (self.engine.costs is not None and bool(self.engine.costs.wanted) and not self.quiet
                and not _EXITING.is_set())

    def _measure_idle(self) -> None:
        """One cost curve the guard wants, while no request runs (one that arrives
        meanwhile stops it at the next timed piece; it is measured again later);
        once none is wanted, one line in the log."""
        costs, m = self.engine.costs, self.measuring
        self.costs_ready.clear()
        try:
            with _MEASURING, self.piece:
                if _EXITING.is_set() or self.closed:
                    return
                what, seconds, fresh = costs.measure_next(self._interrupts)
        except Interrupted:
            self.last_busy = time.monotonic()
            return
        except Exception as e:  # noqa: BLE001 - the guard stays plain where it lacks costs; the server goes on
            sys.stderr.write(f"mlx-dflash: measuring the guard's costs failed ({type(e).__name__}: {e}); "
                             "requests that need them decode plain\n")
            if not costs.wanted:
                self.costs_ready.set()
            return
        m[fresh] += 1
        m[2] += seconds
        if not costs.wanted:
            sys.stderr.write(f"mlx-dflash: the guard's costs for '{self.lm.id}' on this machine: {m[1]} curves "
                             f"measured, {m[0]} read from the cache, {m[2]:.1f} s while idle (until then, requests "
                             "that need them decode plain)\n")
            self.measuring = [0, 0, 0.0]
            self.costs_ready.set()

    def _submit(self, ids, cfg, q, gone) -> None:
        pc, extra = None, (0, 0.0)
        try:
            if self.store is not None:  # its longest cached prefix
                pc, extra = self._take(ids, cfg)
            uid = self.engine.submit(ids, cfg, prompt_cache=pc)
        except BaseException as e:  # ValueError: the request's fault (its serving thread answers it)
            if pc is not None and not isinstance(e, ValueError):
                pc = None  # may be half-written: not stored
            if pc is not None:
                self.store.put(pc, self.engine.target)
            q.put(e)
            return
        self.outs[uid], self.gone[uid] = q, gone
        if extra[0]:
            self.reused[uid] = extra
        q.put(uid)

    def _take(self, ids, cfg) -> tuple:
        """The prompt cache a request starts from, and (tokens, seconds) of a branch
        checkpoint prefilled for it now (its own prompt's, though the engine finds
        them cached: the request's stats count them as its prefill)."""
        d, target = self.lm.drafter, self.engine.target
        with_drafter = cfg.keeps_drafter_context(d, len(ids))
        branch = self.store.branch_point(target, ids, d, with_drafter)
        pc, n0 = self.store.take(target, ids, d, with_drafter)
        if branch < MIN_BRANCH:  # (branch < len(ids): one token is always left to process)
            return pc, (0, 0.0)
        eng = Engine(self.lm.model, self.lm.tokenizer, d, calibration=CALIBRATION, target=target, defer_costs=True)
        eng.submit(ids[:branch], dataclasses.replace(cfg, max_tokens=1, stop=None, logits_processors=[],
                                                     prefill_progress=None), prompt_cache=pc, keep=True)
        seconds = 0.0
        for _, r in eng.run():
            seconds = r.stats.prompt_time
        self.store.put(copy.deepcopy(pc), target, shared=True)
        return pc, (branch - n0, seconds)

    def _step(self) -> None:
        try:
            self.engine.step(self._deliver)
        except BaseException as e:  # a bug: every running request gets it, the engine starts over
            traceback.print_exc(file=sys.stderr)
            for q in self.outs.values():
                q.put(e)
            self.outs.clear()
            self.gone.clear()
            if self.store is not None:
                self.store.clear()  # a cache may be half-written
            self.engine = self._make()
            return
        self.peak = max(self.peak, self.engine.occupancy)

    def _store_released(self) -> None:
        """The caches of requests that left go to the prompt store."""
        for _, pc in self.engine.released():
            if self.store is not None:
                self.store.put(pc, self.engine.target)

    def _deliver(self, uid: int, r: GenerationResponse) -> None:
        q = self.outs.get(uid)
        if q is None:
            return
        extra = self.reused.get(uid)
        if extra is not None and r.finish_reason:  # its branch checkpoint was its own prefill
            r.stats.reused_tokens -= extra[0]
            r.stats.prompt_time += extra[1]
            del self.reused[uid]
        if r.finish_reason:
            del self.outs[uid], self.gone[uid]
            self.last.append((q, r))
        else:
            q.put(r)


class SplitEngine:
    """A split target's requests (split.SplitServer: rank 0 leads, the others follow)."""

    processors = False  # every rank would need the same processor state
    store = None

    def __init__(self, server):
        self.server, self.lm = server, server.lm

    def stream(self, ids: List[int], config, gone: Callable[[], bool] = lambda: False
               ) -> Iterator[GenerationResponse]:
        return self.server.stream(ids, config)  # (every rank runs it to its end: split.Leader)

    def summary(self) -> dict:
        return {"max_batch": 1, "split": self.server.group.size()}

    def store_summary(self) -> Optional[dict]:
        return None

    def stop_measuring(self) -> None:
        """(a split target measures nothing while idle)"""

    def close(self) -> None:
        """(the split server closes with the process)"""

    def quiesce(self, timeout: float) -> bool:
        """(the split server closes with the process; no prompt store)"""
        return True

