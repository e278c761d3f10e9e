"""The model catalog the worker loads from, the jobs that carry a request's
events back to its HTTP handler, and the per-model counters (/metrics)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from mlx_dflash.cache.memory import default_limit
from mlx_dflash.models.discovery import discover
from mlx_dflash.models.model_names import find
from mlx_dflash.models.settings_checks import check_settings
from mlx_dflash.settings.schema import GlobalSettings

# -- models ---------------------------------------------------------------------------------

class ManagerCatalog:
    """The models the model manager knows (mlx_dflash.models.manager); ids are its ids."""

    def __init__(self, store=None):
        from mlx_dflash.settings.store import SettingsStore

        self.store = store or SettingsStore()

    def targets(self) -> List[dict]:
        from mlx_dflash.models.discovery import list_targets

        return [{"id": e.id, "owned_by": e.source, "drafters": list(e.compatible_drafters)}
                for e in list_targets(self.store)]

    def default(self) -> str:
        from mlx_dflash.models.model_names import resolve

        return resolve(None, self.store).id

    def find(self, name: str, served: Optional[str] = None) -> Optional[str]:
        """The id of the target `name` refers to, by the resolution every command
        uses (model_names.find: exact id, any case, ORG/NAME for NAME, a model's folder);
        None for a name no model here has. A folder path is taken only when it is a
        listed model's folder or the served one: a client must not make the server
        read folders of its choosing. A drafter or other non-target: ValueError."""
        entries = discover(self.store)
        if name.startswith((".", "/", "~", "\\")) or Path(name).expanduser().exists():  # a path (as find sees it)
            want = Path(name).expanduser().resolve()
            if served is not None and Path(served).expanduser().resolve() == want:
                return served
            hits = [e for e in entries if Path(e.path).resolve() == want]
            e = hits[0] if hits else None
        else:
            e = find(name, entries, self.store)
        if e is None:
            return None
        if e.kind != "target":
            raise ValueError(f"'{e.id}' is a {e.kind_label}, not a model to chat with; "
                             "GET /v1/models lists the models")
        return e.id

    def settings(self, model_id: str):
        return self.store.model(model_id)

    def check(self, model_id: str, settings) -> None:
        """The checks `settings set` and load_model make against the model files (the
        drafter exists and fits), without loading anything: SettingsError if not."""
        check_settings(model_id, settings, self.store, explicit_block=False)

    def load(self, model_id: str):
        from mlx_dflash.models.manager import load_model

        return load_model(model_id, self.store)

    def prompt_cache_bytes(self) -> int:
        try:
            return self.store.globals().prompt_cache_mb << 20
        except (ValueError, AttributeError):  # unreadable settings: the default budget
            from mlx_dflash.settings.schema import GlobalSettings

            return GlobalSettings().prompt_cache_mb << 20

    def globals(self):
        """The global settings (the defaults if the file cannot be read now)."""
        try:
            return self.store.globals()
        except (ValueError, AttributeError):
            return GlobalSettings()


def context_limit(model) -> Optional[int]:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


# -- jobs and counters --------------------------------------------------------------------

@dataclass
class Job:
    kind: str  # "chat" | "completion"
    model_id: str
    req: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
    checked: float = 0.0  # when the handler last asked whether the client is still there
    prepared: Any = None  # (prompt ids, forced prefix) once tokenized off the worker thread

    def send(self, *ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    fallbacks: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    cycles: int = 0
    cycle_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_time: float = 0.0
    generation_time: float = 0.0

    def add(self, s) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.reused_prompt_tokens += s.reused_tokens
        self.completion_tokens += s.generation_tokens
        self.cycles += s.cycles
        self.cycle_tokens += s.cycle_tokens
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.prompt_time += s.prompt_time
        self.generation_time += s.generation_time
        self.fallbacks += s.fallback is not None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(tau=self.cycle_tokens / self.cycles if self.cycles else 0.0,
                 acceptance=self.accepted / self.drafted if self.drafted else 0.0,
                 tokens_per_second=self.completion_tokens / self.generation_time if self.generation_time else 0.0,
                 prompt_tokens_per_second=(self.prompt_tokens - self.reused_prompt_tokens) / self.prompt_time
                 if self.prompt_time else 0.0)
        return d


def disk_budget(catalog) -> int:
    """The prompt store's disk budget in bytes (a catalog without settings: none)."""
    g = getattr(catalog, "globals", None)
    return g().prompt_store_bytes()[1] if g is not None else 0


def memory_limit(catalog) -> Optional[int]:
    """The server's memory budget in bytes (memory_budget_gb, or a share of the
    machine); None for a catalog without settings (no budget)."""
    g = getattr(catalog, "globals", None)
    return default_limit(g().memory_budget_gb) if g is not None else None


def store_budget(catalog) -> int:
    """The prompt store's memory budget in bytes (a catalog may not say: the default)."""
    f = getattr(catalog, "prompt_cache_bytes", None)
    if f is not None:
        return int(f())
    from mlx_dflash.settings.schema import GlobalSettings

    return GlobalSettings().prompt_cache_mb << 20
