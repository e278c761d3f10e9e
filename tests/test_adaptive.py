"""Adaptive verify width (policy.AdaptiveWidth) and the default-mode guard
(policy.Guard): lossless, fall back and re-probe, follow their cost models
(pure tests, no model); calibration caches its measurements (calibrate.py)."""

import json
import random

import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import generate
from mlx_dflash.engine import calibrate
from mlx_dflash.policy import costs
from mlx_dflash import load, stream_generate
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.adaptive import AdaptiveWidth
from mlx_dflash.policy.base import DFLASH, CycleResult, Plan

PROMPTS = ["def fibonacci(n):", "Natalia sold clips to 48 of her friends", "import os\nimport sys\n",
           "class Stack:\n    def push(self, x):", "The answer is", "while True:"]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Cost curves go to a temporary cache dir, measured afresh per test."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())



def _cycles(model, tok, prompt, drafter, **kw):
    """Token ids, the distinct cycles in order, and the final stats."""
    ids, cycles, r = [], [], None
    for r in stream_generate(model, tok, prompt, drafter, **kw):
        if not (r.finish_reason == "stop" and r.token in tok.eos_token_ids):
            ids.append(r.token)
        if r.cycle is not None and (not cycles or cycles[-1] is not r.cycle):
            cycles.append(r.cycle)
    return ids, cycles, r.stats


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_adaptive_greedy_equals_mlx_lm(pairs, version):
    d = pairs("qwen3", version=version)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    vocab = model.args.vocab_size
    widths = set()
    for i, prompt in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, prompt, 32)
        for w in (5, 8):
            r = generate(model, tok, prompt, drafter, max_tokens=32, block_size=w, verify_mode="adaptive")
            assert r.token_ids == ref, (prompt, w)
            assert r.stats.mode == "adaptive" and r.stats.adaptive["state"] in ("dflash", "fallback")
            # a partly right drafter: cycles draft, cut, accept some and reject some
            o = OracleDrafter(len(tok.encode(prompt)), ref, vocab, noise=0.3, seed=i * 7 + w)
            # a cheap verify (c(8) = 1.35): drafting pays whatever the machine's load does to a measurement
            calibrate.remember(model, o, Costs(0.01, {k: 1 + 0.05 * (k - 1) for k in range(1, 9)}, {k: 0.0 for k in range(1, 9)}))
            ids, cycles, st = _cycles(model, tok, prompt, o, max_tokens=32, block_size=w, verify_mode="adaptive")
            assert ids == ref, (prompt, w, "oracle")
            assert st.accepted > 0
            widths |= {c.width for c in cycles}
            assert all(1 <= c.width <= w for c in cycles)
    assert 1 not in widths or len(widths) > 1  # not stuck on plain steps
    assert max(widths) > 2


@pytest.mark.slow
def test_always_wrong_drafter_falls_back_and_reprobes(pairs):
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt, n = PROMPTS[0], 120
    ref = reference_tokens(model, tok, prompt, n)
    # a drafter that costs about one target step, as a real one does: cutting every
    # draft still pays for drafting, so only falling back to plain steps stops the loss
    # (a free drafter would make plain steps and cut cycles cost the same, and which the
    # policy settles on a matter of timing noise)
    o = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size, noise=1.0, delay=0.003)
    calibrate.remember(model, o, Costs(0.01, {w: 1 + 0.25 * (w - 1) for w in range(1, 6)}, {w: 0.0 for w in range(1, 6)}))
    ids, cycles, st = _cycles(model, tok, prompt, o, max_tokens=n, block_size=5, verify_mode="adaptive")
    assert ids == ref
    assert st.accepted == 0 and st.plain_cycles >= AdaptiveWidth.BACKOFF0
    assert st.adaptive["fallbacks"] >= 1 and st.adaptive["probes"] >= 2
    w = [c.width for c in cycles]
    runs = [len(r) for r in "".join("p" if x == 1 else "d" for x in w).split("d") if r]
    # plain runs between probes double (8, 16, 32, ...): the first fallback may start
    # inside a run, and the last is cut short by max_tokens
    assert any(r >= AdaptiveWidth.BACKOFF0 for r in runs) and max(runs) >= 2 * AdaptiveWidth.BACKOFF0
    assert max(w[w.index(1):]) > 1  # re-probed after falling back
    assert st.t_draft >= o.proposed * o.delay  # every draft is paid for, verified or cut


