"""The prompt store's disk tier: cached prefixes that outlive the process, for
`serve`, `chat` and `generate`, shared by any number of processes.

Layout, under `<cache dir>/prompts/v<FORMAT>/<identity digest>/` (identity.py:
one folder per model + drafter + dtype + tokenizer + chat template + versions):

- `blocks/<hash>.safetensors`: the K/V rows of one block of BLOCK tokens for
  every layer whose cache is rows by position (mlx-lm's KVCache and
  QuantizedKVCache), named by the hash of all the tokens up to the block's end
  (vLLM's prefix caching): conversations that share a system prompt and tools
  share those files.
- `entries/<hash>.safetensors`: one cached prefix, named by the hash of its
  tokens: its tokens, the rows after its last full block, the whole state of
  every other layer (recurrent, sliding window: a checkpoint at that point), the
  drafter's context and pending features, in mlx-lm's `save_prompt_cache`
  format (the caches' own `state`), with a CRC of every array.

An entry serves any prompt that starts with its tokens, and (when its caches
can drop tokens) any prompt sharing a prefix with it, exactly as the memory
tier matches. The n-gram index is rebuilt from the tokens.

Writes happen on a thread of their own, never on a request's path, as temp
files renamed into place under a file lock (atomic for readers, which take no
lock). A file that is missing, truncated, corrupt or of another format is
dropped with one log line and the request prefills afresh; a write that fails
(full disk, read-only folder) is skipped with one log line. Over `budget`
bytes, the least recently used entries go, then the blocks nothing uses."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from filelock import FileLock, Timeout

from .disk_folder import IDENTITY, LOCK, LOCK_WAIT_S, evict, folders, remove_stale, unlink
from .disk_format import (SUFFIX, arrays_of, block_hashes, common_prefix, context_from, context_rows, context_spec,
                          contiguous, freeze, hash_of, ids_bytes, is_rows, join_rows, layer_kind, max_trim,
                          pending_cache, read_file, read_meta, rows_of, write_file)
from .identity import FORMAT, digest
from .prompt_cache import PromptCache

BLOCK = 256  # tokens per shared block
MIN_TOKENS = 16  # shorter prefixes are not worth a file
MAX_QUEUED = 4  # writes waiting; more are dropped (speed only: the memory tier still has them)


def log(msg: str) -> None:
    sys.stderr.write(f"mlx-dflash: prompt cache: {msg}\n")


def root_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "prompts"


# -- the tier --------------------------------------------------------------------------------

@dataclass
class Entry:
    """One entry on disk, as the index knows it (from its header)."""

    name: str
    tokens: np.ndarray
    reach: int  # tokens the drafter context covers (rows + pending), -1: none
    layout: tuple  # the drafter context's (window, sink)
    max_trim: int
    blocks: List[str]
    size: int
    mtime: float


@dataclass
class DiskStats:
    hits: int = 0
    loaded_tokens: int = 0
    bytes_read: int = 0
    load_time: float = 0.0  # seconds
    writes: int = 0
    bytes_written: int = 0
    write_time: float = 0.0
    dropped: int = 0  # files found broken and removed
    write_errors: int = 0
    skipped: int = 0  # writes not made (queue full, lock busy)


@dataclass
class _Job:
    name: str
    meta: dict
    target: list  # evaluated layer caches (row layers: the full rows)
    drafter: list
    pending: Optional[mx.array]
    blocks: List[str]
    nbytes: int  # what it holds in memory until written


class DiskTier:
    """Cached prefixes of one model identity on disk, under `budget` bytes for the
    whole prompts folder (every identity: one budget for the disk)."""

    def __init__(self, root: Path, ident: dict, budget: int, block: int = BLOCK):
        self.root = Path(root)
        self.ident = ident
        self.key = digest(ident)
        self.dir = self.root / f"v{FORMAT}" / self.key
        self.budget = max(0, int(budget))
        self.block = block
        self.stats = DiskStats()
        self.seed = hash_of(self.key.encode(), str(block).encode())
        self.index: Dict[str, Entry] = {}
        self._lock = threading.Lock()  # the index
        self._queue: "queue.Queue[_Job]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None
        self._queued_bytes = 0
        self.readonly: Optional[str] = None  # why writing is off (logged once)
        self._noted = False  # other versions' folders looked for

    # -- paths ---------------------------------------------------------------------------
    def _entry_path(self, name: str) -> Path:
        return self.dir / "entries" / f"{name}{SUFFIX}"

    def _block_path(self, h: str) -> Path:
        return self.dir / "blocks" / f"{h}{SUFFIX}"

    # -- the index -----------------------------------------------------------------------
    def _note_other_versions(self) -> None:
        """One line when this model's prompts were cached by another version of
        mlx-dflash, MLX or mlx-lm: they are not used (and go first when room is needed)."""
        weights = self.ident["model"]["weights"]
        others = [r for r in folders(self.root) if r["folder"] != str(self.dir) and r["entries"]
                  and ((r["identity"].get("model") or {}).get("weights") == weights)]
        if others:
            seen = sorted({f"mlx-dflash {r['identity'].get('mlx_dflash')}, mlx {r['identity'].get('mlx')}, "
                           f"mlx-lm {r['identity'].get('mlx_lm')}, format {r['format'][1:]}" for r in others})
            log(f"{sum(r['entries'] for r in others)} prompts of this model cached by another version are not used "
                f"({'; '.join(seen)}); they go as the least recently used when room is needed")

    def refresh(self) -> None:
        """Bring the index in line with the folder (other processes write and evict too)."""
        if not self._noted:
            self._noted = True
            self._note_other_versions()
        try:
            listing = {e.name[: -len(SUFFIX)]: e for e in os.scandir(self.dir / "entries")
                       if e.name.endswith(SUFFIX) and not e.name.startswith(".")}
        except OSError:
            listing = {}
        with self._lock:
            for name in [n for n in self.index if n not in listing]:
                del self.index[name]
            for name, de in listing.items():
                if name in self.index:
                    continue
                try:
                    st = de.stat()
                    m = read_meta(Path(de.path))
                    if m.get("format") != FORMAT or m.get("identity") != self.key:
                        raise ValueError(f"written by another version (format {m.get('format')})")
                    self.index[name] = Entry(name, np.asarray(m["tokens"], dtype=np.int64), int(m["reach"]),
                                             tuple(m["layout"]), int(m["max_trim"]), list(m["blocks"]),
                                             st.st_size, st.st_mtime)
                except FileNotFoundError:
                    continue
                except (OSError, ValueError, KeyError, TypeError) as e:
                    self._drop(Path(de.path), f"{type(e).__name__}: {e}")

    def _drop(self, path: Path, why: str) -> None:
        self.stats.dropped += 1
        log(f"dropped {path.name} ({why}); its prompts are prefilled again")
        try:
            path.unlink()
        except OSError:
            pass

    def usable(self, e: Entry, with_drafter: bool) -> int:
        """As prompt_cache.reusable: with the drafter, the tokens its context covers."""
        if not with_drafter:
            return len(e.tokens)
        return 0 if e.reach < 0 else min(len(e.tokens), e.reach)

    def match(self, ids: Sequence[int], with_drafter: bool) -> Tuple[Optional[Entry], int, int]:
        """(entry, tokens it serves, longest prefix shared with any entry) for a
        prompt: served as the memory tier serves (one token is always left to
        process; an entry that cannot drop its extra tokens serves only prompts it
        starts). The last number is where conversations branch (branch_point)."""
        self.refresh()
        head = np.asarray(ids[:-1], dtype=np.int64)
        best, best_n, shared = None, 0, 0
        with self._lock:
            entries = list(self.index.values())
        for e in entries:
            n = common_prefix(e.tokens[: self.usable(e, with_drafter)], head)
            shared = max(shared, n)
            if n and len(e.tokens) - n > e.max_trim:
                n = 0
            if n > best_n:
                best, best_n = e, n
        return best, best_n, shared

    def summary(self) -> dict:
        with self._lock:
            entries = list(self.index.values())
        return {"entries": len(entries), "tokens": [len(e.tokens) for e in entries],
                "budget": self.budget, "folder": str(self.dir), "queued_bytes": self._queued_bytes,
                **({"readonly": self.readonly} if self.readonly else {}), **self.stats.__dict__}

    # -- load ----------------------------------------------------------------------------
    def load(self, e: Entry, upto: int, drafter) -> Optional[PromptCache]:
        """Entry `e` as a PromptCache for `drafter`, its row layers cut to the blocks
        covering `upto` tokens; None (and the file dropped, one log line) if any part
        of it is missing or broken."""
        t0 = time.perf_counter()
        path = self._entry_path(e.name)
        want = {"format": FORMAT, "identity": self.key}
        nbytes = 0
        try:
            if not path.exists():
                raise FileNotFoundError(path)
            caches, meta = read_file(path, want)
            nbytes += path.stat().st_size
            n = len(meta["tokens"])
            rows = [i for i, kind in enumerate(meta["layers"]) if kind["rows"]]
            k = len(e.blocks)
            if len(rows) == len(meta["layers"]):  # only rows: the blocks covering `upto` are enough
                k = min(k, -(-upto // self.block))
            keep = n if k == len(e.blocks) else k * self.block  # tokens this load has
            parts: Dict[int, list] = {i: [] for i in rows}
            for h in e.blocks[:k]:
                bp = self._block_path(h)
                if not bp.exists():
                    raise ValueError(f"its block {h[:12]} is missing")
                try:
                    got, bm = read_file(bp, dict(want, hash=h))
                except Exception as err:  # a broken block goes, and with it this entry (one line for both)
                    unlink(bp)
                    raise ValueError(f"its block {h[:12]} is broken: {type(err).__name__}: {err}") from None
                if bm["layers"] != rows:
                    raise ValueError("block layout differs")
                nbytes += bp.stat().st_size
                for i, c in zip(rows, got):
                    parts[i].append(c)
            ncache = len(meta["layers"])
            target = []
            for i, kind in enumerate(meta["layers"]):
                c = caches[i]
                if kind["rows"]:
                    ps = parts[i] + ([c] if keep == n and c.offset else [])
                    c = join_rows(ps, kind["kind"]) if ps else c
                target.append(c)
            pc = PromptCache(target=target, tokens=[int(t) for t in meta["tokens"][:keep]])
            if meta["drafter"] is not None and drafter is not None:
                d = meta["drafter"]
                pc.drafter = [context_from(c, spec) for c, spec in zip(caches[ncache:], d["layers"])]
                pc.drafter_id, pc.drafter_layout = id(drafter), tuple(d["layout"])
                if d["pending"]:
                    pc.pending = caches[-1].cache[0]
            mx.eval([a for a in arrays_of(pc.target).values()])
        except FileNotFoundError:  # evicted by another process meanwhile: a miss
            with self._lock:
                self.index.pop(e.name, None)
            return None
        except Exception as err:  # noqa: BLE001 - any fault in a cache file: drop it, prefill afresh
            with self._lock:
                self.index.pop(e.name, None)
            self._drop(path, f"{type(err).__name__}: {err}")
            return None
        try:
            os.utime(path)  # the LRU clock
        except OSError:
            pass
        dt = time.perf_counter() - t0
        s = self.stats
        s.hits += 1
        s.loaded_tokens += min(upto, len(pc.tokens))  # (served; the rest is trimmed)
        s.bytes_read += nbytes
        s.load_time += dt
        pc.origin = {"tier": "disk", "bytes": nbytes, "load_ms": round(dt * 1000, 1)}
        return pc

    # -- save ----------------------------------------------------------------------------
    def save(self, pc: PromptCache) -> None:
        """Write `pc` in the background (a no-op if it is on disk already: then it
        only counts as used). Its arrays are captured now, so the caller may go on
        mutating the caches; they must be evaluated (PromptStore.put does that)."""
        n = len(pc.tokens)
        if self.readonly or self.budget <= 0 or n < MIN_TOKENS or pc.target is None:
            return
        d = pc.drafter if pc.drafter is not None and pc.drafter_id is not None else None
        reach = d[0].offset + (pc.pending.shape[1] if pc.pending is not None else 0) if d else -1
        layout = list(pc.drafter_layout) if d else [None, 0]
        name = hash_of(self.seed.encode(), ids_bytes(pc.tokens), json.dumps([reach, layout]).encode())
        with self._lock:
            known = self.index.get(name)
        if known is not None or self._entry_path(name).exists():
            try:
                os.utime(self._entry_path(name))
            except OSError:
                pass
            return
        target = list(pc.target)
        kinds = [{"kind": layer_kind(c), "rows": is_rows(c, n)} for c in target]
        sig = json.dumps([k["kind"] for k in kinds if k["rows"]]).encode()
        blocks = block_hashes(hash_of(self.seed.encode(), sig), pc.tokens, self.block)
        # capture: a row layer as its rows so far (a later write into the cache makes new arrays)
        snap = [rows_of(c, 0, n) if k["rows"] else freeze(c) for c, k in zip(target, kinds)]
        dsnap = [context_rows(c) for c in d] if d else []
        pending = pc.pending[...] if d and pc.pending is not None else None
        mx.eval(list(arrays_of(snap + dsnap).values()) + ([pending] if pending is not None else []))  # (views)
        meta = {"format": FORMAT, "identity": self.key, "tokens": list(map(int, pc.tokens)), "reach": reach,
                "layout": layout, "max_trim": min(max_trim(target), n), "blocks": blocks, "layers": kinds,
                "drafter": None if not d else {"layout": layout, "pending": pending is not None,
                                               "layers": [context_spec(c) for c in d]}}
        nbytes = sum(int(a.nbytes) for a in arrays_of(snap + dsnap).values()) + (
            int(pending.nbytes) if pending is not None else 0)
        if self._queue.qsize() >= MAX_QUEUED:
            self.stats.skipped += 1
            return
        self._queued_bytes += nbytes
        self._queue.put(_Job(name, meta, snap, dsnap, pending, blocks, nbytes))
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._run, name="mlx-dflash-disk-cache", daemon=True)
                self._writer.start()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write is done (True), or `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                alive = self._writer is not None and self._writer.is_alive()
            if not alive and self._queue.empty():
                return True
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)

    @property
    def queued_bytes(self) -> int:
        """Memory held by writes not done yet (the server's memory budget counts it)."""
        return self._queued_bytes

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=0.5)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._writer = None
                        return
                continue
            try:
                self._write_job(job)
            except Exception as e:  # noqa: BLE001 - a failed write loses only speed
                self._write_failed(e)
            finally:
                self._queued_bytes -= job.nbytes

    def _write_failed(self, e: BaseException) -> None:
        self.stats.write_errors += 1
        if isinstance(e, OSError) and e.errno in (30, 13, 1):  # EROFS, EACCES, EPERM: stop trying
            self.readonly = f"cannot write to {self.dir} ({e.strerror})"
            log(f"{self.readonly}; cached prompts are kept in memory only")
            return
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        log(f"a cached prompt was not written to {self.dir} ({why}); it is kept in memory only")

    def _write_job(self, job: _Job) -> None:
        t0 = time.perf_counter()
        for sub in ("entries", "blocks"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        label = self.dir / IDENTITY
        if not label.exists():  # what the folder is for (`mlx-dflash cache list`)
            tmp = label.with_name(f".{IDENTITY}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.ident, indent=1))
            os.replace(tmp, label)
        lock = FileLock(str(self.root / LOCK))
        try:
            lock.acquire(timeout=LOCK_WAIT_S)
        except Timeout:
            self.stats.skipped += 1
            return
        written = 0
        try:
            n = len(job.meta["tokens"])
            rows = [i for i, k in enumerate(job.meta["layers"]) if k["rows"]]
            for i, h in enumerate(job.blocks):
                p = self._block_path(h)
                if p.exists():
                    continue
                a, b = i * self.block, (i + 1) * self.block
                part = contiguous([rows_of(job.target[j], a, b) for j in rows])
                written += write_file(p, part, {"format": FORMAT, "identity": self.key, "hash": h, "layers": rows})
            tail = len(job.blocks) * self.block
            own = [rows_of(c, tail, n) if k["rows"] else c for c, k in zip(job.target, job.meta["layers"])]
            extra = list(job.drafter)
            if job.pending is not None:
                extra.append(pending_cache(job.pending))
            written += write_file(self._entry_path(job.name), contiguous(own + extra), job.meta)
            self._forget_covered(job)
            evict(self.root, self.budget)
            remove_stale(self.dir)
            self.refresh()
        finally:
            lock.release()
        self.stats.writes += 1
        self.stats.bytes_written += written
        self.stats.write_time += time.perf_counter() - t0

    def _forget_covered(self, job: _Job) -> None:
        """Entries the new one serves every prompt of (their tokens start it, its
        drafter context reaches as far, it can drop what they lack) are deleted,
        as the memory tier drops them."""
        m = job.meta
        toks = np.asarray(m["tokens"], dtype=np.int64)
        self.refresh()
        with self._lock:
            covered = [e for e in self.index.values() if e.name != job.name and len(e.tokens) <= len(toks)
                       and tuple(e.layout) == tuple(m["layout"]) and e.reach <= m["reach"]
                       and len(toks) - len(e.tokens) <= m["max_trim"]
                       and common_prefix(e.tokens, toks) == len(e.tokens)]
        for e in covered:
            self._remove(e.name)

    def _remove(self, name: str) -> None:
        with self._lock:
            self.index.pop(name, None)
        try:
            self._entry_path(name).unlink()
        except OSError:
            pass
