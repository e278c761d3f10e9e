"""The settings of a drafter training run (a plain dataclass) and its one error type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class TrainError(ValueError):
    """A user-fixable problem with a training run (one-line message)."""


@dataclass
class TrainConfig:
    out: str
    target: Optional[str] = None  # None: the embedded default target
    version: int = 2
    block_size: int = 8
    layers: int = 2
    taps: Optional[int] = None  # number of tapped target layers (default: up to 5, evenly spaced)
    intermediate_size: Optional[int] = None  # default: the target's
    mask_token: Optional[int] = None  # default: the tokenizer's <|mask|>
    init: Optional[str] = None  # a saved drafter (folder or repo) to start from instead of fresh weights
    # data
    prompts: Optional[str] = None  # JSONL {"prompt": raw text} or {"messages": [...]} (chat template)
    corpus: Optional[str] = None  # JSONL {"text": ...}
    responses: Optional[str] = None  # on-policy cache (default OUT/responses.jsonl)
    max_prompts: Optional[int] = None
    gen_max_tokens: int = 256
    gen_temperature: float = 0.0
    gen_batch: int = 16
    seq_len: int = 512
    holdout: float = 0.05
    # optimisation
    steps: int = 1000
    batch: int = 4  # rows per step
    anchors: int = 32  # anchors per row
    lr: float = 1e-3
    warmup: float = 0.04  # share of steps
    min_lr: float = 0.1  # cosine floor, share of lr
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: Optional[float] = None  # position decay; default 4 at B=8, 7 at B=16, interpolated
    selector_weight: float = 0.2  # lambda of the DFlash 2 selector loss
    seed: int = 0
    compile: bool = False  # measured: no faster on mlx-cpu, and it adds a compile pause
    # bookkeeping
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 200
    eval_anchors: int = 512  # anchors over the held-out rows
    time_budget: Optional[float] = None  # minutes: stop (and decay the lr) by then
    resume: bool = False

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def responses_path(self) -> Path:
        return Path(self.responses) if self.responses else self.out_dir / "responses.jsonl"