def test_a_draft_cut_to_nothing_is_still_paid(pairs):
    """A verify so dear that the cut keeps no draft (a probe aside): such a cycle
    is a plain step that paid for a draft, and the policy sees that cost (so it
    falls back)."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt, n = PROMPTS[1], 40
    ref = reference_tokens(model, tok, prompt, n)
    o = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size, delay=0.003)
    calibrate.remember(model, o, Costs(0.01, {1: 1.0, **{w: 100.0 for w in range(2, 6)}}, {w: 0.0 for w in range(1, 6)}))
    ids, cycles, st = _cycles(model, tok, prompt, o, max_tokens=n, block_size=5, verify_mode="adaptive")
    assert ids == ref and o.proposed > 0
    assert st.t_draft >= o.proposed * o.delay
    assert st.adaptive["fallbacks"] >= 1


def test_probe_decided_between_two_tokens_is_judged_on_its_own_cycle():
    """The engine asks for the next decision before the plain token in flight
    is read back: that token's step is no probe, the cycle after it is."""
    pol = _policy([1, 1.1, 1.2, 1.3, 1.4], [0, .1, .1, .1, .1], [0.1] * 5)
    pol.state, pol.wait = "fallback", 1
    row = Row()
    assert pol.decide([row]).width == 1
    pol.observe([row], [CycleResult(1, 0, 1)])  # the last plain step of the wait
    w = pol.decide([row]).widths[0]  # the probe, asked between two tokens
    assert w > 1 and pol.probing
    pol.observe([row], [CycleResult(1, 0, 1)])  # the token in flight, read back
    assert pol.probing and pol.probes == 0 and pol.state == "fallback"
    pol.trim(row, [7] * (w - 1), [0.9] * (w - 1))
    pol.observe([row], [CycleResult(w, w - 1, w)])  # the probe: every draft accepted
    assert pol.probes == 1 and pol.state == "dflash"


def _policy(c, d, p, max_width=None, **kw):
    costs = Costs(1.0, dict(enumerate(c, 1)), dict(enumerate(d, 1)))
    pol = AdaptiveWidth(costs, max_width or len(c), online=False, **kw)
    pol.p = list(p)
    return pol


def _rate(a, cv, dw):
    """Independent E[emitted] / cost: 1 + a1 + a1*a2 + ... over c(n+1) + d(W)."""
    e, run = 1.0, 1.0
    for x in a:
        run *= x
        e += run
    return e / (cv + dw)


@pytest.mark.parametrize("c,d,p", [
    ([1, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8], [0, .3, .32, .34, .36, .4, .45, .5], [0.9] * 8),  # cheap verify
    ([1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5], [0, .3, .32, .34, .36, .4, .45, .5], [0.9] * 8),  # compute-bound verify
    ([1, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8], [0, .3, .32, .34, .36, .4, .45, .5], [.9, .8, .5, .3, .2, .1, .1, .1]),
    ([1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], [0, .1, .6, .7, .8, 1.6, 1.7, 1.8], [0.95] * 8),  # draft cost jumps
])
def test_width_choice_follows_cost_model(c, d, p):
    pol = _policy(c, d, p)
    want = max(range(2, len(c) + 1), key=lambda w: _rate(p[: w - 1], c[w - 1], d[w - 1]))
    w, s = pol.plan()
    assert w == want
    assert s == pytest.approx(_rate(p[: w - 1], c[w - 1], d[w - 1]) * c[0])
    assert pol.width() == want
    # the cut: drafts the drafter doubts are not worth verifying
    conf = [0.97, 0.95, 0.05, 0.95, 0.9, 0.9, 0.9]
    n = pol.trim(None, [1] * 7, conf)
    a = [pol.calib(x) for x in conf]
    want_n = max(range(8), key=lambda k: (_rate(a[:k], c[k], d[7]), k))
    assert n == want_n and n <= 2  # never past the doubtful third draft


