"""The model catalog the worker loads from, the jobs that carry a request's
events back to its HTTP handler, and the per-model counters (/metrics)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from mlx_dflash.cache.memory import default_limit
from mlx_dflash.cache.prompt_store import open_store
from mlx_dflash.models.discovery import discover
from mlx_dflash.models.model_names import find_listed, same_path
from mlx_dflash.models.settings_checks import check_settings
from mlx_dflash.settings.schema import GlobalSettings

from .engines import LocalEngine

# -- models ---------------------------------------------------------------------------------

class Catalog:
    """What the worker asks of the models it serves: the declared interface.
    `targets`, `default`, `settings` and `load` are each catalog's own; the rest
    have defaults here: names are the exact ids listed, every setting passes,
    the default prompt-store budget, and the model runs in this process
    (engines.LocalEngine)."""

    def targets(self) -> List[dict]:
        """[{"id", "owned_by", "drafters"}] of the models it serves."""
        raise NotImplementedError

    def default(self) -> str:
        raise NotImplementedError

    def settings(self, model_id: str):
        """The model's ModelSettings (read per request: edits apply at once)."""
        raise NotImplementedError

    def load(self, model_id: str):
        """The LoadedModel (mlx_dflash.models.manager); on the worker's thread."""
        raise NotImplementedError

    def find(self, name: str, served: Optional[str] = None) -> Optional[str]:
        """The id of the target a request's `name` refers to (None: none here)."""
        return name if any(m["id"] == name for m in self.targets()) else None

    def check(self, model_id: str, settings) -> None:
        """SettingsError if these settings cannot be loaded (checked without loading)."""

    def explicit_max_tokens(self, model_id: str) -> Optional[int]:
        """The max_tokens a user set for the model (None: not set). A catalog of
        fixed settings cannot tell: their value counts as set."""
        return self.settings(model_id).max_tokens

    def globals(self) -> Optional[GlobalSettings]:
        """The global settings (None: a catalog without them: the default prompt
        store in memory, none on disk, no memory budget)."""
        return None

    def prompt_cache_bytes(self) -> int:
        g = self.globals()
        return (g or GlobalSettings()).prompt_store_bytes()[0]

    def disk_cache_bytes(self) -> int:
        g = self.globals()
        return g.prompt_store_bytes()[1] if g is not None else 0

    def memory_limit(self) -> Optional[int]:
        """The server's memory budget in bytes (memory_budget_gb, or a share of the machine)."""
        g = self.globals()
        return default_limit(g.memory_budget_gb) if g is not None else None

    def engine(self, lm, max_batch: int, prefill_together: bool):
        """The engine that decodes `lm`'s requests (engines.py), over its prompt
        store: memory, over the disk tier."""
        store = open_store(self.prompt_cache_bytes(), self.disk_cache_bytes(), lm.model, lm.tokenizer,
                           lm.drafter, lm.id)
        return LocalEngine(lm, max_batch, store, prefill_together)


class ManagerCatalog(Catalog):
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
        """The id of the target `name` refers to: one of the names the server lists
        (model_names.find_listed: exact id, any case, ORG/NAME for NAME) or the folder
        it serves; None for any other name. A client's name never reaches the
        filesystem: no stat of paths of its choosing, whatever their length. A
        drafter or other non-target: ValueError."""
        if served is not None and name.startswith((".", "/", "~", "\\")) and same_path(name, served):
            return served
        e = find_listed(name, discover(self.store))
        if e is None:
            return None
        if e.kind != "target":
            raise ValueError(f"'{e.id}' is a {e.kind_label}, not a model to chat with; "
                             "GET /v1/models lists the models")
        return e.id

    def settings(self, model_id: str):
        return self.store.model(model_id)

    def explicit_max_tokens(self, model_id: str) -> Optional[int]:
        """The max_tokens a user set for `model_id` (None: not set; a request without
        one then gets the room left in the context, prompt_ids.max_new_tokens)."""
        try:
            v = self.store.explicit(model_id).get("max_tokens")
        except ValueError:  # an unreadable settings file: as unset
            return None
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    def check(self, model_id: str, settings) -> None:
        """The checks `settings set` and load_model make against the model files (the
        drafter exists and fits), without loading anything: SettingsError if not."""
        check_settings(model_id, settings, self.store, explicit_block=False)

    def load(self, model_id: str):
        from mlx_dflash.models.manager import load_model

        return load_model(model_id, self.store)

    def globals(self) -> GlobalSettings:
        """The global settings (the defaults if the file cannot be read now)."""
        try:
            return self.store.globals()
        except ValueError:
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
