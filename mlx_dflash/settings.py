"""Per-model and global settings: one versioned, human-editable JSON file.

    {"version": 1,
     "global": {"model_dirs": [...], "default_model": ..., "host": ..., "port": ..., ...},
     "models": {"embedded/target": {"block_size": 4, "drafter.quant_bits": 4, ...}}}

Only keys a user set are stored, so defaults can improve later. The file lives
in the platformdirs user config dir (`MLX_DFLASH_HOME` overrides). Every write
is read-modify-write under a file lock (the chat UI and the server may both
write) and lands atomically (temp file, fsync, rename). Unknown keys are kept
and warned about. A file that cannot be read as settings (not UTF-8 JSON, too
deep, a number too long, the wrong shape) is moved aside to a named backup
(never overwritten) and the defaults apply, with one line naming both files:
whatever is in the file, the CLI keeps working.

This module knows nothing of model files: checks that need them (does the
drafter fit the target, is the default model installed) are passed in as a
`checker` (mlx_dflash.manager.settings_store() makes a store with them), so
the dependency runs one way, manager -> settings."""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

VERSION = 1
FILE_NAME = "settings.json"
QUANT_BITS = (None, 4, 8)
GROUP_SIZES = (32, 64, 128)
ACTIVATION_DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: $MLX_DFLASH_DTYPE, else the checkpoint's


class SettingsError(ValueError):
    """A bad setting, an unreadable settings file or an unknown model (one line)."""


class CorruptSettings(SettingsError):
    """The settings file exists but is not what this module writes, and could not be moved aside."""


def did_you_mean(word: str, choices, cutoff: float = 0.6) -> str:
    """" (did you mean 'port'?)" for a near miss, else ""."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f" (did you mean '{near[0]}'?)" if near else ""


def verify_modes() -> tuple:
    """Valid verify modes: the engine's, plus "adaptive" (settings may name it
    before the engine has it; `generation_kwargs` then maps it to "dflash")."""
    from .generate import VERIFY_MODES

    return tuple(VERIFY_MODES) + (() if "adaptive" in VERIFY_MODES else ("adaptive",))


def home() -> Path:
    """The folder that holds settings.json."""
    env = os.environ.get("MLX_DFLASH_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir("mlx-dflash", appauthor=False))


@dataclass
class ModelSettings:
    dflash_enabled: bool = True
    drafter: Optional[str] = None  # path or model id; None: the best compatible one found
    block_size: int = 5
    verify_mode: str = "dflash"
    drafter_quant_bits: Optional[int] = None  # None | 4 | 8
    drafter_quant_group_size: int = 64
    drafter_activation_dtype: str = "auto"  # auto = the target's dtype
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    system_prompt: str = ""
    max_context: int = 4096
    dtype: str = "auto"  # the target's compute dtype (float32 is several times faster on a CPU)

    def generation_kwargs(self) -> dict:
        """Keyword arguments for `stream_generate`."""
        from .generate import VERIFY_MODES

        mode = self.verify_mode if self.dflash_enabled else "off"
        if mode not in VERIFY_MODES:  # "adaptive" before the engine has it
            mode = "dflash"
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, block_size=self.block_size,
                    verify_mode=mode, max_context=self.max_context)


@dataclass
class GlobalSettings:
    model_dirs: list = field(default_factory=list)
    default_model: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    cors_origins: list = field(default_factory=list)
    prompt_cache_mb: int = 2048  # server: memory for cached prompt prefixes across requests (0: none)


# user-facing key (file, CLI) -> dataclass field
MODEL_KEYS = {
    "dflash.enabled": "dflash_enabled",
    "drafter": "drafter",
    "block_size": "block_size",
    "verify_mode": "verify_mode",
    "drafter.quant_bits": "drafter_quant_bits",
    "drafter.quant_group_size": "drafter_quant_group_size",
    "drafter.activation_dtype": "drafter_activation_dtype",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "max_tokens",
    "system_prompt": "system_prompt",
    "max_context": "max_context",
    "dtype": "dtype",
}
GLOBAL_KEYS = {f.name: f.name for f in fields(GlobalSettings)}
_FIELD_TO_KEY = {v: k for k, v in MODEL_KEYS.items()}
_TYPES = {  # field -> (type, optional)
    "dflash_enabled": (bool, False), "drafter": (str, True), "block_size": (int, False),
    "verify_mode": (str, False), "drafter_quant_bits": (int, True), "drafter_quant_group_size": (int, False),
    "drafter_activation_dtype": (str, False), "temperature": (float, False), "top_p": (float, False),
    "top_k": (int, False), "min_p": (float, False), "max_tokens": (int, False), "system_prompt": (str, False),
    "max_context": (int, False), "dtype": (str, False),
    "model_dirs": (list, False), "default_model": (str, True), "host": (str, False), "port": (int, False),
    "api_key": (str, True), "cors_origins": (list, False), "prompt_cache_mb": (int, False),
}


def model_field(key: str) -> str:
    """A model key as the user writes it ("dflash.enabled") or a field name -> the field."""
    if key in MODEL_KEYS:
        return MODEL_KEYS[key]
    if key in _FIELD_TO_KEY:
        return key
    raise SettingsError(f"unknown model setting '{key}'{did_you_mean(key, MODEL_KEYS)}; "
                        f"valid: {', '.join(MODEL_KEYS)}")


def global_field(key: str) -> str:
    if key in GLOBAL_KEYS:
        return key
    raise SettingsError(f"unknown global setting '{key}'{did_you_mean(key, GLOBAL_KEYS)}; "
                        f"valid: {', '.join(GLOBAL_KEYS)}")


def parse_value(name: str, text: str):
    """A value typed on the command line -> the field's type ("none" clears an optional)."""
    typ, optional = _TYPES[name]
    t = text.strip()
    if optional and t.lower() in ("none", "null", ""):
        return None
    try:
        if typ is bool:
            v = {"true": True, "on": True, "yes": True, "1": True,
                 "false": False, "off": False, "no": False, "0": False}[t.lower()]
            return v
        if typ is int:
            return int(t)
        if typ is float:
            v = float(t)
            if not math.isfinite(v):
                raise ValueError
            return v
        if typ is list:
            return [s.strip() for s in t.split(",") if s.strip()]
    except (KeyError, ValueError):
        want = {bool: "true or false", int: "an integer", float: "a finite number"}[typ]
        raise SettingsError(f"{_FIELD_TO_KEY.get(name, name)} must be {want}, got '{text}'") from None
    return text


