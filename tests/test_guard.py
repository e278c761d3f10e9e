"""The default mode's guard (policy.guard.Guard): its prices, probes, fallbacks
and widths (pure, no model), and the guard in the decode loop; its calibration
is measured once and cached. Its prices as paid: test_guard_paid.py."""

import random

import pytest

from drafters import PROMPTS, OracleDrafter, reference_tokens
from guard_drive import ROW, curve_for, cycle, drive, due, model_for, plain
from mlx_dflash import generate, load
from mlx_dflash.engine import calibrate
from mlx_dflash.policy import costs
from mlx_dflash.policy.base import DFLASH, CycleResult, Plan
from mlx_dflash.policy.costs import CostModel, Costs, Observed
from mlx_dflash.policy.guard import Guard
from mlx_dflash.policy.lookup_gate import LookupGate
from rows import Row

pytestmark = pytest.mark.usefixtures("fresh_costs")


def test_guard_cost_is_the_calibrated_cycle_in_plain_tokens():
    c = Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6}, t_plain=0.008)
    g = Guard(model_for(c))
    g.decide([ROW])
    assert g.kd[5] == pytest.approx((1.8 + 0.6) * 0.01 / 0.008) and g.kv[5] == pytest.approx(1.8 * 0.01 / 0.008)
    g = Guard(model_for(Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6})))  # no t_plain: t1
    g.decide([ROW])
    assert g.kd[5] == pytest.approx(2.4)


def test_guard_measures_nothing_for_fixed_widths_and_plain_rows():
    def boom():
        raise AssertionError("measured for rows that need no costs")

    g = Guard(boom)
    fixed, off = Row(cap=4, fixed=True, uid=2), Row(uid=3)
    off.plan = Plan("off")
    d = g.decide([fixed, off])
    assert d.widths == (4, 1) and d.sources == (DFLASH, "")
    assert g.reason(fixed) == "fixed width 4" and g.reason(off) == "plain: verify mode off"
    assert g.decide([off]).width == 1


def test_a_probe_starts_only_where_the_room_left_repays_it():
    g = Guard(model_for(curve_for(2.0)))  # a width-5 cycle costs 2 plain tokens: a probe that finds nothing loses 3 x 1
    row = Row()
    row.left = 8 * 3 - 1  # (PAYBACK x that, less one)
    assert due(g, (row,)) == -1 and g.reason(row).startswith("plain: too few tokens left to repay a probe")
    assert "predicted" not in g.reason(row)  # (nothing tried: the probe's prior is no prediction to quote)
    row.left = 8 * 3
    assert due(g, (row,)) == 0 and g.reason(row).startswith("dflash: probing")


def test_a_probe_prices_the_drafters_catch_up_over_the_context_it_has_not_seen():
    """A probe's first draft takes in every context row captured since the
    drafter's last draft: at a request's start, a prompt's whole window. On the
    realistic bench's targets that cost 4-6 plain steps at 1k tokens, in no price
    (bench/guard_sim/catch_up/)."""
    base = curve_for(2.0)  # a width-5 cycle costs 2 plain tokens: a probe that finds nothing loses 3 x 1
    row_cost = 0.01  # plain steps per row taken in
    curve = Costs(base.t1, base.c, base.d, t_plain=base.t_plain, u=row_cost * base.t_plain / base.t1)
    assert model_for(curve).catch_up() == pytest.approx(row_cost)
    assert model_for(base).catch_up() == 0.0  # (not measured: nothing priced)
    row = Row()
    row.left = 8 * 3  # repays the cycles alone (PAYBACK x 3)
    g = Guard(model_for(curve))
    assert due(g, (row,)) == 0  # nothing to catch up: it probes
    row.unseen = 100  # one plain step more to repay
    g = Guard(model_for(curve))
    assert due(g, (row,)) == -1
    assert g.reason(row).startswith("plain: too few tokens left to repay a probe") and \
        "the drafter's catch-up 1.00" in g.reason(row)
    row.left = 8 * (3 + 1) + 1
    g = Guard(model_for(curve))
    assert due(g, (row,)) == 0


