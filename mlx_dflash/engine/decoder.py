"""One generation as a set of one (DFLASH2.md section 4): `Decoder(...).run(prompt)`
drives the engine (engine.py) with a single request and yields its tokens. The
steps, the decision and every rule are the engine's; this is the public
single-stream shape (mlx-lm's generate_step: a generator over one prompt)."""

from __future__ import annotations

from typing import Iterator, Optional

from ..cache.prompt_cache import PromptCache
from ..target.adapter import Target
from .decode_config import DecodeConfig
from .engine import Engine, encode
from .sequence import cat_feats
from .stats import GenerationResponse

__all__ = ["Decoder", "encode", "cat_feats"]


class Decoder:
    """One generation over an mlx-lm `model` (+ a DFlash `drafter`).

    `run(prompt)` yields one GenerationResponse per token; the last has
    `finish_reason`. With a `prompt_cache` (chat turns, server requests) the
    target's caches, the drafter's context and the lookup index carry over.
    `calibration` (calibrate.Calibration: what stream_generate passes) supplies
    measured costs and the guard's carried-over state to the policies that use
    them. Without a tokenizer a session works on token ids (no text, no EOS).
    `target`: the target adapter (a split target's, distributed.py)."""

    def __init__(self, model, tokenizer, drafter=None, config: Optional[DecodeConfig] = None,
                 prompt_cache: Optional[PromptCache] = None, calibration=None, target: Optional[Target] = None):
        self.config = config or DecodeConfig()
        self.engine = Engine(model, tokenizer, drafter, max_batch=1, calibration=calibration, target=target,
                             prefill_step_size=self.config.prefill_step_size)
        self.pc, self.keep = prompt_cache, prompt_cache is not None
        self.stats = None

    @property
    def target(self) -> Target:
        return self.engine.target

    def run(self, prompt) -> Iterator[GenerationResponse]:
        eng = self.engine
        uid = eng.submit(prompt, self.config, self.pc, keep=self.keep)
        self.stats = eng.waiting[-1].stats
        failed = False
        try:
            while len(eng):
                for _, r in eng.step():
                    yield r
        except Exception:
            failed = True
            raise
        finally:
            if len(eng):  # the caller stopped reading (or it failed): the prompt cache keeps what was done
                eng.close(uid, evaluate=not failed)
