"""Giving way while measuring: a server measures the guard's costs while idle
(cost_source.py), and a request that arrives meanwhile must not wait for a
whole measurement. calibrate.py and batch_costs.py call `checkpoint(stop)`
between their timed pieces."""

from typing import Callable, Optional


class Interrupted(Exception):
    """A measurement stopped early because its `stop()` said so (a request came)."""


def checkpoint(stop: Optional[Callable[[], bool]]) -> None:
    """Between two timed pieces: give way when `stop()` says so."""
    if stop is not None and stop():
        raise Interrupted