def test_cut_uses_recent_acceptance():
    """Confident drafts that keep failing stop being verified (once even one
    draft costs more than its calibrated chance is worth)."""
    pol = _policy([1, 1.2, 1.3, 1.4, 1.5], [0, .2, .22, .24, .26], [0.9] * 5)
    pol.PATIENCE = 10**6  # this test is about the cut, not the fallback
    conf = [0.95] * 4
    assert pol.trim(None, [1] * 4, conf) == 4
    for _ in range(40):
        pol.width()
        n = pol.trim(None, [1] * 4, conf)
        pol.observe(None, [CycleResult(n + 1, 0, 1, conf=conf[:n])])
    assert pol.trim(None, [1] * 4, conf) == 0


def test_fallback_is_reversible_with_backoff():
    pol = _policy([1, 1.05, 1.1, 1.15, 1.2], [0, .2, .22, .24, .26], [0.9] * 5)
    bad, good = [0.95] * 4, [0.95] * 4

    def cycle(accepted_all):
        w = pol.width()
        if w == 1:
            pol.observe(None, [CycleResult(1, 0, 1)])
            return 1
        conf = good if accepted_all else bad
        n = pol.trim(None, [1] * (w - 1), conf)
        pol.observe(None, [CycleResult(n + 1, n if accepted_all else 0, 1, conf=conf[:n])])
        return w

    seq = [cycle(False) for _ in range(80)]
    assert pol.state == "fallback" and pol.fallbacks == 1
    plain_runs, run = [], 0
    for w in seq[seq.index(1):]:
        if w == 1:
            run += 1
        else:
            plain_runs.append(run)
            run = 0
    assert plain_runs[:2] == [AdaptiveWidth.BACKOFF0, 2 * AdaptiveWidth.BACKOFF0]  # exponential backoff
    fresh = pol.plan([pol.prior] * pol.max_width)[0]
    assert all(w == fresh for w in seq[seq.index(1):] if w > 1)  # probes draft as a fresh policy would
    # the drafter becomes right again: the next probe brings DFlash back
    for _ in range(AdaptiveWidth.BACKOFF_MAX + 1):  # until the next probe
        if cycle(True) > 1:
            break
    assert pol.state == "dflash" and pol.backoff == AdaptiveWidth.BACKOFF0
    assert cycle(True) > 1


@pytest.mark.slow
def test_cost_cache_round_trip(pairs, tmp_path, monkeypatch):
    d = pairs("qwen3", version=2)
    model, _, drafter = load(str(d / "target"), str(d / "drafter"))
    curve = calibrate.get_costs(model, drafter, max_width=4)
    assert curve.c[1] == 1.0 and set(curve.c) == {1, 2, 3, 4} and curve.d[1] == 0.0
    assert all(curve.d[w] > 0 for w in (2, 3, 4))
    key = costs.cost_key(model, drafter)
    path = costs.cost_path(key)
    assert path.is_relative_to(tmp_path / "cache") and path.exists()
    assert json.loads(path.read_text())["key"] == key
    assert costs.load_cached(key, 4) == curve
    assert costs.load_cached(key, 5) is None  # wider than measured: measure again
    old = Costs(curve.t1, curve.c, curve.d, curve.context, curve.measured_at - 40 * 86400)
    costs.save_cached(key, old)
    assert costs.load_cached(key, 4) is None  # too old: measure again
    costs.save_cached(key, curve)

    def boom(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())
    monkeypatch.setattr(calibrate, "measure_costs", boom)
    assert calibrate.get_costs(model, drafter, max_width=3) == curve  # from the file
    # another model (or machine) has another key
    other, _, _ = load(str(pairs("qwen3", version=1, hidden=128) / "target"))
    assert costs.cost_key(other, drafter) != key
    key2 = dict(key, machine=dict(key["machine"], blas="reference"))
    assert costs.cost_path(key2) != path
    # a corrupt file is measured again, not an error
    path.write_text("{not json")
    assert costs.load_cached(key, 4) is None


# -- the default mode's guard (policy.guard.Guard): pure, no model ------------------------

from mlx_dflash.policy.costs import CostModel, Observed  # noqa: E402
from mlx_dflash.policy.guard import Guard, LookupGate  # noqa: E402