def test_short_answers_one_after_another_still_probe():
    """A probe refused because the answer's room left cannot repay it counts the
    plain steps it waited as room: what was paid (learnt only while drafting)
    once priced a cycle above what any one short answer could repay, and every
    answer after stayed plain for good (bench/guard_sim/README.md)."""
    prior = Observed(paid={(1, True): 1.0}, excess={(1, True): [1.0] * 3})  # a width-5 cycle: 3 plain steps
    seen = []
    for _ in range(2):
        g = Guard(model_for(curve_for(2.0)), prior)
        row = Row()
        widths = []
        for left in range(40, 0, -1):  # 40 tokens: a probe's worst case, 2 plain steps a cycle, needs 48
            row.left = left
            w = g.decide([row]).width
            if w == 1:
                plain(g, 1, (row,))
            else:
                cycle(g, 4, w, (row,))
            widths.append(w)
            if w == 1 and left == 40:
                assert g.reason(row).startswith("plain: too few tokens left to repay a probe")
        seen.append(max(widths))
        prior = g.leave(row)
    assert seen[0] == 1 and seen[1] == 5  # the first answer waits; the next probes on the steps it waited


def test_a_short_answer_probes_at_the_widest_width_that_repays_it():
    """The probe's worst case is checked at each width up to the predicted one:
    where the widest cannot be repaid in the room left, a narrower one that can
    is probed; the probe ends, and the next one is judged afresh."""
    c = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.5, 8: 1.7}  # (the probe's prior predicts width 8 best)
    g = Guard(model_for(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01)))
    row = Row(cap=8)
    row.left = 15  # repays a width-5 probe (8 x 3 x 0.5 = 12) but not width 8 (8 x 3 x 0.7 = 16.8)
    d = g.decide([row])
    assert g.est[0] == 8 and d.widths == (5,) and g.reason(row).startswith("dflash: probing")
    g.observe([row], [CycleResult(5, 4, 5, source=DFLASH)])
    assert g.decide([row]).widths == (5,)  # the same probe: still at most 5 wide
    row.left = 2  # a fresh guard with less room: not even width 2 (8 x 3 x 0.1 = 2.4) repays
    h = Guard(model_for(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01)))
    assert h.decide([row]).width == 1 and h.reason(row).startswith("plain: too few tokens left to repay a probe")
    row.left = 17
    assert Guard(model_for(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01))).decide([row]).widths == (8,)


def test_guard_keeps_drafting_when_it_pays():
    g = Guard(model_for(curve_for(2.0)))
    assert due(g) == 0 and g.reason(ROW).startswith("dflash: probing")
    seq = drive(g, lambda i: 3 if i % 2 else 2, 60)  # 3.5 tokens a cycle: 1.75x
    assert seq == [5] * 60 and g.state == "draft" and g.fallbacks == 0
    assert g.speedup() > 1.4 and g.reason(ROW).startswith("dflash: ")


def test_guard_probe_is_a_sequential_test():
    """A probe starts from pseudo-tries halfway between break-even (k) and the
    width: one poor cycle ends it, cycles that pay keep it going, and it switches
    to drafting only after PROBE cycles that pay by MARGIN."""
    k = 3.2
    g = Guard(model_for(curve_for(k)))
    due(g)
    cycle(g, 0)  # nothing accepted: below break-even at once -> plain
    assert g.state == "plain" and g.wait == Guard.BACKOFF0 and g.fallbacks == 1
    g = Guard(model_for(curve_for(k)))
    due(g)
    for a in (4, 4):
        cycle(g, a)
        assert g.state == "probe"
    cycle(g, 4)
    assert g.state == "draft" and g.speedup() > Guard.MARGIN
    n = 0
    while g.state == "draft" and n < 6:  # a run of cycles that emit one token each: below break-even -> plain
        cycle(g, 0)
        n += 1
    assert g.state == "plain" and n >= 2 and g.reason(ROW).startswith("plain: DFlash 0.")
    g = Guard(model_for(curve_for(k)))
    due(g)
    for a in (2, 1, 2):  # about break-even: not by MARGIN -> plain after PROBE cycles at most
        cycle(g, a)
    assert g.state == "plain"


