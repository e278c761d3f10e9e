"""Verify modes: the one registry from a mode's name to the policy that runs
it (policy.py, adaptive.py). A new verify mode is a `Policy` subclass, one
line here and its name in modes.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .adaptive import AdaptiveWidth
from .base import Fixed, LookupFirst, PlainOnly, Policy
from .costs import Costs, Observed
from .guard import Guard
from .modes import VERIFY_MODES

DEFAULT_BLOCK_SIZE = 5
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


def priced_at(context: int) -> Optional[int]:
    """The length of the long-context curve a request of `context` tokens is
    priced with (None: the base curve)."""
    if context <= LONG_FROM:
        return None
    return next((n for n in LONG_CONTEXTS if n >= context), LONG_CONTEXTS[-1])


@dataclass
class PolicyContext:
    """What a policy is built from. `costs(**get_costs_options)` and `prior()`
    are called only by the policies that need them (measuring takes time)."""

    width: int
    max_width: int  # the widest block the drafter takes (its trained block size)
    context: int  # the request's length in tokens
    drafter: bool  # a DFlash drafter drafts in this call
    guard: Optional[bool]  # DecodeConfig.guard
    default_width: bool  # no block size given, or the default one
    lookup: bool  # the guard may verify prompt-lookup drafts
    costs: Callable[..., Costs]
    prior: Callable[[], Optional[Observed]]
    plain_reason: str = "verify mode off"


def _dflash(ctx: PolicyContext) -> Policy:
    """The default width is the guard's to choose, up to the drafter's block size;
    any other width is drafted exactly (guarded only when asked, at most that width)."""
    guarded = ctx.guard if ctx.guard is not None else ctx.default_width
    if guarded and ctx.width > 1:
        cap = max(ctx.width, ctx.max_width) if ctx.default_width else ctx.width
        widths = sorted({1, cap} | {x for x in GUARD_WIDTHS if x < cap})
        costs = ctx.costs(widths=widths, enough=(1, ctx.width), **GUARD_CALIBRATION)
        cap = max(x for x in costs.c if x <= cap)
        long, at = None, priced_at(ctx.context)
        if at is not None:
            long = ctx.costs(widths=sorted(x for x in costs.c if x <= cap), at=at,
                             **{**GUARD_CALIBRATION, "context": at})
        return Guard(cap, costs, ctx.prior(), lookup=ctx.lookup, long=long, context=ctx.context)
    return Fixed(ctx.width)


POLICIES: Dict[str, Callable[[PolicyContext], Policy]] = {
    "dflash": _dflash,
    "adaptive": lambda ctx: AdaptiveWidth(ctx.costs(max_width=ctx.width), ctx.width),
    "lookup": lambda ctx: LookupFirst(ctx.width, ctx.drafter),
    "off": lambda ctx: PlainOnly(ctx.plain_reason),
}
if tuple(POLICIES) != VERIFY_MODES:  # the names are read without mlx (settings); both lists must agree
    raise ImportError(f"policy registry {tuple(POLICIES)} != modes.VERIFY_MODES {VERIFY_MODES}")
