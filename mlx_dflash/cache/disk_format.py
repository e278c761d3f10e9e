"""The disk tier's file format (disk.py): a cache as mlx-lm's `save_prompt_cache`
writes it (the caches' own `state`, any kind), with our metadata and a CRC of
every array, written to a temp file and renamed into place; layers whose cache
is K/V rows by position, cut into blocks and joined again; the drafter's context
as mlx-lm caches; the hashes that name blocks and entries."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import sys
import threading
import zlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ..drafting.drafter import ContextCache
from ..target import rollback as rb

SUFFIX = ".safetensors"


# -- hashing ---------------------------------------------------------------------------------

def hash_of(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:32]


def ids_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


def block_hashes(seed: str, tokens: Sequence[int], block: int) -> List[str]:
    """The hash of every full block of `tokens`, each covering all the tokens up to its end."""
    out, h = [], seed
    for i in range(len(tokens) // block):
        h = hash_of(h.encode(), ids_bytes(tokens[i * block:(i + 1) * block]))
        out.append(h)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids two arrays share (prompt_cache.common_prefix, vectorized)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


# -- cache layers as rows and states ----------------------------------------------------------

def is_rows(c, n: int) -> bool:
    """A layer whose cache is the K/V rows of all `n` tokens by position, stored
    in blocks (exact types: a subclass may keep more state)."""
    return type(c) in (KVCache, QuantizedKVCache) and c.keys is not None and c.offset == n


def layer_kind(c) -> str:
    if isinstance(c, QuantizedKVCache):
        return f"QuantizedKVCache:{c.bits}:{c.group_size}"
    return type(c).__name__


def rows_of(c, a: int, b: int):
    """Rows [a, b) of a row layer as a cache of its own kind holding only them."""
    if isinstance(c, QuantizedKVCache):
        k = tuple(x[..., a:b, :] for x in c.keys)
        v = tuple(x[..., a:b, :] for x in c.values)
        return QuantizedKVCache.from_state((k, v, b - a, c.group_size, c.bits))
    return KVCache.from_state((c.keys[..., a:b, :], c.values[..., a:b, :], b - a))


def join_rows(parts: list, template: str):
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


def arrays_of(caches: list) -> Dict[str, mx.array]:
    """The arrays save_prompt_cache writes, by its names (tree_flatten of the states)."""
    return {k: v for k, v in tree_flatten([c.state for c in caches]) if isinstance(v, mx.array)}


def _crc(arrays: Dict[str, mx.array]) -> Dict[str, int]:
    return {k: zlib.crc32(memoryview(v)) for k, v in arrays.items()}


def contiguous(caches: list) -> list:
    """The same caches with every array a contiguous copy (what the CRCs are of), evaluated."""
    out = []
    for c in caches:
        st = c.state
        new = type(c).from_state(_map(st))
        out.append(new)
    mx.eval([a for a in arrays_of(out).values()])
    return out


def _map(x, fn=mx.contiguous):
    if isinstance(x, mx.array):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    return x


def freeze(c):
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


def write_file(path: Path, caches: list, meta: dict) -> int:
    """Write `caches` (contiguous, evaluated) with `meta` and their CRCs: a temp file,
    renamed into place. Returns the bytes written."""
    meta = dict(meta, crc=_crc(arrays_of(caches)))
    tmp = temp_name(path)
    need = sum(int(a.nbytes) for a in arrays_of(caches).values())
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


def temp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: `.NAME.PID.THREAD.tmp.safetensors`
    (MLX's writer wants the suffix; disk_folder.remove_stale reads the pid)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident() % 10**6}.tmp{SUFFIX}")


def read_file(path: Path, want: dict) -> Tuple[list, dict]:
    """(caches, metadata) of a file, checked: format, identity and every array's CRC."""
    caches, md = load_prompt_cache(str(path), return_metadata=True)
    meta = json.loads(md["dflash"])
    for k, v in want.items():
        if meta.get(k) != v:
            raise ValueError(f"{k} {meta.get(k)!r}, expected {v!r}")
    arrays = arrays_of(caches)
    mx.eval(list(arrays.values()))
    crc = meta.get("crc") or {}
    if set(crc) != set(arrays) or any(zlib.crc32(memoryview(a)) != crc[k] for k, a in arrays.items()):
        raise ValueError("checksum mismatch")
    return caches, meta



# -- the drafter's context as mlx-lm caches --------------------------------------------------

def context_spec(c) -> dict:
    if isinstance(c, ContextCache):
        return {"window": c.window, "sink": c.sink, "offset": c.offset}
    return {"offset": c.offset}


def context_rows(c):
    """A drafter layer's context as a KVCache holding exactly its rows."""
    if c.keys is None:
        return KVCache()
    rows = c.rows if isinstance(c, ContextCache) else c.offset
    return KVCache.from_state((c.keys[..., :rows, :], c.values[..., :rows, :], rows))


def context_from(saved, spec: dict):
    """A drafter layer's cache back from its KVCache and spec."""
    if "window" in spec:
        c = ContextCache(spec["window"], spec["sink"])
        if saved.keys is not None:
            c.keys, c.values = saved.keys, saved.values
        c.offset = spec["offset"]
        return c
    return saved


def pending_cache(pending: mx.array):
    c = ArraysCache(1)
    c.cache = [pending]
    return c