def test_guard_falls_back_probes_with_backoff_and_recovers():
    g = Guard(model_for(curve_for(3.0)))
    seq = drive(g, lambda i: 0, 4000)  # nothing accepted
    runs, run = [], 0
    for x in seq:
        if x < 0:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert runs[:3] == [Guard.BACKOFF0, 2 * Guard.BACKOFF0, 4 * Guard.BACKOFF0]  # doubling
    assert max(runs) == Guard.BACKOFF_MAX and g.fallbacks >= 3 and g.probes >= 3
    assert all(x == 5 for x in seq if x > 0)  # probes draft at the widest measured width
    assert sum(x > 0 for x in seq) <= 3 * g.fallbacks  # each failed probe cost at most 3 cycles
    while g.state != "plain":
        drive(g, lambda i: 0, 1)
    assert g.reason(ROW).startswith("plain: DFlash 0.")
    seq = drive(g, lambda i: 4, Guard.BACKOFF_MAX + 8)  # the text becomes draftable: drafting comes back
    assert g.state == "draft" and seq[-3:] == [5, 5, 5] and g.backoff == Guard.BACKOFF0


def test_guard_never_drafts_where_even_full_acceptance_loses():
    # a cycle = 6 plain tokens > width 5; 4.2 (bf16 on mlx-cpu): w / k = 1.19 < 1.25, only a
    # drafter right > 90% of the time could pay; 3.9: w / k = 1.28, worth probing
    for k, hopeless in ((6.0, True), (4.2, True), (3.9, False)):
        g = Guard(model_for(curve_for(k)), Observed(p=[0.95] * 4))
        assert g.uses_drafter(ROW.plan, 0) == (not hopeless)
        if not hopeless:
            assert due(g) == 0 and g.state == "draft"
            continue
        assert due(g) == -1 and "cannot pay" in g.reason(ROW)
        for _ in range(5):  # plain for good: it never probes
            plain(g, Guard.BACKOFF_MAX)
            assert due(g) == -1 and g.probes == 0
        assert g.leave(ROW).wait == 0  # nothing to carry: the next request decides the same from the costs


def test_guard_prior_carries_acceptance_and_backoff():
    g = Guard(model_for(curve_for(3.0)), Observed(p=[0.5] * 4, backoff=64, wait=40))
    assert due(g) == -1 and g.wait == 40  # the last request ended plain: this one continues it
    o = g.leave(ROW)
    assert o.backoff == 64 and o.wait == 40
    g = Guard(model_for(curve_for(3.0)), Observed(p=[0.95] * 4))
    assert due(g) == 0 and g.state == "draft" and g.speedup() > 1
    assert g.leave(Row(carry=False)) is None  # (a seeded row's state is not carried)


def _multi(c, d, tp=0.01):
    """A curve measured at several widths: c, d dicts over the same widths (1 included)."""
    return Costs(0.01, c, d, t_plain=tp)


def test_guard_chooses_the_width_that_pays_best():
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.05 * (w - 1) for w in ws}  # a cheap verify (memory-bound target)
    d = {w: 0.0 if w == 1 else 0.2 for w in ws}
    row = Row(cap=8)
    g = Guard(model_for(_multi(c, d)))
    assert g.decide([row]).widths == (8,)  # the probe's prior: the widest
    for _ in range(12):  # every draft accepted: the widest block pays best
        cycle(g, 7, 8, [row])
    assert g.state == "draft" and g.decide([row]).widths == (8,) and g.speedup() > 3
    for _ in range(40):  # the first draft right, the second wrong: two-token blocks are the most a cycle emits
        cycle(g, 1, g.decide([row]).width, [row])
    x = g.decide([row]).width
    assert x in (2, 3)
    assert g.widths[8] >= 12 and sum(v for w, v in g.widths.items() if w < 8) > 0
    o = g.leave(row)
    assert o.p is not None and len(o.p) == 7 and o.p[0] > 0.9 and o.p[1] < 0.2
    nxt = Guard(model_for(_multi(c, d)), o)  # the next request starts where this one left off
    assert nxt.decide([row]).width == x and nxt.state == "draft"


