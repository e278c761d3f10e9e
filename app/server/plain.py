"""Plain decoding for requests that DFlash's verify step cannot serve
exactly (logprobs, penalties, logit_bias, a constrained format): mlx-lm's
generate_step with logits processors, sampled with the engine's own rules."""

from __future__ import annotations

import math
import time
from typing import Optional


def fallback_reason(req) -> Optional[str]:
    """Why this request needs plain decoding (options DFlash's verify step cannot apply)."""
    why = []
    if req.n_logprobs() is not None:
        why.append("logprobs")
    for k in ("frequency_penalty", "presence_penalty"):
        if getattr(req, k):
            why.append(k)
    if req.repetition_penalty not in (None, 1.0):
        why.append("repetition_penalty")
    if req.logit_bias:
        why.append("logit_bias")
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        why.append(fmt.label)
    return f"{', '.join(why)} requested (plain decoding applies {'them' if len(why) > 1 else 'it'})" \
        if why else None


def plain(lm, ids, kw, req, reason, tok):
    """Plain decoding with logits processors and log-probabilities (mlx-lm's
    generate_step), sampled with the same rules as the DFlash path. Yields
    (GenerationResponse, logprobs entry)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_dflash.generate import GenerationStats, Emitter
    from mlx_dflash.sampling import SamplingParams, probs, sample

    sp = SamplingParams(kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"], kw["seed"])
    if kw["seed"] is not None:
        mx.random.seed(kw["seed"])
    n_prompt, span = len(ids), len(ids) + kw["max_tokens"] + 1
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
        from .structured import Constrained

        procs.append(Constrained(fmt, tok, _logit_width(lm), n_prompt))

    def sampler(logprobs):
        if sp.greedy:
            return mx.argmax(logprobs, axis=-1)
        return sample(probs(logprobs, sp))

    stats = GenerationStats(mode="off", fallback=reason, prompt_tokens=n_prompt, block_size=1)
    emit = Emitter(tok, kw["stop"], kw["max_tokens"], stats)
    n_top = req.n_logprobs() or 0
    tic = time.perf_counter()
    steps = generate_step(mx.array(ids), lm.model, max_tokens=kw["max_tokens"] + 1, sampler=sampler,
                          logits_processors=procs or None)
    try:
        for i, (token, logprobs) in enumerate(steps):
            token = int(token)
            now = time.perf_counter()
            if i == 0:
                stats.prompt_time, gen_tic = now - tic, now
            else:
                stats.cycles += 1
                stats.cycle_tokens += 1
                stats.generation_time = now - gen_tic
            lp = _logprob_entry(tok, token, logprobs, n_top) if req.n_logprobs() is not None else None
            resp = emit.push(token, False)
            yield resp, lp
            if emit.done:
                return
    finally:
        steps.close()


def _logit_width(lm) -> int:
    """The number of logits the model outputs (its vocab size, maybe padded past the tokenizer's)."""
    from mlx_dflash.target import Target

    return Target(lm.model).vocab_size


def _logprob_entry(tok, token: int, logprobs, n_top: int) -> dict:
    import mlx.core as mx

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
