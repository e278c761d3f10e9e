"""The fast tier (`pytest -m "not slow"`): a parametrized test runs its first
case(s) there and every case in the full suite (CI).

    @pytest.mark.parametrize("family", fast_first(FAMILIES))
    @pytest.mark.parametrize("a,b", fast_first([(1, 2), (3, 4)], unpack=True))"""

import pytest

ParameterSet = type(pytest.param(None))  # what pytest.param makes


def fast_first(values, keep: int = 1, unpack: bool = False) -> list:
    """`values` for parametrize, all but the first `keep` marked slow. `unpack`:
    each value is a tuple of several argnames' values."""
    out = []
    for i, v in enumerate(values):
        if i < keep:
            out.append(v)
        elif isinstance(v, ParameterSet):
            out.append(pytest.param(*v.values, marks=[*v.marks, pytest.mark.slow], id=v.id))
        else:
            out.append(pytest.param(*(v if unpack else (v,)), marks=pytest.mark.slow))
    return out