def test_the_last_block_is_cut_to_the_answer_and_drafts_only_where_that_pays():
    """A cycle yields at most the tokens left of the answer: the guard drafts no
    wider than that (a fixed width verifies one row more, as the published
    loops do), and where the width it is cut to cannot pay (a 2-row cycle
    priced above 2 plain tokens) it steps plainly; the last token is plain."""
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.15 * (w - 1) for w in ws}
    d = {w: 0.0 if w == 1 else 1.0 for w in ws}  # k(2) = 2.15 > 2: a 2-row cycle never pays; k(3) = 2.3
    row = Row(cap=8)
    g = Guard(model_for(_multi(c, d)))
    for _ in range(12):  # every draft accepted: drafting at the widest width
        cycle(g, 7, g.decide([row]).width, [row])
    assert g.state == "draft" and g.decide([row]).widths == (8,) and g.kd[2] > 2 > g.kd[3] - 1
    for left, want in ((8, 8), (7, 7), (6, 6), (3, 3), (2, 1), (1, 1)):
        row.left = left
        assert g.decide([row]).widths == (want,), left
    fixed = Row(cap=8, fixed=True)
    fixed.left = 3
    assert g.decide([fixed]).widths == (4,)
    # drafts right 80% of the time, a dearer drafter: 8 rows pay (4.2 tokens for 3.55), 5 barely
    # (3.4 for 3.1), 3 do not (2.4 for 2.8)
    h = Guard(model_for(_multi(c, {w: 0.0 if w == 1 else 1.5 for w in ws})), Observed(p=[0.8] * 7, tries=[50.0] * 7))
    row.left = 10**6
    assert h.decide([row]).widths == (8,) and h.state == "draft"
    row.left = 5
    assert h.decide([row]).widths == (5,)
    row.left = 3
    assert h.decide([row]).width == 1


def test_guard_with_several_widths_still_falls_back_and_never_drafts_where_none_pays():
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.25 * (w - 1) for w in ws}  # a verify of 8 costs 2.75 steps, a draft 0.6
    d = {w: 0.0 if w == 1 else 0.6 for w in ws}
    row = Row(cap=8)
    g = Guard(model_for(_multi(c, d)))
    cycles = 0
    while g.decide([row]).width > 1 and cycles < 10:  # nothing accepted: no width pays
        cycle(g, 0, g.decide([row]).width, [row])
        cycles += 1
    assert cycles <= 4 and g.state == "plain" and g.wait == Guard.BACKOFF0 and g.fallbacks == 1
    assert g.reason(row).startswith("plain: DFlash") and g.reason(row).endswith("probe in 64")
    dear = {w: 0.0 if w == 1 else 0.9 * w for w in ws}  # drafting costs more than any block can emit
    h = Guard(model_for(_multi(c, dear)))
    assert h.decide([row]).width == 1 and h.hopeless and "cannot pay" in h.reason(row)


def test_guard_prices_positions_past_a_narrow_width_from_the_ones_it_tried():
    """Drafting narrow, a row's later positions are never tried: they are priced
    like the positions that were (the row's pooled rate), not held at a stale
    value. A stretch of bad luck narrows the width; once the drafts are right
    again the guard widens, and no position keeps its old low estimate."""
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.05 * (w - 1) for w in ws}  # a cheap verify: wide blocks pay when drafts are right
    d = {w: 0.0 if w == 1 else 0.2 for w in ws}
    row = Row(cap=8)
    g = Guard(model_for(_multi(c, d)))
    for _ in range(6):
        cycle(g, 7, g.decide([row]).width, [row])
    assert g.state == "draft" and g.decide([row]).width == 8
    for _ in range(40):  # every draft past the first wrong: it narrows
        cycle(g, 1, g.decide([row]).width, [row])
    assert g.decide([row]).width <= 3
    widths = []
    for _ in range(30):  # every draft right again
        w = g.decide([row]).width
        widths.append(w)
        cycle(g, w - 1, w, [row])
    assert widths[-1] == 8 and widths.index(8) < 20
    est = g._p(g.rows[row.uid])
    assert min(est) > 0.8  # no position left behind at its old low value


