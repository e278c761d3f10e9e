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

import errno
import hashlib
import json
import os
import queue
import shutil
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from filelock import FileLock, Timeout
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ..drafting.drafter import ContextCache
from ..target import rollback as rb
from .identity import FORMAT, digest
from .prompt_cache import PromptCache

BLOCK = 256  # tokens per shared block
MIN_TOKENS = 16  # shorter prefixes are not worth a file
MAX_QUEUED = 4  # writes waiting; more are dropped (speed only: the memory tier still has them)
LOCK_WAIT_S = 30.0  # another process holding the folder's lock longer: skip this write
STALE_TMP_S = 3600.0  # a temp file this old was left by a writer that died
SUFFIX = ".safetensors"
IDENTITY = "identity.json"
LOCK = ".lock"


def log(msg: str) -> None:
    sys.stderr.write(f"mlx-dflash: prompt cache: {msg}\n")


def root_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "prompts"


# -- hashing -------------------------------------------------------------------------------

def _h(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:32]


def _ids(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


def block_hashes(seed: str, tokens: Sequence[int], block: int = BLOCK) -> List[str]:
    """The hash of every full block of `tokens`, each covering all the tokens up to its end."""
    out, h = [], seed
    for i in range(len(tokens) // block):
        h = _h(h.encode(), _ids(tokens[i * block:(i + 1) * block]))
        out.append(h)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


# -- cache layers as rows and states ----------------------------------------------------------

def _is_rows(c, n: int) -> bool:
    """A layer whose cache is the K/V rows of all `n` tokens by position, stored
    in blocks (exact types: a subclass may keep more state)."""
    return type(c) in (KVCache, QuantizedKVCache) and c.keys is not None and c.offset == n


def _kind(c) -> str:
    if isinstance(c, QuantizedKVCache):
        return f"QuantizedKVCache:{c.bits}:{c.group_size}"
    return type(c).__name__


def _rows(c, a: int, b: int):
    """Rows [a, b) of a row layer as a cache of its own kind holding only them."""
    if isinstance(c, QuantizedKVCache):
        k = tuple(x[..., a:b, :] for x in c.keys)
        v = tuple(x[..., a:b, :] for x in c.values)
        return QuantizedKVCache.from_state((k, v, b - a, c.group_size, c.bits))
    return KVCache.from_state((c.keys[..., a:b, :], c.values[..., a:b, :], b - a))


def _join(parts: list, template: str):
    """Row caches (in order) as one layer cache holding all their rows."""
    n = sum(p.offset for p in parts)
    if template.startswith("QuantizedKVCache"):
        _, bits, group = template.split(":")
        k = tuple(mx.concatenate([p.keys[i] for p in parts], axis=-2) for i in range(3))
        v = tuple(mx.concatenate([p.values[i] for p in parts], axis=-2) for i in range(3))
        return QuantizedKVCache.from_state((k, v, n, int(group), int(bits)))
    return KVCache.from_state((mx.concatenate([p.keys for p in parts], axis=2),
                               mx.concatenate([p.values for p in parts], axis=2), n))


def max_trim(caches: list) -> int:
    """How many trailing tokens these caches could drop once loaded (no forward
    recorded: a recurrent state cannot go back at all)."""
    if rb.unsupported_kind(caches) or rb.recurrent(caches):
        return 0
    leaves = [x for c in caches for x in rb.leaves(c)]
    if any(isinstance(x, rb.ROW_CACHES) and not x.is_trimmable() for x in leaves):
        return 0
    rot = [x for x in leaves if isinstance(x, rb.RotatingKVCache)]
    if not rot:
        return sys.maxsize
    hi = min(x.offset for x in rot)
    lo = 0
    while lo < hi:  # rotating_can_trim holds for every n up to a limit
        mid = (lo + hi + 1) // 2
        if all(rb.rotating_can_trim(x, mid) for x in rot):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _arrays(caches: list) -> Dict[str, mx.array]:
    """The arrays save_prompt_cache writes, by its names (tree_flatten of the states)."""
    return {k: v for k, v in tree_flatten([c.state for c in caches]) if isinstance(v, mx.array)}


def _crc(arrays: Dict[str, mx.array]) -> Dict[str, int]:
    return {k: zlib.crc32(memoryview(v)) for k, v in arrays.items()}


def _contiguous(caches: list) -> list:
    """The same caches with every array a contiguous copy (what the CRCs are of), evaluated."""
    out = []
    for c in caches:
        st = c.state
        new = type(c).from_state(_map(st))
        out.append(new)
    mx.eval([a for a in _arrays(out).values()])
    return out


def _map(x, fn=mx.contiguous):
    if isinstance(x, mx.array):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    return x


def _freeze(c):
    """A copy of a layer cache that later writes into `c` do not reach (its arrays
    are new array objects over the same data; lists are copied)."""
    return type(c).from_state(_map(c.state, lambda a: a[...]))


# -- the file format -------------------------------------------------------------------------

def read_meta(path: Path) -> dict:
    """The metadata of one of our safetensors files, from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated header")
        n = struct.unpack("<Q", head)[0]
        if n > 64 << 20:
            raise ValueError("not a safetensors file")
        h = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
    ends = [v["data_offsets"][1] for k, v in h.items() if k != "__metadata__"]
    if size < 8 + n + max(ends, default=0):
        raise ValueError("truncated")
    meta = json.loads(h.get("__metadata__", {}).get("0.dflash", "null"))
    if not isinstance(meta, dict):
        raise ValueError("not a prompt cache file")
    return meta


def _write(path: Path, caches: list, meta: dict) -> int:
    """Write `caches` (contiguous, evaluated) with `meta` and their CRCs: a temp file,
    renamed into place. Returns the bytes written."""
    meta = dict(meta, crc=_crc(_arrays(caches)))
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident() % 10**6}.tmp{SUFFIX}")
    need = sum(int(a.nbytes) for a in _arrays(caches).values())
    try:
        open(tmp, "wb").close()  # (a read-only or missing folder: the OSError, not MLX's RuntimeError)
        try:
            save_prompt_cache(str(tmp), caches, {"dflash": json.dumps(meta)})
        except RuntimeError as e:  # MLX's writer says only that it could not write
            if shutil.disk_usage(tmp.parent).free < need:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} ({e})") from None
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return size


def _read(path: Path, want: dict) -> Tuple[list, dict]:
    """(caches, metadata) of a file, checked: format, identity and every array's CRC."""
    caches, md = load_prompt_cache(str(path), return_metadata=True)
    meta = json.loads(md["dflash"])
    for k, v in want.items():
        if meta.get(k) != v:
            raise ValueError(f"{k} {meta.get(k)!r}, expected {v!r}")
    arrays = _arrays(caches)
    mx.eval(list(arrays.values()))
    crc = meta.get("crc") or {}
    if set(crc) != set(arrays) or any(zlib.crc32(memoryview(a)) != crc[k] for k, a in arrays.items()):
        raise ValueError("checksum mismatch")
    return caches, meta


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
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)


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
        self.seed = _h(self.key.encode(), str(block).encode())
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
            caches, meta = _read(path, want)
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
                    got, bm = _read(bp, dict(want, hash=h))
                except Exception as err:  # a broken block goes, and with it this entry (one line for both)
                    _unlink(bp)
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
                    c = _join(ps, kind["kind"]) if ps else c
                target.append(c)
            pc = PromptCache(target=target, tokens=[int(t) for t in meta["tokens"][:keep]])
            if meta["drafter"] is not None and drafter is not None:
                d = meta["drafter"]
                pc.drafter = [_context(c, spec) for c, spec in zip(caches[ncache:], d["layers"])]
                pc.drafter_id, pc.drafter_layout = id(drafter), tuple(d["layout"])
                if d["pending"]:
                    pc.pending = caches[-1].cache[0]
            mx.eval([a for a in _arrays(pc.target).values()])
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
        name = _h(self.seed.encode(), _ids(pc.tokens), json.dumps([reach, layout]).encode())
        with self._lock:
            known = self.index.get(name)
        if known is not None or self._entry_path(name).exists():
            try:
                os.utime(self._entry_path(name))
            except OSError:
                pass
            return
        target = list(pc.target)
        kinds = [{"kind": _kind(c), "rows": _is_rows(c, n)} for c in target]
        sig = json.dumps([k["kind"] for k in kinds if k["rows"]]).encode()
        blocks = block_hashes(_h(self.seed.encode(), sig), pc.tokens, self.block)
        # capture: a row layer as its rows so far (a later write into the cache makes new arrays)
        snap = [_rows(c, 0, n) if k["rows"] else _freeze(c) for c, k in zip(target, kinds)]
        dsnap = [_snapshot_context(c) for c in d] if d else []
        pending = pc.pending[...] if d and pc.pending is not None else None
        mx.eval(list(_arrays(snap + dsnap).values()) + ([pending] if pending is not None else []))  # (views)
        meta = {"format": FORMAT, "identity": self.key, "tokens": list(map(int, pc.tokens)), "reach": reach,
                "layout": layout, "max_trim": min(max_trim(target), n), "blocks": blocks, "layers": kinds,
                "drafter": None if not d else {"layout": layout, "pending": pending is not None,
                                               "layers": [_context_spec(c) for c in d]}}
        nbytes = sum(int(a.nbytes) for a in _arrays(snap + dsnap).values()) + (
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
                job.done.set()

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
                part = _contiguous([_rows(job.target[j], a, b) for j in rows])
                written += _write(p, part, {"format": FORMAT, "identity": self.key, "hash": h, "layers": rows})
            tail = len(job.blocks) * self.block
            own = [_rows(c, tail, n) if k["rows"] else c for c, k in zip(job.target, job.meta["layers"])]
            extra = list(job.drafter)
            if job.pending is not None:
                extra.append(_pending_cache(job.pending))
            written += _write(self._entry_path(job.name), _contiguous(own + extra), job.meta)
            self._forget_covered(job)
            self._evict()
            self._remove_stale()
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

    # -- the budget (under the folder lock) ------------------------------------------------
    def _evict(self) -> None:
        """Least recently used entries first, over every identity's folder, until the
        prompts folder is under budget; then the blocks no entry names."""
        entries, blocks = _scan(self.root)
        total = sum(s for _, s, _ in entries) + sum(s for s, _ in blocks.values())
        entries.sort(key=lambda x: x[2])  # oldest use first
        while total > self.budget and entries:
            path, size, _ = entries.pop(0)
            try:
                path.unlink()
                total -= size
            except OSError:
                pass
        used = set()
        for path, _, _ in entries:
            try:
                used.update((path.parent.parent.name, h) for h in read_meta(path)["blocks"])
            except (OSError, ValueError, KeyError):
                continue
        for (ns, h), (size, path) in blocks.items():
            if (ns, h) not in used:
                try:
                    path.unlink()
                except OSError:
                    pass
        self.refresh()

    def _remove_stale(self) -> None:
        """Temp files of writers that died (killed mid-write)."""
        now = time.time()
        for sub in ("entries", "blocks"):
            try:
                for de in os.scandir(self.dir / sub):
                    if de.name.startswith(".") and ".tmp" in de.name and not _alive_writer(de.name, now, de):
                        try:
                            os.unlink(de.path)
                        except OSError:
                            pass
            except OSError:
                continue


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _alive_writer(name: str, now: float, de) -> bool:
    """Whether a temp file may still be being written: its process is alive and
    it is younger than STALE_TMP_S."""
    try:
        pid = int(name.split(".")[2])
        age = now - de.stat().st_mtime
    except (ValueError, IndexError, OSError):
        return False
    if age > STALE_TMP_S:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def folders(root: Path) -> List[dict]:
    """Every identity folder under the prompts folder: its identity (as written),
    entries, blocks, bytes and last use, most recently used first."""
    out = []
    try:
        versions = [v for v in os.scandir(root) if v.is_dir()]
    except OSError:
        return out
    for v in versions:
        for ns in (x for x in os.scandir(v.path) if x.is_dir()):
            d = Path(ns.path)
            try:
                ident = json.loads((d / IDENTITY).read_text())
            except (OSError, ValueError):
                ident = {}
            row = {"folder": str(d), "format": v.name, "current": v.name == f"v{FORMAT}", "identity": ident,
                   "entries": 0, "blocks": 0, "bytes": 0, "last_used": 0.0, "tokens": []}
            for sub in ("entries", "blocks"):
                try:
                    items = [e for e in os.scandir(d / sub) if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
                except OSError:
                    continue
                for e in items:
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    row[sub] += 1
                    row["bytes"] += st.st_size
                    if sub == "entries":
                        row["last_used"] = max(row["last_used"], st.st_mtime)
                        try:
                            row["tokens"].append(len(read_meta(Path(e.path))["tokens"]))
                        except (OSError, ValueError, KeyError, TypeError):
                            pass
            out.append(row)
    return sorted(out, key=lambda r: -r["last_used"])


def clear(root: Path, folder: Optional[str] = None) -> Tuple[int, int]:
    """Delete every cached prompt (or one identity folder's), under the lock
    writers take. Returns (files, bytes) removed."""
    files = size = 0
    if not Path(root).is_dir():
        return 0, 0
    with FileLock(str(Path(root) / LOCK), timeout=LOCK_WAIT_S):
        for row in folders(root):
            if folder is not None and row["folder"] != folder:
                continue
            files += row["entries"] + row["blocks"]
            size += row["bytes"]
            shutil.rmtree(row["folder"], ignore_errors=True)
    return files, size


def _scan(root: Path):
    """Every entry (path, bytes, last use) and block ((identity, hash) -> (bytes,
    path)) under the prompts folder, every format version included."""
    entries, blocks = [], {}
    try:
        versions = [v for v in os.scandir(root) if v.is_dir()]
    except OSError:
        return entries, blocks
    for v in versions:
        for ns in (x for x in os.scandir(v.path) if x.is_dir()):
            for sub in ("entries", "blocks"):
                try:
                    items = list(os.scandir(os.path.join(ns.path, sub)))
                except OSError:
                    continue
                for de in items:
                    if not de.name.endswith(SUFFIX) or de.name.startswith("."):
                        continue
                    try:
                        st = de.stat()
                    except OSError:
                        continue
                    if sub == "entries" and v.name == f"v{FORMAT}":
                        entries.append((Path(de.path), st.st_size, st.st_mtime))
                    elif sub == "blocks" and v.name == f"v{FORMAT}":
                        blocks[(ns.name, de.name[: -len(SUFFIX)])] = (st.st_size, Path(de.path))
                    else:  # another format's files: counted first to go
                        entries.append((Path(de.path), st.st_size, 0.0))
    return entries, blocks


# -- the drafter's context as mlx-lm caches --------------------------------------------------

def _context_spec(c) -> dict:
    if isinstance(c, ContextCache):
        return {"window": c.window, "sink": c.sink, "offset": c.offset}
    return {"offset": c.offset}


def _snapshot_context(c):
    """A drafter layer's context as a KVCache holding exactly its rows."""
    if c.keys is None:
        return KVCache()
    rows = c.rows if isinstance(c, ContextCache) else c.offset
    return KVCache.from_state((c.keys[..., :rows, :], c.values[..., :rows, :], rows))


def _context(saved, spec: dict):
    """A drafter layer's cache back from its KVCache and spec."""
    if "window" in spec:
        c = ContextCache(spec["window"], spec["sink"])
        if saved.keys is not None:
            c.keys, c.values = saved.keys, saved.values
        c.offset = spec["offset"]
        return c
    return saved


def _pending_cache(pending: mx.array):
    c = ArraysCache(1)
    c.cache = [pending]
    return c
