"""What a request asks of each decoding step: mlx-lm logits processors for its
penalties, logit_bias and constrained format (mlx_dflash.DecodeConfig: DFlash's
verify applies them per row, mlx_dflash/engine/logits.py), and the log-probability
entries of the OpenAI APIs (per plain step: logprobs decode plainly)."""

from __future__ import annotations

import math
from typing import List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from .structured import Constrained


def fallback_reason(req) -> Optional[str]:
    """Why this request needs plain decoding (logprobs: the OpenAI entries are
    per plain step), or None; penalties, logit_bias and a format do not (the
    verify applies their processors)."""
    if req.n_logprobs() is not None:
        return "logprobs requested (plain decoding reports them per step)"
    return None


def logits_processors(req, tok, logit_width: int, n_prompt: int, max_tokens: int) -> List:
    """mlx-lm logits processors for the request's logit_bias, penalties and format."""
    span = n_prompt + max_tokens + 1
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    procs = make_logits_processors(bias or None, req.repetition_penalty if req.repetition_penalty != 1.0 else None,
                                   span)
    # OpenAI's presence / frequency penalties count generated tokens only
    gen_only = make_logits_processors(None, None, None, req.presence_penalty or None, span,
                                      req.frequency_penalty or None, span)
    for p in gen_only:
        procs.append(lambda toks, logits, p=p: p(toks[n_prompt:], logits) if toks.size > n_prompt else logits)
    fmt = getattr(req, "response_format", None)
    if fmt is not None:  # last: the mask applies to the logits the other processors made
        procs.append(Constrained(fmt, tok, logit_width, n_prompt))
    return procs


def logprob_entry(tok, token: int, logprobs, n_top: int) -> dict:
    """The OpenAI log-probability entry of one generated token."""

    def piece(t):
        s = tok.decode([t])
        return {"token": s, "logprob": _finite(float(logprobs[t].item())), "bytes": list(s.encode("utf-8"))}

    e = piece(token)
    e["top_logprobs"] = []
    if n_top:
        top = mx.argsort(-logprobs)[:n_top].tolist()
        e["top_logprobs"] = [piece(t) for t in top]
    return e


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (OpenAI uses -9999.0 likewise)