def _check_type(name: str, v):
    """Coerce JSON/Python values to the field's type; one-line error if impossible."""
    typ, optional = _TYPES[name]
    key = _FIELD_TO_KEY.get(name, name)
    if v is None:
        if optional:
            return None
        raise SettingsError(f"{key} cannot be empty")
    if typ is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)  # an int too large for a float overflows
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise SettingsError(f"{key} must be a finite number, got {str(v)[:20]}")
        return f
    if typ is list and isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    if typ is list and isinstance(v, str):
        return parse_value(name, v)
    if typ is not list and isinstance(v, typ) and not (typ is int and isinstance(v, bool)):
        return v
    if isinstance(v, str) and typ is not str:
        return parse_value(name, v)
    raise SettingsError(f"{key} must be {typ.__name__}{' or none' if optional else ''}, got {v!r}")


def check_model(s: ModelSettings) -> None:
    """Checks that need no model files (see `SettingsStore.set_model` for those that do)."""
    modes = verify_modes()
    if s.verify_mode not in modes:
        raise SettingsError(f"unknown verify mode '{s.verify_mode}'; valid: {', '.join(modes)}")
    if s.block_size < 1:
        raise SettingsError(f"block_size must be >= 1, got {s.block_size}")
    if s.drafter_quant_bits not in QUANT_BITS:
        raise SettingsError(f"drafter.quant_bits must be none, 4 or 8, got {s.drafter_quant_bits}")
    if s.drafter_quant_group_size not in GROUP_SIZES:
        raise SettingsError(f"drafter.quant_group_size must be 32, 64 or 128, got {s.drafter_quant_group_size}")
    if s.drafter_activation_dtype not in ACTIVATION_DTYPES:
        raise SettingsError(f"unknown drafter.activation_dtype '{s.drafter_activation_dtype}'; "
                            f"valid: {', '.join(ACTIVATION_DTYPES)}")
    for name in ("temperature", "top_p", "min_p"):  # NaN passes every comparison below
        if not math.isfinite(getattr(s, name)):
            raise SettingsError(f"{name} must be a finite number, got {getattr(s, name)}")
    if s.dtype not in COMPUTE_DTYPES:
        raise SettingsError(f"unknown dtype '{s.dtype}'; valid: {', '.join(COMPUTE_DTYPES)}")
    from .sampling import SamplingParams  # here: reading settings should not need mlx

    try:  # the engine's own checks, so settings never hold values generation refuses
        SamplingParams(s.temperature, s.top_p, s.top_k, s.min_p)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if s.max_tokens < 1:
        raise SettingsError(f"max_tokens must be >= 1, got {s.max_tokens}")
    if s.max_context < 1:
        raise SettingsError(f"max_context must be >= 1, got {s.max_context}")


def check_global(g: GlobalSettings) -> None:
    """Checks that need no model files (see `SettingsStore.set_global` for those that do)."""
    if not 0 < g.port < 65536:
        raise SettingsError(f"port must be in 1..65535, got {g.port}")
    if not g.host:
        raise SettingsError("host cannot be empty")
    if g.prompt_cache_mb < 0:
        raise SettingsError(f"prompt_cache_mb must be >= 0 (0 turns the prompt cache off), got {g.prompt_cache_mb}")


