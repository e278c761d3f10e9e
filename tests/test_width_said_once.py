"""The width, said once (issue 36): what the setting means (`guard <=N`: the
guard picks each cycle's width up to the drafter's trained block size;
`fixed wN`: the guard off) and what ran (the last cycle's width) have their own
names, in the stats, the status line and the logs."""

import pytest

from mlx_dflash import generate, load
from mlx_dflash.engine.stats import width_text


def test_width_text_names_the_rule_and_what_runs_now():
    assert width_text(False, 5) == "fixed w5"
    assert width_text(False, 5, 5) == "fixed w5"  # (a fixed width: nothing else runs)
    assert width_text(True, 16) == "guard \u226416"  # before the first cycle
    assert width_text(True, 16, 8) == "guard \u226416 \u00b7 w8 now"
    assert width_text(True, 16, 1) == "guard \u226416 \u00b7 plain now"


@pytest.fixture(scope="module")
def pair(pairs):
    out = pairs(version=2)
    return load(str(out / "target"), str(out / "drafter"))


def test_the_stats_carry_both_names(pair):
    model, tok, drafter = pair
    r = generate(model, tok, "def f(x):", drafter, max_tokens=12, guard=False, block_size=4)
    st = r.stats
    # (the last cycle may be narrower: the block is min(w, tokens left + 1), as the published loops')
    assert (st.guard, st.max_width) == (False, 4) and 2 <= st.width <= 4 and st.width_text() == "fixed w4"
    r = generate(model, tok, "def f(x):", drafter, max_tokens=12)
    st = r.stats
    assert st.guard and st.max_width == drafter.block_size and 1 <= st.width <= st.max_width
    assert st.width_text().startswith(f"guard \u2264{drafter.block_size}")
    r = generate(model, tok, "def f(x):", drafter, max_tokens=12, verify_mode="off")
    assert not r.stats.guard and r.stats.width == 1
