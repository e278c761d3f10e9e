"""Continuous batching with DFlash: the engine (engine.py) with room for several
sequences. Requests join at a step boundary (a long prompt is prefilled chunk
by chunk between the steps of the rows running), leave when done or
cancelled, and decode together in one target forward per cycle; each row's
output is what it would be alone (greedy: token for token; sampled: the same
distribution, and a seeded row the same tokens)."""

from __future__ import annotations

from typing import Optional

from .calibrate import Calibration
from .engine import BatchError, Engine

__all__ = ["BatchEngine", "BatchError"]


class BatchEngine(Engine):
    """`Engine` with `max_batch` rows (default 8) and its own Calibration when none is given."""

    def __init__(self, model, tokenizer, drafter=None, *, max_batch: int = 8, calibration: Optional[Calibration] = None,
                 **options):
        super().__init__(model, tokenizer, drafter, max_batch=max_batch,
                         calibration=calibration if calibration is not None else Calibration(), **options)