def _warn(msg: str) -> None:
    print(f"mlx-dflash: {msg}", file=sys.stderr)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that a crash at any point leaves either the old
    file or the new one, never a torn mix: temp file in the same folder, fsync,
    rename over."""
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

    def _move_aside(self, why: str) -> None:
        """Move the unreadable file to a named backup (under the lock, unless held)."""
        def move():
            if not self.path.is_dir():
                try:
                    data = self.path.read_bytes()
                except FileNotFoundError:
                    return  # another process moved it already
                if self._problem(data)[1] is None:
                    return  # another process fixed it already
            backup = self._backup_path()
            try:
                os.replace(self.path, backup)
            except OSError as e:
                raise CorruptSettings(f"settings file {self.path} is unreadable ({why}) and cannot be moved "
                                      f"aside ({e.strerror}); move or delete it by hand") from None
            _warn(f"settings file {self.path} was unreadable ({why}); moved it to {backup} and restored "
                  "the defaults")

        if self._locked:
            move()
        else:
            with self._lock():
                move()

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

    def _read_raw(self) -> dict:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {"version": VERSION, "global": {}, "models": {}}
        except IsADirectoryError:
            self._move_aside("a folder, not a file")
            return self._read_raw()
        except OSError as e:
            raise SettingsError(f"cannot read settings file {self.path}: {e.strerror}") from None
        raw, why = self._problem(data)
        if why is not None:
            self._move_aside(why)
            return self._read_raw()
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
        """Read-modify-write under the lock (an unreadable file is moved aside first)."""
        with self._lock():
            raw = self._read_raw()
            if raw.get("version", VERSION) > VERSION:
                raise SettingsError(f"settings file {self.path} has version {raw['version']}, newer than "
                                    f"this mlx-dflash writes ({VERSION}); upgrade mlx-dflash")
            raw["version"] = VERSION
            fn(raw)  # may raise (validation): nothing is written then
            atomic_write(self.path, json.dumps(raw, indent=2) + "\n")
            return raw

    # -- models ----------------------------------------------------------------------
    def _model_from(self, raw: dict, model_id: str) -> ModelSettings:
        s = ModelSettings()
        entry = raw["models"].get(model_id) or {}
        if not isinstance(entry, dict):
            self._warn_once(f"m:{model_id}", f"settings for '{model_id}' in {self.path} are not an object; using defaults")
            return s
        for k, v in entry.items():
            name = MODEL_KEYS.get(k)
            if name is None:
                self._warn_once(f"m:{model_id}:{k}", f"unknown setting '{k}' for '{model_id}' in {self.path} (kept, ignored)")
                continue
            try:
                setattr(s, name, _check_type(name, v))
            except SettingsError as e:
                self._warn_once(f"m:{model_id}:{k}", f"{self.path}: '{model_id}': {e}; using the default")
        try:
            check_model(s)
        except SettingsError as e:
            self._warn_once(f"m:{model_id}:check", f"{self.path}: '{model_id}': {e}; using defaults for this model")
            return ModelSettings()
        return s

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
            ch[name] = _check_type(name, v)

        def apply(raw):  # validated against the file as it is under the lock
            e = raw["models"].get(model_id)
            if not isinstance(e, dict):
                e = {}
            new = ModelSettings(**{**asdict(self._model_from(raw, model_id)), **ch})
            check_model(new)
            if self.checker is not None and {"drafter", "block_size", "dflash_enabled"} & set(ch):
                self.checker.model(self, model_id, new, "block_size" in ch or "block_size" in e)
            for name, v in ch.items():
                e[_FIELD_TO_KEY[name]] = v
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
                e.pop(_FIELD_TO_KEY[name], None)
                if not e:
                    raw["models"].pop(model_id, None)

        return self._model_from(self._update(apply), model_id)

    # -- global ----------------------------------------------------------------------
    def _globals_from(self, raw: dict) -> GlobalSettings:
        g = GlobalSettings()
        for k, v in raw["global"].items():
            if k not in GLOBAL_KEYS:
                self._warn_once(f"g:{k}", f"unknown global setting '{k}' in {self.path} (kept, ignored)")
                continue
            try:
                setattr(g, k, _check_type(k, v))
            except SettingsError as e:
                self._warn_once(f"g:{k}", f"{self.path}: {e}; using the default")
        try:
            check_global(g)
        except SettingsError as e:
            self._warn_once("g:check", f"{self.path}: {e}; using the default global settings")
            return GlobalSettings()
        return g

    def globals(self) -> GlobalSettings:
        return self._globals_from(self._read_raw())

    def set_global(self, **changes) -> GlobalSettings:
        ch = {global_field(k): _check_type(k, v) for k, v in changes.items()}

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