def test_guard_does_not_keep_probing_a_drafter_right_half_the_time():
    """Where plain decoding is best (each draft right one time in two: tau at
    width 2 is 1.5, a cycle costs over 2 steps), a probe ends within a few cycles and
    backs off, whichever width its optimistic start picks: drafting costs a few
    percent of the tokens at most, never a steady loss."""
    ws = (1, 2, 3, 5, 8)
    c = {w: 1.5 + 0.15 * (w - 1) for w in ws}
    d = {w: 0.0 if w == 1 else 0.5 for w in ws}
    rng = random.Random(0)
    row = Row(cap=8)
    g = Guard(model_for(_multi(c, d)))
    cost = tokens = 0.0
    while tokens < 2000:
        w = g.decide([row]).width
        if w == 1:
            plain(g, 1, [row])
            cost, tokens = cost + 1, tokens + 1
            continue
        a = 0
        while a < w - 1 and rng.random() < 0.5:
            a += 1
        cycle(g, a, w, [row])
        cost, tokens = cost + g.priced[0][w], tokens + a + 1
    assert tokens / cost > 0.97  # plain: 1.0
    assert g.fallbacks >= 3 and g.backoff > Guard.BACKOFF0


def test_guard_prices_cycles_at_the_length_of_the_context():
    """Two curves, measured over 128 and 4096 cached tokens: the cycle cost at any
    length is linear between (and past) them, and the guard follows it as the
    context grows (a verify's attention reads grow with the context, a plain step's too)."""
    short = Costs(0.010, {1: 1.0, 5: 1.2}, {1: 0.0, 5: 0.3}, context=128, t_plain=0.010)
    long = Costs(0.020, {1: 1.0, 5: 2.4}, {1: 0.0, 5: 0.3}, context=4096, t_plain=0.020)  # drafts dearer at length
    m = model_for(short, long)
    assert m.k(1, 128)[5] == pytest.approx(1.5)
    assert m.k(1, 4096)[5] == pytest.approx(2.7)
    assert m.k(1, 2112)[5] == pytest.approx((0.5 * (0.015 + 0.054)) / 0.015, rel=0.05)  # seconds interpolated
    g = Guard(m)
    near = Row(context=128)
    for _ in range(6):
        g.decide([near])
        cycle(g, 1, rows=[near])  # 2 tokens a cycle: pays at 1.5, not at 2.7
    assert g.state == "draft"
    far = Row(context=4096)
    g.decide([far])
    cycle(g, 1, rows=[far])
    assert g.state == "plain" and "cycle = 2.70" in g.reason(far)


def test_guard_decides_for_a_set_by_its_mean_and_the_batch_cost():
    """Several rows: one width for the set, the one that pays best for their mean
    tokens per cycle at k(w, B); a row with a fixed width keeps it inside the
    same cycle; each row's lookup gate is its own."""
    ws = (1, 2, 3, 5, 8)
    single = _multi({w: 1 + 0.05 * (w - 1) for w in ws}, {w: 0.0 if w == 1 else 0.2 for w in ws})
    batched = Costs(1.0, {w: 1 + 0.5 * (w - 1) for w in ws}, {w: 0.0 if w == 1 else 0.4 for w in ws})
    m = CostModel(lambda at: single, list(ws), batch=lambda B: batched)
    a, b, f = Row(cap=8, uid=1), Row(cap=8, uid=2), Row(cap=3, uid=3, fixed=True)
    g = Guard(m)
    d = g.decide([a, b, f])
    assert d.widths[2] == 3 and d.sources == (DFLASH, DFLASH, DFLASH)
    assert g.kd[8] == pytest.approx(1 + 0.5 * 7 + 0.4)  # the batch's cost at B = 3
    for _ in range(6):  # row a accepts everything, row b nothing: the mean pays at a narrow width
        g.observe([a, b, f], [CycleResult(d.widths[0], d.widths[0] - 1, d.widths[0], source=DFLASH),
                              CycleResult(d.widths[1], 0, 1, source=DFLASH),
                              CycleResult(3, 2, 3, source=DFLASH)])
        d = g.decide([a, b, f])
    assert d.widths[2] == 3 and (d.widths[0] < 8 or g.state == "plain")
    gate = LookupGate()
    assert gate.pays(4, 4, {5: 1.0}) and not gate.pays(4, 4, {5: 4.0})