def _costs(k, w=5):
    """A curve whose width-w cycle costs k plain tokens (a plain token 0.8 of a
    1-token step, as pipelining gives; verify and draft split 3:1)."""
    t1, tp = 0.01, 0.008
    steps = k * tp / t1
    return Costs(t1, {1: 1.0, w: 0.75 * steps}, {1: 0.0, w: 0.25 * steps}, t_plain=tp)


def _model(base, long=None):
    """The CostModel of one curve (and a long-context one)."""
    return CostModel(lambda at: base if at is None else long, sorted(base.c),
                     priced_at=(lambda n: None) if long is None else (lambda n: long.context if n > 512 else None))


class Row:
    """A guarded row as the guard sees it (policy.base.Row)."""

    def __init__(self, cap=5, uid=1, context=0, fixed=False, lookup=False, offer=0, carry=True):
        self.uid, self.context, self.left, self.offer = uid, context, 10**6, offer
        self.plan = Plan("dflash", cap, fixed, True, lookup, carry=carry)

    def offers(self, source, n):
        return n if source == DFLASH else min(n, self.offer)


ROW = Row()


def _due(g, rows=(ROW,)) -> int:
    """0 when the guard drafts now, else -1 (plain steps)."""
    return 0 if g.decide(list(rows)).width > 1 else -1


def _cycle(g, accepted, w=5, rows=(ROW,)):
    """A DFlash cycle at width w in which each row accepted `accepted` drafts."""
    g.observe(list(rows), [CycleResult(w, accepted, accepted + 1, source=DFLASH) for _ in rows])


def _plain(g, k, rows=(ROW,)):
    for _ in range(k):
        g.observe(list(rows), [CycleResult(1, 0, 1) for _ in rows])


def _drive(g, accepted, cycles, rows=(ROW,)):
    """Run the guard's loop for `cycles` decisions, each draft cycle accepting
    `accepted(i)` drafts per row. Returns the decisions: a width, or -1 per plain step."""
    seq = []
    for i in range(cycles):
        d = g.decide(list(rows))
        if d.width == 1:
            _plain(g, 1, rows)
            seq.append(-1)
        else:
            assert set(d.sources) == {DFLASH}
            _cycle(g, accepted(i), d.width, rows)
            seq.append(d.width)
    return seq


def test_guard_cost_is_the_calibrated_cycle_in_plain_tokens():
    c = Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6}, t_plain=0.008)
    g = Guard(_model(c))
    g.decide([ROW])
    assert g.kd[5] == pytest.approx((1.8 + 0.6) * 0.01 / 0.008) and g.kv[5] == pytest.approx(1.8 * 0.01 / 0.008)
    g = Guard(_model(Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6})))  # no t_plain: t1
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


def _step(g, w, secs, rows=(ROW,), accepted=0):
    """One step the engine accounted `secs` after its previous one (CycleResult.t_step)."""
    g.decide(list(rows))
    src = DFLASH if w > 1 else ""
    g.observe(list(rows), [CycleResult(w, accepted, accepted + 1, source=src, t_step=secs) for _ in rows])


