"""The guard's prices as paid (policy.guard.Guard): cycles that take longer than
their k(w) in units of the set's timed plain step raise every price at that set
size, and the unit, the samples and the carry-over that keep one slow cycle or a
few short plain steps from deciding for good (pure, no model)."""

import pytest

from guard_drive import ROW, curve_for, model_for, step
from mlx_dflash.policy.base import DFLASH, LOOKUP, CycleResult
from mlx_dflash.policy.costs import Costs, Observed
from mlx_dflash.policy.guard import Guard
from rows import Row

pytestmark = pytest.mark.usefixtures("fresh_costs")


def test_prices_are_raised_to_what_the_cycles_paid():
    """Cycles that take longer than k(w) x the set's plain step add the median
    excess (in plain steps) to every price at that set size; it carries to the
    next request; the first cycle after plain steps (the drafter's catch-up) and
    steps of another set of rows are left out; cheaper cycles lower nothing."""
    g = Guard(model_for(curve_for(2.0)))
    rows = (Row(uid=1), Row(uid=2))
    for _ in range(4):
        step(g, 1, 0.010, rows)  # plain steps at 2 rows: 10 ms
    assert g.paid == {}
    k5 = g.priced[0][5]
    step(g, 5, 100.0, rows, accepted=4)  # right after plain steps: the catch-up cycle, left out
    assert g.paid == {}
    for excess in (0.6, 0.4, 8.0):
        step(g, 5, 0.010 * (k5 + excess), rows, accepted=4)
    assert g.paid[(2, True)] == pytest.approx(0.6)  # the median of 0.6, 0.4 and 8
    g.decide(list(rows))
    assert g.kd[5] == pytest.approx(k5 + 0.6) and g.kv[5] == pytest.approx(g.priced[1][5])  # (lookup apart)
    assert g.kd[1] == 1.0  # (a plain step is the unit)
    assert "0.60 more than measured, as paid" in g.reason(rows[0])
    assert g.decide([ROW]) and g.kd[5] == pytest.approx(g.model.k(1, 0, True)[5])  # one row: its own price
    o = g.leave(rows[0])
    h = Guard(model_for(curve_for(2.0)), o)
    h.decide(list(rows))
    assert h.kd[5] == pytest.approx(k5 + 0.6)  # the next request starts from what was paid
    # cycles cheaper than their price leave it as measured; unknown step times (0) are not samples
    q = Guard(model_for(curve_for(2.0)))
    for _ in range(4):
        step(q, 1, 0.010, rows)
    for secs in (0.010 * k5 * 5, 0.0, 0.0, 0.010 * (k5 - 0.5)):  # (the catch-up, two unknown, one sample)
        step(q, 5, secs, rows, accepted=4)
    q.decide(list(rows))
    assert q.paid[(2, True)] == pytest.approx(-0.5) and q.kd[5] == pytest.approx(k5)


def test_what_was_paid_is_a_median_over_requests():
    """The excess is the median of the last PAID_SAMPLES cycles, this request's
    and those before it: one request times few cycles, and one slow cycle in
    the next (a busy moment) must not set the prices of every request after it."""
    g = Guard(model_for(curve_for(2.0)))
    for _ in range(4):
        step(g, 1, 0.010)
    k5 = g.priced[0][5]
    step(g, 5, 1.0, accepted=4)  # (the catch-up, left out)
    for excess in (0.4, 0.5, 0.45):
        step(g, 5, 0.010 * (k5 + excess), accepted=4)
    o = g.leave(ROW)
    assert o.paid[(1, True)] == pytest.approx(0.45) and o.excess[(1, True)] == pytest.approx([0.4, 0.5, 0.45])
    h = Guard(model_for(curve_for(2.0)), o)
    for _ in range(4):
        step(h, 1, 0.010)
    step(h, 5, 1.0, accepted=4)
    step(h, 5, 0.010 * (k5 + 3.0), accepted=4)  # one slow cycle
    assert h.paid[(1, True)] == pytest.approx(0.475)  # the median of 0.4, 0.5, 0.45 and 3.0 (the middle two's mean)
    for _ in range(Guard.PAID_SAMPLES):  # the oldest samples give way to the newest
        step(h, 5, 0.010 * (k5 + 1.0), accepted=4)
    assert h.paid[(1, True)] == pytest.approx(1.0) and len(h.excess[(1, True)]) == Guard.PAID_SAMPLES


