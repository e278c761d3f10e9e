"""Per-model and global settings: one versioned, human-editable JSON file.

    {"version": 1,
     "global": {"model_dirs": [...], "default_model": ..., "host": ..., "port": ..., ...},
     "models": {"embedded/target": {"block_size": 4, "drafter.quant_bits": 4, ...}}}

Only keys a user set are stored, so defaults can improve later. The file lives
in the platformdirs user config dir (`MLX_DFLASH_HOME` overrides). Every write
is read-modify-write under a file lock (the chat UI and the server may both
write) and lands atomically (temp file, fsync, rename). Unknown keys are kept
and warned about.

Users edit the file in place too, and an editor's save is not atomic: a reader
may see it half-written. So a file that does not parse is read again once it
has settled (size and mtime unchanged for SETTLE seconds) before it is called
unreadable, and it is never moved away (the rest of the user's write would go
into the backup): it is copied to a named backup (never overwritten; one per content,
across commands: a later command finds the copy and names it), and the
last good settings this store read stay in use (the defaults when it read none),
with one line naming both files; the next write replaces it. Reads are cached by
the file's (mtime, size, inode), so a long-running server re-reads the file only
when it changed. Whatever is in the file, the CLI keeps working.

The keys, their types and the value checks are in settings_schema.py (its names
are importable from here too). This module knows nothing of model files: checks that need them (does the
drafter fit the target, is the default model installed) are passed in as a
`checker` (mlx_dflash.models.settings_checks.settings_store() makes a store with them), so
the dependency runs one way, manager -> settings."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from ..platform.paths import config_dir
from .schema import (
    FIELD_TO_KEY,
    GLOBAL_KEYS,
    MODEL_KEYS,
    GlobalSettings,
    ModelSettings,
    SettingsError,
    check_global,
    check_model,
    check_type,
    global_field,
    model_field,
)

VERSION = 1
FILE_NAME = "settings.json"
SETTLE = 0.5  # seconds a file that does not parse must stay unchanged before it is called unreadable
SETTLE_MAX = 5.0  # a file still changing after this long is judged as it is
FRESH = 1.0  # a file changed this recently is read again next time (mtime granularity, same-size edits)
STALE_TEMP = 60.0  # seconds: an older temp file of ours is left over from a killed writer


class CorruptSettings(SettingsError):
    """The settings file exists but is not what this module writes, and could not be copied or moved aside."""


def home() -> Path:
    """The folder that holds settings.json."""
    return config_dir()


def _warn(msg: str) -> None:
    print(f"mlx-dflash: {msg}", file=sys.stderr)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that a crash at any point leaves either the old
    file or the new one, never a torn mix: temp file in the same folder, fsync,
    rename over. A writer killed before the rename leaves `.NAME.XXXX.tmp`
    (TEMP_NAME); remove_stale_temps() removes those later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable (POSIX; not possible on every platform)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


TEMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]{6,12}\.tmp$")  # tempfile.mkstemp's names as atomic_write asks


def remove_stale_temps(folder: Path, pattern: re.Pattern = TEMP_NAME, age: float = STALE_TEMP) -> int:
    """Remove the temp files a killed writer of ours left in `folder`: names that
    match `pattern`, plain files, untouched for `age` seconds (a live writer
    renames its file within milliseconds). Returns how many were removed."""
    n, now = 0, time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not pattern.match(name):
            continue
        p = os.path.join(folder, name)
        try:
            st = os.lstat(p)
            if os.path.isfile(p) and not os.path.islink(p) and now - st.st_mtime > age:
                os.unlink(p)
                n += 1
        except OSError:  # gone already, or not ours to remove
            pass
    return n


def _stat_key(st) -> tuple:
    return st.st_mtime_ns, st.st_size, st.st_ino


class SettingsStore:
    """The settings file. Reads are lock-free (writes are atomic renames);
    every write re-reads the file under the lock, so concurrent writers of
    different keys lose nothing."""

    def __init__(self, path=None, lock_timeout: float = 10.0, checker=None):
        """`checker`: checks that need model files, an object with
        `model(store, model_id, new: ModelSettings, explicit_block: bool)` and
        `globals(store, new: GlobalSettings, changed: set)`, raising SettingsError."""
        self.path = Path(path).expanduser() if path is not None else home() / FILE_NAME
        self.lock_timeout = lock_timeout
        self.checker = checker
        self._warned = set()
        self._locked = False  # this store holds the file lock (inside _update)
        self._cache = None  # (stat key, raw or None, why) of the last read, while the file is unchanged
        self._good = None  # the last raw settings that parsed: in use while the file is unreadable
        self._backed_up = set()  # digests of unreadable contents already copied to a backup
        remove_stale_temps(self.path.parent)

    # -- file ------------------------------------------------------------------------
    def _problem(self, data: bytes):
        """(raw dict, None) for a good settings file, else (None, why it is not one)."""
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            enc = "UTF-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "binary or another encoding"
            return None, f"not UTF-8 text ({enc})"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"invalid JSON at line {e.lineno}"
        except RecursionError:
            return None, "nested too deeply"
        except ValueError as e:  # an integer with thousands of digits
            return None, f"unreadable JSON ({str(e).split(':')[0][:60]})"
        if not isinstance(raw, dict) or not isinstance(raw.get("global", {}), dict) \
                or not isinstance(raw.get("models", {}), dict):
            return None, "expected an object with 'global' and 'models'"
        v = raw.get("version", VERSION)
        if not isinstance(v, int) or isinstance(v, bool):
            return None, f"version {str(v)[:20]!r} is not a number"
        return raw, None

    def _backup_path(self) -> Path:
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
        backup = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        while backup.exists():  # never overwrite an earlier backup
            n += 1
            backup = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        return backup

    def _kept_copy(self, data: bytes) -> Optional[Path]:
        """An earlier backup of this file with exactly `data` in it, if any."""
        try:
            names = os.listdir(self.path.parent)
        except OSError:
            return None
        for name in sorted(names):
            if not name.startswith(f"{self.path.name}.corrupt-"):
                continue
            p = self.path.parent / name
            try:
                if p.stat().st_size == len(data) and p.read_bytes() == data:
                    return p
            except OSError:
                continue
        return None

    def _back_up(self, why: str, data: bytes, keep: bool) -> None:
        """Copy the unreadable file (its bytes as read: `data`) to a named backup, once
        per content, and say so in one line. The file itself stays: an editor may
        still be writing it, and the next good write replaces it."""
        key = hashlib.sha256(data).digest()
        if key in self._backed_up:
            return
        self._backed_up.add(key)
        using = "still using the settings read before" if keep else "using the defaults"
        kept = self._kept_copy(data)
        if kept is not None:  # copied by an earlier command: one copy per content, not one per command
            _warn(f"settings file {self.path} is unreadable ({why}); a copy is in {kept}; {using} until it is fixed")
            return
        backup = self._backup_path()
        try:
            with open(backup, "xb") as f:
                f.write(data)
        except OSError as e:
            raise CorruptSettings(f"settings file {self.path} is unreadable ({why}) and cannot be copied "
                                  f"aside ({e.strerror}); move or delete it by hand") from None
        _warn(f"settings file {self.path} is unreadable ({why}); copied it to {backup}; {using} "
              "until it is fixed")

    def _move_folder(self) -> None:
        """A folder where the file should be: no editor writes that; move it aside."""
        def move():
            if not self.path.is_dir():
                return  # another process moved it already
            backup = self._backup_path()
            try:
                os.replace(self.path, backup)
            except OSError as e:
                raise CorruptSettings(f"settings file {self.path} is a folder and cannot be moved "
                                      f"aside ({e.strerror}); move or delete it by hand") from None
            _warn(f"settings file {self.path} was a folder, not a file; moved it to {backup} and restored "
                  "the defaults")

        if self._locked:
            move()
        else:
            with self._lock():
                move()

    def _settled(self, data: bytes, st):
        """(data, stat, raw, why) once the file parses or has stopped changing for SETTLE s."""
        raw, why = self._problem(data)
        deadline = time.monotonic() + SETTLE_MAX
        stable_since = time.monotonic()
        while why is not None and time.monotonic() < deadline:
            time.sleep(SETTLE / 5)
            try:
                st2 = os.stat(self.path)
            except OSError:  # replaced or removed meanwhile: read it as it is now
                return None
            if _stat_key(st2) == _stat_key(st):
                if time.monotonic() - stable_since >= SETTLE:
                    break
                continue
            try:
                data = self.path.read_bytes()
            except OSError:
                return None
            st, stable_since = st2, time.monotonic()
            raw, why = self._problem(data)
        return data, st, raw, why

    def _lock(self):
        from filelock import FileLock, Timeout

        lock = FileLock(str(self.path) + ".lock", timeout=self.lock_timeout)

        class Held:
            def __enter__(_):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    lock.acquire()
                except Timeout:
                    raise SettingsError(f"settings file {self.path} is locked by another process "
                                        f"({self.path}.lock); try again") from None
                self._locked = True

            def __exit__(_, *exc):
                self._locked = False
                lock.release()

        return Held()

    def _read_raw(self, fresh: bool = False) -> dict:
        """The file's settings as a dict the caller may change. Cached while the
        file's stat is unchanged (unless `fresh`); an unreadable file gives the last
        good settings this store read, else the defaults (see the module doc)."""
        for _ in range(10):  # a file replaced while it settled is read again
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self._cache = None
                return self._checked({"version": VERSION, "global": {}, "models": {}})
            except OSError as e:
                raise SettingsError(f"cannot read settings file {self.path}: {e.strerror}") from None
            if os.path.isdir(self.path):
                self._move_folder()
                continue
            key = _stat_key(st)
            c = self._cache
            if not fresh and c is not None and c[0] == key:
                raw, why = c[1], c[2]
                break
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise SettingsError(f"cannot read settings file {self.path}: {e.strerror}") from None
            got = self._settled(data, st)
            if got is None:
                continue
            data, st, raw, why = got
            key = _stat_key(st)
            self._cache = (key, raw, why) if time.time() - st.st_mtime > FRESH else None
            if why is not None:
                self._back_up(why, data, self._good is not None)
            break
        else:
            raise SettingsError(f"settings file {self.path} keeps changing; try again")
        if why is not None:
            return copy.deepcopy(self._good) if self._good is not None else \
                {"version": VERSION, "global": {}, "models": {}}
        self._good = raw
        return self._checked(copy.deepcopy(raw))

    def _checked(self, raw: dict) -> dict:
        v = raw.get("version", VERSION)
        if v != VERSION:
            self._warn_once(f"version:{v}", f"settings file {self.path} has version {v}; this mlx-dflash "
                                            f"reads version {VERSION}, unknown keys are ignored")
        raw.setdefault("global", {})
        raw.setdefault("models", {})
        for k in raw:
            if k not in ("version", "global", "models"):
                self._warn_once(k, f"unknown top-level key '{k}' in {self.path} (kept, ignored)")
        return raw

    def _warn_once(self, key, msg):
        if key not in self._warned:
            self._warned.add(key)
            _warn(msg)

    def _update(self, fn) -> dict:
        """Read-modify-write under the lock. An unreadable file is copied to a backup
        first and replaced; the change applies to the last good settings read."""
        with self._lock():
            raw = self._read_raw(fresh=True)
            if raw.get("version", VERSION) > VERSION:
                raise SettingsError(f"settings file {self.path} has version {raw['version']}, newer than "
                                    f"this mlx-dflash writes ({VERSION}); upgrade mlx-dflash")
            raw["version"] = VERSION
            fn(raw)  # may raise (validation): nothing is written then
            try:
                atomic_write(self.path, json.dumps(raw, indent=2) + "\n")
            except OSError as e:  # a full disk, a read-only folder: one line, the old file intact
                raise SettingsError(f"cannot save {self.path}: {e.strerror or e}; nothing was changed "
                                    "(free some space or make the folder writable)") from None
            return raw

    # -- models ----------------------------------------------------------------------
    def _from_keys(self, cls, entry: dict, field_of, check, wkey: str, unknown, where: str, fallback: str):
        """A `cls` from one part of the file (user keys). An unknown key or a bad value
        is warned about once and left at its default; values that fail `check`
        together give all defaults. The warnings name the part: `unknown(key)`,
        `where`, `fallback`."""
        s = cls()
        for k, v in entry.items():
            name = field_of(k)
            if name is None:
                self._warn_once(f"{wkey}:{k}", f"unknown {unknown(k)} in {self.path} (kept, ignored)")
                continue
            try:
                setattr(s, name, check_type(name, v))
            except SettingsError as e:
                self._warn_once(f"{wkey}:{k}", f"{self.path}: {where}{e}; using the default")
        try:
            check(s)
        except SettingsError as e:
            self._warn_once(f"{wkey}:check", f"{self.path}: {where}{e}; using {fallback}")
            return cls()
        return s

    def _model_from(self, raw: dict, model_id: str) -> ModelSettings:
        entry = raw["models"].get(model_id) or {}
        if not isinstance(entry, dict):
            self._warn_once(f"m:{model_id}", f"settings for '{model_id}' in {self.path} are not an object; using defaults")
            return ModelSettings()
        return self._from_keys(ModelSettings, entry, MODEL_KEYS.get, check_model, f"m:{model_id}",
                               lambda k: f"setting '{k}' for '{model_id}'", f"'{model_id}': ", "defaults for this model")

    def model(self, model_id: str) -> ModelSettings:
        """The settings of `model_id` (defaults for anything unset)."""
        return self._model_from(self._read_raw(), model_id)

    def explicit(self, model_id: str) -> dict:
        """The keys the user set for `model_id` (user-facing names)."""
        e = self._read_raw()["models"].get(model_id)
        return dict(e) if isinstance(e, dict) else {}

    def models(self) -> dict:
        """{model_id: ModelSettings} for every model with settings."""
        raw = self._read_raw()
        return {m: self._model_from(raw, m) for m in raw["models"]}

    def set_model(self, model_id: str, **changes) -> ModelSettings:
        """Validate and store `changes` (field names or user keys as **{"dflash.enabled": ...}).
        Changes of drafter or block size are checked against the model files when
        they can be found (the drafter's trained block size, config compatibility)."""
        if not model_id:
            raise SettingsError("no model id given")
        ch = {}
        for k, v in changes.items():
            name = model_field(k)
            ch[name] = check_type(name, v)

        def apply(raw):  # validated against the file as it is under the lock
            e = raw["models"].get(model_id)
            if not isinstance(e, dict):
                e = {}
            new = ModelSettings(**{**asdict(self._model_from(raw, model_id)), **ch})
            check_model(new)
            if self.checker is not None and {"drafter", "block_size", "dflash_enabled"} & set(ch):
                self.checker.model(self, model_id, new, "block_size" in ch or "block_size" in e)
            for name, v in ch.items():
                e[FIELD_TO_KEY[name]] = v
            raw["models"][model_id] = e

        return self._model_from(self._update(apply), model_id)

    def reset_model(self, model_id: str, key: Optional[str] = None) -> ModelSettings:
        """Forget one key (or all settings) of `model_id`."""
        name = model_field(key) if key else None

        def apply(raw):
            e = raw["models"].get(model_id)
            if name is None or not isinstance(e, dict):
                raw["models"].pop(model_id, None)
            else:
                e.pop(FIELD_TO_KEY[name], None)
                if not e:
                    raw["models"].pop(model_id, None)

        return self._model_from(self._update(apply), model_id)

    # -- global ----------------------------------------------------------------------
    def _globals_from(self, raw: dict) -> GlobalSettings:
        return self._from_keys(GlobalSettings, raw["global"], lambda k: k if k in GLOBAL_KEYS else None, check_global,
                               "g", lambda k: f"global setting '{k}'", "", "the default global settings")

    def globals(self) -> GlobalSettings:
        return self._globals_from(self._read_raw())

    def set_global(self, **changes) -> GlobalSettings:
        ch = {global_field(k): check_type(k, v) for k, v in changes.items()}

        def apply(raw):
            new = GlobalSettings(**{**asdict(self._globals_from(raw)), **ch})
            check_global(new)
            if self.checker is not None:
                self.checker.globals(self, new, set(ch))
            raw["global"].update(ch)

        return self._globals_from(self._update(apply))

    def reset_global(self, key: Optional[str] = None) -> GlobalSettings:
        name = global_field(key) if key else None

        def apply(raw):
            if name is None:
                raw["global"] = {}
            else:
                raw["global"].pop(name, None)

        return self._globals_from(self._update(apply))

    def reset_all(self) -> None:
        """Start from defaults."""
        def apply(raw):
            raw.clear()
            raw.update(version=VERSION, **{"global": {}, "models": {}})

        self._update(apply)