def test_prices_are_raised_to_what_the_cycles_paid():
    """Cycles that take longer than k(w) x the set's plain step raise every price
    at that set size (by the median ratio, beyond SLACK); the ratio carries to the
    next request; the first cycle after plain steps (the drafter's catch-up) and
    steps of another set of rows are left out."""
    g = Guard(_model(_costs(2.0)))
    rows = (Row(uid=1), Row(uid=2))
    for _ in range(4):
        _step(g, 1, 0.010, rows)  # plain steps at 2 rows: 10 ms
    assert g.paid == {}
    k5 = g.priced[0][5]
    _step(g, 5, 100.0, rows, accepted=4)  # right after plain steps: the catch-up cycle, left out
    assert g.paid == {}
    for secs in (0.010 * k5 * 1.6, 0.010 * k5 * 1.4, 0.010 * k5 * 9.0):
        _step(g, 5, secs, rows, accepted=4)
    assert g.paid[(2, True)] == pytest.approx(1.6)  # the median of 1.6, 1.4 and 9
    g.decide(list(rows))
    assert g.kd[5] == pytest.approx(1.6 * k5) and g.kv[5] == pytest.approx(g.priced[1][5])  # (lookup apart)
    assert "1.60x its measured price as paid" in g.reason(rows[0])
    assert g.decide([ROW]) and g.kd[5] == pytest.approx(g.model.k(1, 0, True)[5])  # one row: its own price
    o = g.leave(rows[0])
    h = Guard(_model(_costs(2.0)), o)
    h.decide(list(rows))
    assert h.kd[5] == pytest.approx(1.6 * k5)  # the next request starts from what was paid
    # within SLACK, the measured price stands; unknown step times (0) are not samples
    q = Guard(_model(_costs(2.0)))
    for _ in range(4):
        _step(q, 1, 0.010, rows)
    for secs in (0.010 * k5 * 5, 0.0, 0.0, 0.010 * k5 * 1.1):  # (the catch-up, two unknown, one sample)
        _step(q, 5, secs, rows, accepted=4)
    q.decide(list(rows))
    assert q.paid[(2, True)] == pytest.approx(1.1) and q.kd[5] == pytest.approx(k5)


def test_a_probe_starts_only_where_the_room_left_repays_it():
    g = Guard(_model(_costs(2.0)))  # a width-5 cycle costs 2 plain tokens: a probe that finds nothing loses 3 x 1
    row = Row()
    row.left = 8 * 3 - 1  # (PAYBACK x that, less one)
    assert _due(g, (row,)) == -1 and g.reason(row).startswith("plain: too few tokens left to repay a probe")
    row.left = 8 * 3
    assert _due(g, (row,)) == 0 and g.reason(row).startswith("dflash: probing")


def test_a_short_answer_probes_at_the_widest_width_that_repays_it():
    """The probe's worst case is checked at each width up to the predicted one:
    where the widest cannot be repaid in the room left, a narrower one that can
    is probed; the probe ends, and the next one is judged afresh."""
    c = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.5, 8: 1.7}  # (the probe's prior predicts width 8 best)
    g = Guard(_model(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01)))
    row = Row(cap=8)
    row.left = 15  # repays a width-5 probe (8 x 3 x 0.5 = 12) but not width 8 (8 x 3 x 0.7 = 16.8)
    d = g.decide([row])
    assert g.est[0] == 8 and d.widths == (5,) and g.reason(row).startswith("dflash: probing")
    g.observe([row], [CycleResult(5, 4, 5, source=DFLASH)])
    assert g.decide([row]).widths == (5,)  # the same probe: still at most 5 wide
    row.left = 2  # a fresh guard with less room: not even width 2 (8 x 3 x 0.1 = 2.4) repays
    h = Guard(_model(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01)))
    assert h.decide([row]).width == 1 and h.reason(row).startswith("plain: too few tokens left to repay a probe")
    row.left = 17
    assert Guard(_model(Costs(0.01, c, {w: 0.0 for w in c}, t_plain=0.01))).decide([row]).widths == (8,)


def test_guard_keeps_drafting_when_it_pays():
    g = Guard(_model(_costs(2.0)))
    assert _due(g) == 0 and g.reason(ROW).startswith("dflash: probing")
    seq = _drive(g, lambda i: 3 if i % 2 else 2, 60)  # 3.5 tokens a cycle: 1.75x
    assert seq == [5] * 60 and g.state == "draft" and g.fallbacks == 0
    assert g.speedup() > 1.4 and g.reason(ROW).startswith("dflash: ")


def test_guard_probe_is_a_sequential_test():
    """A probe starts from pseudo-tries halfway between break-even (k) and the
    width: one poor cycle ends it, cycles that pay keep it going, and it switches
    to drafting only after PROBE cycles that pay by MARGIN."""
    k = 3.2
    g = Guard(_model(_costs(k)))
    _due(g)
    _cycle(g, 0)  # nothing accepted: below break-even at once -> plain
    assert g.state == "plain" and g.wait == Guard.BACKOFF0 and g.fallbacks == 1
    g = Guard(_model(_costs(k)))
    _due(g)
    for a in (4, 4):
        _cycle(g, a)
        assert g.state == "probe"
    _cycle(g, 4)
    assert g.state == "draft" and g.speedup() > Guard.MARGIN
    n = 0
    while g.state == "draft" and n < 6:  # a run of cycles that emit one token each: below break-even -> plain
        _cycle(g, 0)
        n += 1
    assert g.state == "plain" and n >= 2 and g.reason(ROW).startswith("plain: DFlash 0.")
    g = Guard(_model(_costs(k)))
    _due(g)
    for a in (2, 1, 2):  # about break-even: not by MARGIN -> plain after PROBE cycles at most
        _cycle(g, a)
    assert g.state == "plain"