def test_the_drafters_catch_up_after_a_lookup_cycle_is_not_what_a_cycle_pays():
    """The drafter's context follows the target only in DFlash cycles: the one
    after a lookup cycle catches up the tokens that cycle made (as the one after
    plain steps does), so its time is no sample of what a cycle pays."""
    g = Guard(model_for(curve_for(2.0)))
    rows = (Row(lookup=True),)
    for _ in range(4):
        step(g, 1, 0.010, rows)
    k5 = g.priced[0][5]
    step(g, 5, 1.0, rows, accepted=4)  # (the catch-up after plain steps)
    step(g, 5, 0.010 * (k5 + 0.2), rows, accepted=4)
    g.decide(list(rows))
    g.observe(list(rows), [CycleResult(5, 4, 5, source=LOOKUP, t_step=0.010 * g.priced[1][5])])
    step(g, 5, 0.010 * (k5 + 6.0), rows, accepted=4)  # the catch-up after the lookup cycle: left out
    assert g.excess[(1, True)] == pytest.approx([0.2])
    step(g, 5, 0.010 * (k5 + 0.4), rows, accepted=4)
    assert g.excess[(1, True)] == pytest.approx([0.2, 0.4])


def test_one_slow_cycle_paid_does_not_stop_drafting_for_good():
    """Never trying DFlash (even a drafter right 90% of the time could not pay)
    is judged on the price measured: an outlier excess carried from the last
    request raises the prices, the guard falls back, and the cycles of its
    next probe, timed at their price, bring what was paid back down."""
    c = Costs(0.01, {1: 1.0, 5: 1.4}, {1: 0.0, 5: 0.6}, t_plain=0.01)  # k(5) = 2: a ceiling of 2.5
    g = Guard(model_for(c), Observed(paid={(1, True): 3.0}, excess={(1, True): [3.0]}))
    g.decide([ROW])
    assert g.kd[5] == pytest.approx(5.0) and not g.hopeless  # (as paid, 5 / 5 is below the ceiling)
    seen = []
    for _ in range(300):
        d = g.decide([ROW])
        w = d.width
        g.observe([ROW], [CycleResult(w, w - 1, w, source=DFLASH if w > 1 else "", t_step=0.01 * (2.0 if w > 1 else 1))])
        seen.append(w)
    assert g.paid[(1, True)] == pytest.approx(0.0) and g.state == "draft" and seen[-50:] == [5] * 50
    assert g.fallbacks >= 1  # (it did fall back at first: 5 plain steps a cycle priced no better than plain)


def test_a_few_plain_steps_timed_short_do_not_set_the_unit_for_good():
    """What was paid is in units of the set's timed plain step, held within
    UNIT_BOUND of the step measured apart: a request whose only timed plain
    steps were short (their compute done before they were timed) once priced
    every cycle at ~20 plain steps; carried to the next requests, that ended
    each probe at its first cycle, so no cycle was timed again (the unit trap)."""
    c = curve_for(2.0)  # a plain step measured apart: 8 ms
    g = Guard(model_for(c))
    k5 = g.model.k(1, 0, True)[5]
    for _ in range(5):  # cycles that cost their price (the first: the catch-up), before any plain step is timed
        step(g, 5, 0.008 * k5, accepted=4)
    for _ in range(3):
        step(g, 1, 0.0004)  # three plain steps timed short
    h = Guard(model_for(c), g.leave(ROW))
    seen = []
    for _ in range(300):  # the next request, every step at its price, its drafter right every time
        w = h.decide([ROW]).width
        h.observe([ROW], [CycleResult(w, w - 1, w, source=DFLASH if w > 1 else "", t_step=0.008 * (k5 if w > 1 else 1))])
        seen.append(w)
    assert h.state == "draft" and seen[-50:] == [5] * 50
    assert g.paid[(1, True)] <= k5 * (Guard.UNIT_BOUND - 1) + 1e-9  # (a cycle at its price: at most the bound's)


