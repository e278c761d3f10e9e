"""Option values every `mlx-dflash bench` mode reads the same way."""

from __future__ import annotations

from typing import List

from app.errors import UserError


def ints(s: str, what: str) -> List[int]:
    """A comma list of positive integers ("1,2,4,8"), sorted, each once."""
    try:
        out = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{what} must be a comma list of integers, got '{s}'") from None
    if not out or out[0] < 1:
        raise UserError(f"{what} must be positive integers, got '{s}'")
    return out