@pytest.mark.slow
def test_default_mode_guard_in_the_loop(pairs):
    """An always-wrong drafter: the default mode (no block size) ends up on plain
    steps and says why; an explicit width, or guard=False, drafts every cycle.
    All of them give mlx-lm's tokens."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt, n = PROMPTS[0], 60
    ref = reference_tokens(model, tok, prompt, n)
    p = len(tok.encode(prompt))
    wrong = OracleDrafter(p, ref, model.args.vocab_size, noise=1.0)
    # a cycle costs 2 plain tokens, whatever the machine's load does to a measurement
    calibrate.remember(model, wrong, curve_for(2.0))
    r = generate(model, tok, prompt, wrong, max_tokens=n)
    assert r.token_ids == ref and r.stats.mode == "dflash" and r.stats.max_width == wrong.block_size
    assert r.stats.plain_cycles > r.stats.cycles // 2 and r.stats.policy.startswith("plain: DFlash 0.")
    assert r.stats.to_dict()["policy"] == r.stats.policy and r.stats.adaptive["fallbacks"] >= 1
    for kw in (dict(block_size=4), dict(guard=False)):
        r = generate(model, tok, prompt, OracleDrafter(p, ref, model.args.vocab_size, noise=1.0), max_tokens=n, **kw)
        # (only the last cycle may verify the anchor alone: no drafting past max_tokens)
        assert r.token_ids == ref and r.stats.plain_cycles <= 1 and r.stats.policy.startswith("fixed width")
    # a right drafter in the default mode keeps drafting
    right = OracleDrafter(p, ref, model.args.vocab_size)
    calibrate.remember(model, right, curve_for(2.0))  # the same fixed costs: the guard decides, not the load
    r = generate(model, tok, prompt, right, max_tokens=n)
    # (a few plain steps time the unit of prices as paid, once: Guard._untimed)
    assert r.token_ids == ref and r.stats.plain_cycles <= 1 + 4 and r.stats.tau > 3.5
    r = generate(model, tok, prompt, right, max_tokens=n)  # what was paid carries on: no plain step
    assert r.token_ids == ref and r.stats.plain_cycles <= 1 and r.stats.tau > 4, r.stats.plain_cycles


@pytest.mark.slow
def test_guard_calibration_is_small_and_cached(pairs, monkeypatch):
    """The default mode measures the widths it chooses among (up to the drafter's
    block size) once, then reads the cache."""
    from mlx_dflash.policy.registry import GUARD_WIDTHS

    d = pairs("qwen3", version=2)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    r = generate(model, tok, PROMPTS[1], drafter, max_tokens=8)
    key = costs.cost_key(model, drafter)
    curve = costs.load_cached(key, widths=(1, 5))
    want = {1, drafter.block_size} | {w for w in GUARD_WIDTHS if w < drafter.block_size}
    assert curve is not None and set(curve.c) == want and curve.t_plain > 0 and curve.d[5] > 0 and curve.u > 0
    assert r.stats.policy

    def boom(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())
    monkeypatch.setattr(calibrate, "measure_costs", boom)
    generate(model, tok, PROMPTS[2], drafter, max_tokens=8)