def test_guard_falls_back_probes_with_backoff_and_recovers():
    g = Guard(_model(_costs(3.0)))
    seq = _drive(g, lambda i: 0, 4000)  # nothing accepted
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
        _drive(g, lambda i: 0, 1)
    assert g.reason(ROW).startswith("plain: DFlash 0.")
    seq = _drive(g, lambda i: 4, Guard.BACKOFF_MAX + 8)  # the text becomes draftable: drafting comes back
    assert g.state == "draft" and seq[-3:] == [5, 5, 5] and g.backoff == Guard.BACKOFF0


def test_guard_never_drafts_where_even_full_acceptance_loses():
    # a cycle = 6 plain tokens > width 5; 4.2 (bf16 on mlx-cpu): w / k = 1.19 < 1.25, only a
    # drafter right > 90% of the time could pay; 3.9: w / k = 1.28, worth probing
    for k, hopeless in ((6.0, True), (4.2, True), (3.9, False)):
        g = Guard(_model(_costs(k)), Observed(p=[0.95] * 4))
        assert g.uses_drafter(ROW.plan, 0) == (not hopeless)
        if not hopeless:
            assert _due(g) == 0 and g.state == "draft"
            continue
        assert _due(g) == -1 and "cannot pay" in g.reason(ROW)
        for _ in range(5):  # plain for good: it never probes
            _plain(g, Guard.BACKOFF_MAX)
            assert _due(g) == -1 and g.probes == 0
        assert g.leave(ROW).wait == 0  # nothing to carry: the next request decides the same from the costs


def test_guard_prior_carries_acceptance_and_backoff():
    g = Guard(_model(_costs(3.0)), Observed(p=[0.5] * 4, backoff=64, wait=40))
    assert _due(g) == -1 and g.wait == 40  # the last request ended plain: this one continues it
    o = g.leave(ROW)
    assert o.backoff == 64 and o.wait == 40
    g = Guard(_model(_costs(3.0)), Observed(p=[0.95] * 4))
    assert _due(g) == 0 and g.state == "draft" and g.speedup() > 1
    assert g.leave(Row(carry=False)) is None  # (a seeded row's state is not carried)


def _multi(c, d, tp=0.01):
    """A curve measured at several widths: c, d dicts over the same widths (1 included)."""
    return Costs(0.01, c, d, t_plain=tp)


def test_guard_chooses_the_width_that_pays_best():
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.05 * (w - 1) for w in ws}  # a cheap verify (memory-bound target)
    d = {w: 0.0 if w == 1 else 0.2 for w in ws}
    row = Row(cap=8)
    g = Guard(_model(_multi(c, d)))
    assert g.decide([row]).widths == (8,)  # the probe's prior: the widest
    for _ in range(12):  # every draft accepted: the widest block pays best
        _cycle(g, 7, 8, [row])
    assert g.state == "draft" and g.decide([row]).widths == (8,) and g.speedup() > 3
    for _ in range(40):  # the first draft right, the second wrong: two-token blocks are the most a cycle emits
        _cycle(g, 1, g.decide([row]).width, [row])
    x = g.decide([row]).width
    assert x in (2, 3)
    assert g.widths[8] >= 12 and sum(v for w, v in g.widths.items() if w < 8) > 0
    o = g.leave(row)
    assert o.p is not None and len(o.p) == 7 and o.p[0] > 0.9 and o.p[1] < 0.2
    nxt = Guard(_model(_multi(c, d)), o)  # the next request starts where this one left off
    assert nxt.decide([row]).width == x and nxt.state == "draft"


