"""Verify modes: the one registry from a mode's name to the policy that runs
it (policy.py, adaptive.py). A new verify mode is a `Policy` subclass and one
line here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .adaptive import AdaptiveWidth
from .costs import Costs, Observed
from .policy import Fixed, Guard, LookupFirst, PlainOnly, Policy

DEFAULT_BLOCK_SIZE = 5
# the guard's calibration, once per model, drafter and machine (then cached on
# disk for a month): widths 1 and w, three rounds, 16 pipelined plain steps each
# (fewer overstate a plain token: the pipeline's first step does not overlap);
# about 1.5 s on the embedded pair in bfloat16 on a 2-core x86 CPU
GUARD_CALIBRATION = dict(budget_s=0.3, min_rounds=3, plain_steps=16, context=128)


@dataclass
class PolicyContext:
    """What a policy is built from. `costs(**get_costs_options)` and `prior()`
    are called only by the policies that need them (measuring takes time)."""

    width: int
    drafter: bool  # a DFlash drafter drafts in this call
    guard: Optional[bool]  # DecodeConfig.guard
    default_width: bool  # no block size given, or the default one
    lookup: bool  # the guard may verify prompt-lookup drafts
    costs: Callable[..., Costs]
    prior: Callable[[], Optional[Observed]]
    plain_reason: str = "verify mode off"


def _dflash(ctx: PolicyContext) -> Policy:
    guarded = ctx.guard if ctx.guard is not None else ctx.default_width
    if guarded and ctx.width > 1:
        return Guard(ctx.width, ctx.costs(widths=(1, ctx.width), **GUARD_CALIBRATION), ctx.prior(),
                     lookup=ctx.lookup)
    return Fixed(ctx.width)


POLICIES: Dict[str, Callable[[PolicyContext], Policy]] = {
    "dflash": _dflash,
    "adaptive": lambda ctx: AdaptiveWidth(ctx.costs(max_width=ctx.width), ctx.width),
    "lookup": lambda ctx: LookupFirst(ctx.width, ctx.drafter),
    "off": lambda ctx: PlainOnly(ctx.plain_reason),
}
VERIFY_MODES = tuple(POLICIES)