def test_an_excess_learnt_at_one_width_prices_every_width_by_the_same_steps():
    """What the curves miss is work per cycle: an excess paid at width 5 raises
    width 2 by the same plain steps, not by width 5's ratio (which would price
    a narrow width below what it costs)."""
    base = Costs(0.01, {1: 1.0, 2: 1.1, 5: 1.5}, {1: 0.0, 2: 0.3, 5: 0.5})
    g = Guard(model_for(base))
    for _ in range(4):
        step(g, 1, 0.010)
    k2, k5 = g.priced[0][2], g.priced[0][5]
    for _ in range(4):  # (the first: the catch-up)
        step(g, 5, 0.010 * (k5 + 1.0), accepted=4)
    g.decide([ROW])
    assert g.kd[2] == pytest.approx(k2 + 1.0) and g.kd[5] == pytest.approx(k5 + 1.0)


def test_a_set_that_never_steps_plainly_times_a_plain_step_once():
    """Prices as paid are in plain steps: a set whose cycles pay (as priced) never
    falls back, so after UNTIMED cycles it steps plainly until three plain steps
    are timed, learns what its cycles cost, and falls back where they do not
    pay. A set of the same size that carries what was paid does not stop again."""
    base = Costs(0.01, {1: 1.0, 2: 1.1}, {1: 0.0, 2: 0.1})  # a width-2 cycle priced at 1.2 plain steps
    g = Guard(model_for(base))
    seq = []
    for i in range(40):  # each draft accepted half the time (1.25x plain as priced); every cycle truly costs 2.2
        w = g.decide([ROW]).width
        a = int(i % 2 == 0) if w > 1 else 0
        g.observe([ROW], [CycleResult(w, a, a + 1, source=DFLASH if w > 1 else "",
                                      t_step=0.010 * (2.2 if w > 1 else 1.0))])
        seq.append(w)
    assert seq[:4] == [2, 2, 2, 2]  # (the catch-up, then UNTIMED cycles)
    assert seq[4:7] == [1, 1, 1]  # three plain steps timed
    assert g.paid[(1, True)] == pytest.approx(1.0)
    assert seq[-20:] == [1] * 20  # 1.5 tokens for 2.2 plain steps: it steps plainly
    assert g.leave(ROW).paid == {(1, True): pytest.approx(1.0)}  # (carried on)
    h = Guard(model_for(base), Observed(paid={(1, True): 0.1}))  # what was paid at one row, carried
    for _ in range(10):  # every draft accepted: it drafts on
        assert h.decide([ROW]).width == 2
        h.observe([ROW], [CycleResult(2, 1, 2, source=DFLASH, t_step=0.013)])
    assert h.unmatched and not h.plain_s  # it drafted on, its cycles waiting for a plain step
    # plain steps whose time is unknown (0) are no samples: it stops trying after 3 x UNTIMED of them
    q = Guard(model_for(base))
    seq = []
    for _ in range(30):
        w = q.decide([ROW]).width
        q.observe([ROW], [CycleResult(w, 1 if w > 1 else 0, 2 if w > 1 else 1, source=DFLASH if w > 1 else "",
                                      t_step=0.012 if w > 1 else 0.0)])
        seq.append(w)
    assert seq.count(1) == 3 * Guard.UNTIMED and seq[-10:] == [2] * 10
