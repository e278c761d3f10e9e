"""`mlx-dflash serve` under `mlx.launch`: the target split over the ranks
(mlx_dflash.engine.distributed). Rank 0 serves HTTP with one model, the one loaded at
start; each request's prompt ids and settings go to the other ranks, which run
it with rank 0 (`follow`) and never open a port. No prompt store (a cached
conversation would have to be the same on every rank) and no logits processors
(functions stay on rank 0): such requests are refused with one line."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import List, Optional

from mlx_dflash.engine.distributed import DistributedError, Leader, Session, follow, load, lost_rank
from mlx_dflash.models.manager import LoadedModel
from mlx_dflash.models.model_names import model_path, resolve

from .catalog import ManagerCatalog
from .engines import SplitEngine


class SplitServer:
    """Loads this rank's part of the model; `follow()` on the other ranks,
    `catalog` (for the worker) and `close()` on rank 0."""

    def __init__(self, model: Optional[str], store, group, split: str = "auto"):
        self.group = group
        entry = resolve(model, store)
        if entry.kind != "target":
            raise ValueError(f"'{entry.id}' is a {entry.kind_label}, not a model to serve")
        s = store.model(entry.id)
        did = None
        if s.dflash_enabled and s.verify_mode != "off":
            did = s.drafter or (entry.compatible_drafters[0] if entry.compatible_drafters else None)
        try:
            m, tok, drafter, sp = load(str(entry.path), model_path(did, store) if did else None, group, split)
        except DistributedError as e:
            raise ValueError(str(e)) from None
        if drafter is not None and s.block_size > drafter.block_size:
            s = replace(s, block_size=drafter.block_size)
        if s.verify_mode == "adaptive":
            s = replace(s, verify_mode="dflash")  # (it times each rank on its own)
        self.session = Session(m, tok, drafter, sp)
        self.lm = LoadedModel(entry.id, m, tok, drafter, s, entry, did if drafter is not None else None)
        self.leader = Leader(self.session) if group.rank() == 0 else None
        self.catalog = SplitCatalog(store, self) if self.leader is not None else None

    def follow(self) -> int:
        try:
            follow(self.session)
        except RuntimeError as e:
            why = lost_rank(e, self.group)
            if why is None:
                raise
            sys.stderr.write(f"mlx-dflash serve: error: {why}\n")
            return 1
        return 0

    def stream(self, ids: List[int], cfg):
        """A request's generation on every rank (the worker's stream_generate)."""
        if cfg.logits_processors:
            raise ValueError("this request needs logits processors (logprobs, penalties, logit_bias or a "
                             "response format), which a split target cannot run; drop those fields")
        if cfg.verify_mode == "adaptive":  # (it times each rank on its own)
            cfg = replace(cfg, verify_mode="dflash")
        try:
            yield from self.leader.stream(ids, cfg)
        except RuntimeError as e:
            why = lost_rank(e, self.group)
            if why is None:
                raise
            # the ranks are out of step for good: nothing more can be served
            sys.stderr.write(f"mlx-dflash serve: error: {why}\n")
            sys.stderr.flush()
            os._exit(1)

    def close(self) -> None:
        if self.leader is not None:
            try:
                self.leader.close()
            except RuntimeError:  # another rank is gone already
                pass


class SplitCatalog(ManagerCatalog):
    """The one model a split server holds, under its id."""

    def __init__(self, store, server: SplitServer):
        super().__init__(store)
        self.server = server

    def engine(self, lm, max_batch: int, prefill_together: bool):
        return SplitEngine(self.server)

    def targets(self) -> List[dict]:
        lm = self.server.lm
        return [{"id": lm.id, "owned_by": lm.entry.source, "drafters": [lm.drafter_id] if lm.drafter_id else []}]

    def default(self) -> str:
        return self.server.lm.id

    def find(self, name: str, served: Optional[str] = None) -> Optional[str]:
        found = super().find(name, served)
        return found if found == self.server.lm.id else None

    def check(self, model_id: str, settings) -> None:
        return None

    def load(self, model_id: str):
        if model_id != self.server.lm.id:
            raise ValueError(f"this server holds only '{self.server.lm.id}', split over "
                             f"{self.server.group.size()} ranks")
        return self.server.lm