def test_guard_with_several_widths_still_falls_back_and_never_drafts_where_none_pays():
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.25 * (w - 1) for w in ws}  # a verify of 8 costs 2.75 steps, a draft 0.6
    d = {w: 0.0 if w == 1 else 0.6 for w in ws}
    row = Row(cap=8)
    g = Guard(_model(_multi(c, d)))
    cycles = 0
    while g.decide([row]).width > 1 and cycles < 10:  # nothing accepted: no width pays
        _cycle(g, 0, g.decide([row]).width, [row])
        cycles += 1
    assert cycles <= 4 and g.state == "plain" and g.wait == Guard.BACKOFF0 and g.fallbacks == 1
    assert g.reason(row).startswith("plain: DFlash") and g.reason(row).endswith("probe in 64")
    dear = {w: 0.0 if w == 1 else 0.9 * w for w in ws}  # drafting costs more than any block can emit
    h = Guard(_model(_multi(c, dear)))
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
    g = Guard(_model(_multi(c, d)))
    for _ in range(6):
        _cycle(g, 7, g.decide([row]).width, [row])
    assert g.state == "draft" and g.decide([row]).width == 8
    for _ in range(40):  # every draft past the first wrong: it narrows
        _cycle(g, 1, g.decide([row]).width, [row])
    assert g.decide([row]).width <= 3
    widths = []
    for _ in range(30):  # every draft right again
        w = g.decide([row]).width
        widths.append(w)
        _cycle(g, w - 1, w, [row])
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
    g = Guard(_model(_multi(c, d)))
    cost = tokens = 0.0
    while tokens < 2000:
        w = g.decide([row]).width
        if w == 1:
            _plain(g, 1, [row])
            cost, tokens = cost + 1, tokens + 1
            continue
        a = 0
        while a < w - 1 and rng.random() < 0.5:
            a += 1
        _cycle(g, a, w, [row])
        cost, tokens = cost + g.priced[0][w], tokens + a + 1
    assert tokens / cost > 0.97  # plain: 1.0
    assert g.fallbacks >= 3 and g.backoff > Guard.BACKOFF0


def test_guard_prices_cycles_at_the_length_of_the_context():
    """Two curves, measured over 128 and 4096 cached tokens: the cycle cost at any
    length is linear between (and past) them, and the guard follows it as the
    context grows (a verify's attention reads grow with the context, a plain step's too)."""
    short = Costs(0.010, {1: 1.0, 5: 1.2}, {1: 0.0, 5: 0.3}, context=128, t_plain=0.010)
    long = Costs(0.020, {1: 1.0, 5: 2.4}, {1: 0.0, 5: 0.3}, context=4096, t_plain=0.020)  # drafts dearer at length
    m = _model(short, long)
    assert m.k(1, 128)[5] == pytest.approx(1.5)
    assert m.k(1, 4096)[5] == pytest.approx(2.7)
    assert m.k(1, 2112)[5] == pytest.approx((0.5 * (0.015 + 0.054)) / 0.015, rel=0.05)  # seconds interpolated
    g = Guard(m)
    near = Row(context=128)
    for _ in range(6):
        g.decide([near])
        _cycle(g, 1, rows=[near])  # 2 tokens a cycle: pays at 1.5, not at 2.7
    assert g.state == "draft"
    far = Row(context=4096)
    g.decide([far])
    _cycle(g, 1, rows=[far])
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
    assert gate.pays(4, {5: 1.0}) and not gate.pays(4, {5: 4.0})


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
    calibrate.remember(model, wrong, _costs(2.0))
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
    calibrate.remember(model, right, _costs(2.0))  # the same fixed costs: the decision is the guard's, not the load's
    r = generate(model, tok, prompt, right, max_tokens=n)
    assert r.token_ids == ref and r.stats.plain_cycles <= 1 and r.stats.tau > 4


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
    assert curve is not None and set(curve.c) == want and curve.t_plain > 0 and curve.d[5] > 0
    assert r.stats.policy

    def boom(*a, **k):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())
    monkeypatch.setattr(calibrate, "measure_costs", boom)
    generate(model, tok, PROMPTS[2], drafter, max_tokens=8)
