"""The server's batch thread (`max_batch` > 1): it alone drives the model,
stepping mlx_dflash.engine.batch.BatchEngine while rows run, and hands each request's
responses to the thread serving that request (worker.Worker._serve reads them
as it reads stream_generate's). A request the batch cannot run (logprobs,
a quantized KV cache, a model whose caches cannot be batched) runs alone on
this same thread once the running rows are done: never two model forwards at
once, never a different answer.

With a prompt store (`store_of`: the worker's, for this model), a request
takes its longest cached prefix as a single-stream request does, so its row
prefills only the rest, and its row's caches go back to the store when it
leaves: a conversation's next turn finds them, batched or alone. The store is
touched only while `running` is held (the worker's lone requests hold it too)."""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import Callable, Dict, List, Optional

from mlx_dflash.cache.prompt_store import PromptStore
from mlx_dflash.engine.batch import BatchEngine, BatchError
from mlx_dflash.engine.calibrate import DEFAULT as CALIBRATION
from mlx_dflash.engine.engine import Engine

_END = object()


class Batcher:
    def __init__(self, lm, max_batch: int, store_of: Optional[Callable[[], Optional[PromptStore]]] = None,
                 on_store: Optional[Callable[[], None]] = None, prefill_together: bool = False):
        self.lm = lm
        self.max_batch = max_batch
        self.store_of = store_of  # the prompt store for `lm` (None: none now, e.g. another model loaded)
        self.on_store = on_store  # after the batch stored a cache (the worker's /metrics summary)
        self.together = prefill_together  # new prompts arriving together: one batched prefill
        self.why_not = None
        self.engine: Engine = self._engine()
        self.cv = threading.Condition()
        self.running = threading.Lock()  # held while this thread runs the model
        self.inbox: List[tuple] = []  # (ids, config, reply queue)
        self.cancels: List[int] = []
        self.outs: Dict[int, queue.Queue] = {}
        self.closed = False  # replaced (another model): the thread ends once idle, dropping the model
        self.peak = 0  # most rows decoding together
        threading.Thread(target=self._loop, name="mlx-dflash-batch", daemon=True).start()

    # -- the serving threads' side ------------------------------------------------------
    def stream(self, ids: List[int], config):
        """The responses of one request, as stream_generate yields them; closing
        the generator early (a client gone) cancels its row."""
        q: queue.Queue = queue.Queue()
        with self.cv:
            self.inbox.append((ids, config, q))
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
                with self.cv:
                    self.cancels.append(uid)
                    self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()

    def summary(self) -> dict:
        """Batch occupancy for /metrics."""
        e = self.engine
        out = {"max_batch": self.max_batch, "peak_rows": self.peak}
        if self.why_not:
            out["batching"] = f"off: {self.why_not}"
        if e is not None:
            out.update(e.summary())
        return out

    # -- the batch thread ---------------------------------------------------------------
    def _loop(self):
        while True:
            with self.cv:
                while not (self.inbox or self.cancels or len(self.engine)):
                    if self.closed:
                        self.engine = self.lm = None
                        return
                    self.cv.wait()
                inbox, self.inbox = self.inbox, []
                cancels, self.cancels = self.cancels, []
            with self.running:
                for ids, cfg, q in inbox:  # (one that must run alone waits in the engine for an empty set)
                    self._submit(ids, cfg, q)
                for uid in cancels:
                    self.engine.cancel(uid)
                    q = self.outs.pop(uid, None)
                    if q is not None:
                        q.put(_END)
                self._store_released()
                if len(self.engine):
                    self._step()

    def _submit(self, ids, cfg, q) -> None:
        store = self.store_of() if self.store_of is not None else None
        pc = None
        if store is not None:  # the longest cached prefix, as worker._serve looks it up for a lone request
            d = self.lm.drafter
            pc, _ = store.take(self.engine.target, ids, d, cfg.keeps_drafter_context(d, len(ids)))
        try:
            uid = self.engine.submit(ids, cfg, prompt_cache=pc)
        except ValueError as e:
            if pc is not None:  # (refused before it was touched)
                store.put(pc, self.engine.target)
            q.put(e)
            return
        self.outs[uid] = q
        q.put(uid)

    def _engine(self) -> Engine:
        try:
            return BatchEngine(self.lm.model, self.lm.tokenizer, self.lm.drafter, max_batch=self.max_batch,
                               prefill_together=self.together, calibration=CALIBRATION)
        except BatchError as e:  # every request of this model runs alone, on the same engine
            self.why_not = str(e)
            sys.stderr.write(f"mlx-dflash: {e}; requests run one at a time\n")
            return Engine(self.lm.model, self.lm.tokenizer, self.lm.drafter, calibration=CALIBRATION)

    def _step(self):
        try:
            self.engine.step(self._deliver)
        except BaseException as e:  # a bug: every running request gets it, the engine starts over
            traceback.print_exc(file=sys.stderr)
            for q in self.outs.values():
                q.put(e)
            self.outs.clear()
            self.engine = self._engine()
            return
        self.peak = max(self.peak, self.engine.occupancy)
        self._store_released()

    def _store_released(self) -> None:
        """The caches of rows that left go to the prompt store."""
        back = self.engine.released()
        store = self.store_of() if back and self.store_of is not None else None
        if store is None:
            return
        for _, pc in back:
            store.put(pc, self.engine.target)
        if self.on_store is not None:
            self.on_store()

    def _deliver(self, uid: int, r) -> None:
        q = self.outs.get(uid)
        if q is not None:
            q.put(r)
            if r.finish_reason:
                del self.outs[uid]
