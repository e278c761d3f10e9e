"""The public generation API, in mlx-lm's shape: `stream_generate` yields one
response per token, `generate` collects them. Both drive one decode session
(decoder.Decoder) configured by one DecodeConfig.

Verify modes (modes.py holds the registry, policy.py / adaptive.py the policies):
- `dflash` (default): the DFlash drafter at width w. With the default width
  (block_size None or 5) `policy.Guard` runs plain decoding whenever drafting
  is predicted not to pay (calibrated cycle cost vs live acceptance), probing
  now and then, and verifies prompt-lookup drafts (the continuation of an
  n-gram the context repeats) wherever their gate predicts they pay, in any
  state; any other width, or `guard=False`, drafts at exactly that width on
  every cycle (`guard=True` guards any width; `lookup=False` keeps the
  guard's lookup drafts out).
- `adaptive`: per-cycle width and cut from the calibrated cost curve (adaptive.AdaptiveWidth).
- `lookup`: prompt-lookup drafts (lookup.py), for any model; with a drafter,
  lookup when it has a full-width match, else DFlash.
- `off`: plain decoding, pipelined like mlx-lm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.prompt_cache import PromptCache
from ..drafting.drafter import Drafter
from . import calibrate
from .decode_config import DecodeConfig
from .decoder import Decoder
from .stats import GenerationResponse, GenerationStats


def stream_generate(model, tokenizer, prompt: Union[str, List[int], mx.array], drafter: Optional[Drafter] = None,
                    *, prompt_cache: Optional[PromptCache] = None, config: Optional[DecodeConfig] = None,
                    **options) -> Iterator[GenerationResponse]:
    """Generate from `model` (an mlx-lm model), speculatively with `drafter`.

    Yields one GenerationResponse per token; the last one has `finish_reason`.
    Greedy output is token-for-token what mlx-lm's own `stream_generate` gives.
    `options` are DecodeConfig's fields (max_tokens, temperature, top_p, top_k,
    min_p, seed, block_size, verify_mode, stop, guard, lookup, max_context,
    prefill_step_size, logits_processors, logprobs), or pass a `config`.

    `guard` (verify mode dflash): None = on when `block_size` is None or the
    default width (5), off for any other width; True / False force it. The
    guard also verifies prompt-lookup drafts where they pay, unless `lookup`
    is False. The stats' `policy` says what decided each width and why."""
    if config is not None and options:
        raise TypeError("pass either a DecodeConfig or options, not both")
    cfg = config or DecodeConfig(**options)
    return Decoder(model, tokenizer, drafter, cfg, prompt_cache, calibrate.DEFAULT).run(prompt)


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    stats: GenerationStats
    from_draft: List[bool] = field(default_factory=list)


def generate(model, tokenizer, prompt, drafter=None, **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end and collect the text, ids and stats."""
    tw = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    eos = set(tw.eos_token_ids)
    text, ids, src, r = [], [], [], None
    for r in stream_generate(model, tw, prompt, drafter, **kwargs):
        text.append(r.text)
        if not (r.finish_reason == "stop" and r.token in eos):
            ids.append(r.token)
            src.append(r.from_draft)
    return GenerationResult("".join(text), ids, r.finish_reason, r.stats, src)
