"""The prompts folder as a whole, across every model identity and format
version (disk.py keeps one identity's entries): what is in it (`cache list`,
`du`), emptying it (`cache clear`), the one disk budget (least recently used
entries first, then the blocks no entry names) and the temp files of writers
that died. Callers that change it hold its lock (LOCK)."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from filelock import FileLock

from .disk_format import SUFFIX, read_meta
from .identity import FORMAT

IDENTITY = "identity.json"  # what an identity folder is for, as written by its first writer
LOCK = ".lock"
LOCK_WAIT_S = 30.0  # another process holding the lock longer: give up this time
STALE_TMP_S = 3600.0  # a temp file this old was left by a writer that died


@dataclass
class File:
    path: Path
    version: str  # "v1": the format folder it is in
    identity: str  # the identity folder's name
    kind: str  # "entries" | "blocks"
    size: int
    mtime: float  # an entry's last use (the LRU clock)


def files(root: Path) -> Iterator[File]:
    """Every entry and block file under the prompts folder (temp files excluded)."""
    try:
        versions = [v for v in os.scandir(root) if v.is_dir()]
    except OSError:
        return
    for v in versions:
        for ns in (x for x in os.scandir(v.path) if x.is_dir()):
            for kind in ("entries", "blocks"):
                try:
                    items = list(os.scandir(os.path.join(ns.path, kind)))
                except OSError:
                    continue
                for de in items:
                    if de.name.startswith(".") or not de.name.endswith(SUFFIX):
                        continue
                    try:
                        st = de.stat()
                    except OSError:
                        continue
                    yield File(Path(de.path), v.name, ns.name, kind, st.st_size, st.st_mtime)


def folders(root: Path) -> List[dict]:
    """Every identity folder: its identity (as written), entries, blocks, bytes,
    last use and entry lengths, most recently used first."""
    rows = {}
    for f in files(root):
        d = f.path.parent.parent
        row = rows.get(d)
        if row is None:
            try:
                ident = json.loads((d / IDENTITY).read_text())
            except (OSError, ValueError):
                ident = {}
            row = rows[d] = {"folder": str(d), "format": f.version, "current": f.version == f"v{FORMAT}",
                             "identity": ident, "entries": 0, "blocks": 0, "bytes": 0, "last_used": 0.0,
                             "tokens": []}
        row[f.kind] += 1
        row["bytes"] += f.size
        if f.kind == "entries":
            row["last_used"] = max(row["last_used"], f.mtime)
            try:
                row["tokens"].append(len(read_meta(f.path)["tokens"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
    return sorted(rows.values(), key=lambda r: -r["last_used"])


def clear(root: Path, folder: Optional[str] = None) -> Tuple[int, int]:
    """Delete every cached prompt (or one identity folder's) under the lock.
    Returns (files, bytes) removed."""
    n = size = 0
    if not Path(root).is_dir():
        return 0, 0
    with FileLock(str(Path(root) / LOCK), timeout=LOCK_WAIT_S):
        for row in folders(root):
            if folder is None or row["folder"] == folder:
                n, size = n + row["entries"] + row["blocks"], size + row["bytes"]
                shutil.rmtree(row["folder"], ignore_errors=True)
    return n, size


def evict(root: Path, budget: int) -> None:
    """Under the lock: the least recently used entries go (another format's
    first) until the folder is under `budget` bytes; then the blocks no entry names."""
    all_files = list(files(root))
    entries = [f for f in all_files if f.kind == "entries" or f.version != f"v{FORMAT}"]
    blocks = [f for f in all_files if f.kind == "blocks" and f.version == f"v{FORMAT}"]
    total = sum(f.size for f in all_files)
    entries.sort(key=lambda f: (f.version == f"v{FORMAT}", f.mtime))
    while total > budget and entries:
        f = entries.pop(0)
        unlink(f.path)
        total -= f.size
    used = set()
    for f in entries:
        try:
            used.update((f.identity, h) for h in read_meta(f.path)["blocks"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for f in blocks:
        if (f.identity, f.path.name[: -len(SUFFIX)]) not in used:
            unlink(f.path)


def remove_stale(folder: Path) -> None:
    """Temp files of writers that died (killed mid-write) in one identity folder."""
    now = time.time()
    for kind in ("entries", "blocks"):
        try:
            items = list(os.scandir(folder / kind))
        except OSError:
            continue
        for de in items:
            if de.name.startswith(".") and ".tmp" in de.name and not _alive_writer(de, now):
                unlink(Path(de.path))


def _alive_writer(de, now: float) -> bool:
    """Whether a temp file (disk_format.temp_name) may still be being written:
    its process is alive and it is younger than STALE_TMP_S."""
    try:
        pid = int(de.name.split(".")[2])
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
    except OSError:  # another user's process: alive
        return True
    return True


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
