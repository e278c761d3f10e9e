"""Verify modes: the one registry from a mode's name to what a sequence in that
mode drafts with (`plan`, the rule every path shares) and the policy that
decides its cycles. A new verify mode is one `MODES` line (and, if it decides
differently, one `Policy` subclass).

- `dflash` (default): the DFlash drafter. With the guard on (DecodeConfig.guard)
  the guard (guard.py) chooses each cycle's width, from plain decoding up to
  the drafter's trained block size, and verifies prompt-lookup drafts where
  they pay; with the guard off every cycle verifies exactly `block_size` rows.
- `adaptive`: per-cycle width and cut from the drafts' confidences
  (adaptive.py); it runs alone (a set of one).
- `lookup`: prompt-lookup drafts at `block_size` (with a drafter: DFlash where
  the context has no full-width match).
- `off`: plain decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .adaptive import AdaptiveWidth
from .base import Plan, Policy
from .modes import VERIFY_MODES

DEFAULT_BLOCK_SIZE = 5
LOOKUP_LIMIT = 64  # the widest lookup verify without a drafter
# the guard's calibration, once per model, drafter and machine (then cached on
# disk for a month): the widths it may choose among, three rounds, 16 pipelined
# plain steps each (fewer overstate a plain token: the pipeline's first step does
# not overlap); a few seconds on the embedded pair on a 2-core x86 CPU
GUARD_CALIBRATION = dict(budget_s=0.3, min_rounds=3, plain_steps=16, context=128)
GUARD_WIDTHS = (2, 3, 5, 8, 12, 16)  # measured up to the widest it may draft at (costs between: interpolated)
# a request longer than LONG_FROM tokens is priced with a second curve, measured (once per
# machine) at the first of these lengths that covers it: costs are linear in the length between
LONG_CONTEXTS = (1024, 4096, 16384, 65536)
LONG_FROM = 512

@dataclass(frozen=True)
class Mode:
    """A verify mode: what its sequences may draft with, and the policy that
    decides their cycles (None: the set's guard, which also runs fixed widths,
    lookup first and plain rows; a policy of its own decides for a set of one:
    the sequence runs alone)."""

    drafter: bool  # drafts from the DFlash drafter
    lookup: bool  # may verify prompt-lookup drafts
    policy: Optional[Callable[["PolicyContext"], Policy]] = None


@dataclass
class PolicyContext:
    """What a mode's own policy is built from: the sequence's plan and the
    measured costs (`costs(**Calibration.costs options)`, measured when called)."""

    plan: Plan
    context: int  # the prompt's length in tokens
    costs: Callable[..., object]


MODES: Dict[str, Mode] = {
    "dflash": Mode(True, True),
    "adaptive": Mode(True, False, lambda ctx: AdaptiveWidth(ctx.costs(max_width=ctx.plan.cap), ctx.plan.cap)),
    "lookup": Mode(True, True),
    "off": Mode(False, False),
}
if tuple(MODES) != VERIFY_MODES:  # the names are read without mlx (settings): both lists must agree
    raise ImportError(f"policy registry {tuple(MODES)} != modes.VERIFY_MODES {VERIFY_MODES}")


def priced_at(context: int) -> Optional[int]:
    """The length of the long-context curve a request of `context` tokens is
    priced with (None: the base curve)."""
    if context <= LONG_FROM:
        return None
    return next((n for n in LONG_CONTEXTS if n >= context), LONG_CONTEXTS[-1])


def guard_widths(cap: int) -> list:
    """The widths the guard measures and chooses among, up to `cap`."""
    return sorted({1, cap} | {x for x in GUARD_WIDTHS if x < cap})


def fit_block_size(block_size: int, trained: int, explicit: bool) -> int:
    """The one rule for a block size wider than the drafter was trained for
    (`trained`): one asked for now (a flag, `settings set`, a call's option) is
    refused in one line (ValueError); a saved one is fitted to the drafter, which
    may have changed since it was saved."""
    if block_size <= trained:
        return block_size
    if explicit:
        raise ValueError(f"block size {block_size} is above the drafter's trained block size {trained}; "
                         f"use 1..{trained}")
    return trained


def plan(config, drafter, prompt_tokens: int, trimmable: bool = True, shared: bool = False) -> Plan:
    """What a request drafts with, from its config (`config`: DecodeConfig),
    the drafter (None: none), its prompt's length, whether the target's cache
    can be rolled back, and whether other requests may run beside it
    (`shared`: a seeded sampled request then drafts at a fixed width, so its
    tokens do not depend on the widths the rows around it make the set choose).
    Raises ValueError (one line) for a block size the drafter cannot take."""
    mode, why = config.verify_mode, config.needs_plain
    if mode != "off" and why is None:
        if mode in ("dflash", "adaptive") and drafter is None:
            why = "no drafter"
        elif config.max_context is not None and prompt_tokens > config.max_context:
            why = f"prompt longer than max_context ({prompt_tokens} > {config.max_context})"
        elif not trimmable:
            why = "target KV cache cannot be trimmed"
    carry = config.seed is None  # a seeded call does not inherit the last call's state: same seed, same sample
    if mode == "off" or why is not None:
        return Plan("off", fallback=why if mode != "off" else None, carry=carry)
    limit, what = ((drafter.block_size, "the drafter's trained block size") if drafter is not None
                   else (LOOKUP_LIMIT, "the lookup limit"))
    w = config.block_size if config.block_size is not None else min(DEFAULT_BLOCK_SIZE, limit)
    if drafter is not None:
        fit_block_size(w, limit, explicit=True)
    elif w > limit:
        raise ValueError(f"block size {w} must be between 1 and {what} {limit}")
    m = MODES[mode]
    guarded = mode == "dflash" and config.guarded
    if guarded and shared and config.seed is not None and not config.sampling().greedy:
        guarded = False
    if guarded:
        return Plan(mode, drafter.block_size, False, True, config.lookup, carry=carry)
    return Plan(mode, w, True, m.drafter and drafter is not None, m.lookup and mode != "dflash", carry=carry)


def runs_alone(config) -> Optional[str]:
    """Why a request with this config must be the only row of its set (None: it may share)."""
    if MODES[config.verify_mode].policy is not None and not config.needs_plain:
        return f"verify mode '{config.verify_mode}' runs alone"
    if config.kv_bits is not None:
        return "a quantized KV cache runs alone (mlx-lm's batch caches are not quantized)"
    return None
