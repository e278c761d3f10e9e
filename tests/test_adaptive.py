"""Adaptive verify width (policy.AdaptiveWidth) and the default-mode guard
(policy.Guard): lossless, fall back and re-probe, follow their cost models
(pure tests, no model); calibration caches its measurements (calibrate.py)."""

import json

import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import generate
from mlx_dflash.engine import calibrate
from mlx_dflash.policy import costs
from mlx_dflash import load, stream_generate
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.adaptive import AdaptiveWidth
from mlx_dflash.policy.base import DFLASH, Draft, LoopState, Plain
from mlx_dflash.engine.stats import CycleResult

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
    o = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size, noise=1.0)
    # a fixed cost curve (c(5) = 2): how soon it falls back must not hang on this machine's load
    calibrate.remember(model, o, Costs(0.01, {w: 1 + 0.25 * (w - 1) for w in range(1, 6)}, {w: 0.0 for w in range(1, 6)}))
    ids, cycles, st = _cycles(model, tok, prompt, o, max_tokens=n, block_size=5, verify_mode="adaptive")
    assert ids == ref
    assert st.accepted == 0 and st.plain_cycles >= AdaptiveWidth.BACKOFF0
    w = [c.width for c in cycles]
    # Two ways to stop paying for wrong drafts, and which comes first depends on
    # the timings the policy observes: the cut learns the drafts' confidence is
    # worthless and verifies none, or recent cycles fall below break-even and it
    # falls back to plain steps, then re-probes.
    if st.adaptive["fallbacks"] == 0:
        assert sum(x > 1 for x in w) <= 8 and set(w[-20:]) == {1}
    else:
        assert st.adaptive["probes"] >= 1
        assert max(w[w.index(1):]) > 1  # re-probed after falling back


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
    n = pol.trim([1] * 7, conf)
    a = [pol.calib(x) for x in conf]
    want_n = max(range(8), key=lambda k: (_rate(a[:k], c[k], d[7]), k))
    assert n == want_n and n <= 2  # never past the doubtful third draft


def test_cut_uses_recent_acceptance():
    """Confident drafts that keep failing stop being verified (once even one
    draft costs more than its calibrated chance is worth)."""
    pol = _policy([1, 1.2, 1.3, 1.4, 1.5], [0, .2, .22, .24, .26], [0.9] * 5)
    pol.PATIENCE = 10**6  # this test is about the cut, not the fallback
    conf = [0.95] * 4
    assert pol.trim([1] * 4, conf) == 4
    for _ in range(40):
        pol.width()
        n = pol.trim([1] * 4, conf)
        pol.observe(CycleResult(n + 1, 0, 1, conf=conf[:n]))
    assert pol.trim([1] * 4, conf) == 0


def test_fallback_is_reversible_with_backoff():
    pol = _policy([1, 1.05, 1.1, 1.15, 1.2], [0, .2, .22, .24, .26], [0.9] * 5)
    bad, good = [0.95] * 4, [0.95] * 4

    def cycle(accepted_all):
        w = pol.width()
        if w == 1:
            pol.observe(CycleResult(1, 0, 1))
            return 1
        conf = good if accepted_all else bad
        n = pol.trim([1] * (w - 1), conf)
        pol.observe(CycleResult(n + 1, n if accepted_all else 0, 1, conf=conf[:n]))
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


# -- the default mode's guard (policy.Guard): pure, no model ------------------------------

from mlx_dflash.policy.costs import Observed  # noqa: E402
from mlx_dflash.policy.base import Fixed
from mlx_dflash.policy.guard import Guard  # noqa: E402


def _costs(k, w=5):
    """A curve whose width-w cycle costs k plain tokens (a plain token 0.8 of a
    1-token step, as pipelining gives; verify and draft split 3:1)."""
    t1, tp = 0.01, 0.008
    steps = k * tp / t1
    return Costs(t1, {1: 1.0, w: 0.75 * steps}, {1: 0.0, w: 0.25 * steps}, t_plain=tp)


STATE = LoopState(10**6, {DFLASH: lambda n: n})


def _plain_due(g) -> int:
    """Plain tokens the guard asks for now (0: it drafts)."""
    d = g.next(STATE)
    return d.n if isinstance(d, Plain) else 0


def _cycle(g, tokens, w=5):
    """A DFlash cycle at width w that emitted `tokens` (accepted + 1)."""
    g.observe(CycleResult(w, tokens - 1, tokens, source=DFLASH))


def _plain(g, k):
    for _ in range(k):
        g.observe(CycleResult(1, 0, 1))


def _drive(g, tau, cycles):
    """Run the guard's loop for `cycles` decisions, each draft cycle emitting
    `tau` tokens. Returns the decisions: a width, or -k for k plain tokens."""
    seq = []
    for _ in range(cycles):
        d = g.next(STATE)
        if isinstance(d, Plain):
            _plain(g, d.n)
            seq.append(-d.n)
        else:
            assert d == Draft(g.w, DFLASH)
            _cycle(g, tau)
            seq.append(d.width)
    return seq


def test_guard_cost_is_the_calibrated_cycle_in_plain_tokens():
    c = Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6}, t_plain=0.008)
    assert Guard(5, c).k == pytest.approx((1.8 + 0.6) * 0.01 / 0.008)
    assert Guard(5, Costs(0.01, {1: 1.0, 5: 1.8}, {1: 0.0, 5: 0.6})).k == pytest.approx(2.4)  # no t_plain: t1


def test_guard_keeps_drafting_when_it_pays():
    g = Guard(5, _costs(2.0))
    assert _plain_due(g) == 0 and g.reason.startswith("dflash: probing")
    seq = _drive(g, tau=3.5, cycles=60)
    assert seq == [5] * 60 and g.state == "draft" and g.fallbacks == 0
    assert g.speedup() == pytest.approx(1.75) and g.reason.startswith("dflash: 1.75x predicted")


def test_guard_probe_is_a_sequential_test():
    """A probe starts from two pseudo-cycles halfway between break-even (k) and
    the width: one poor cycle ends it, cycles that pay keep it going."""
    k, w = 3.2, 5
    g = Guard(w, _costs(k))
    _cycle(g, 1)  # (2 * 4.1 + 1) / 3 = 3.07 < 3.2 -> plain
    assert g.state == "plain" and _plain_due(g) == Guard.BACKOFF0 and g.fallbacks == 1
    g = Guard(w, _costs(k))
    for t in (5, 2, 3):  # (8.2 + 5) / 3, (8.2 + 7) / 4, (8.2 + 10) / 5 = 3.64: pays by >= MARGIN
        _cycle(g, t)
    assert g.state == "draft" and g.tau.value == pytest.approx(10 / 3)  # from here on, what it saw
    _cycle(g, 4)  # running mean 0.85 * 3.33 + 0.15 * 4 = 3.43 > 3.2: keeps drafting
    assert g.state == "draft"
    _cycle(g, 1)  # 3.07: below -> plain
    assert g.state == "plain" and g.reason.startswith("plain: DFlash 0.96x predicted (tau 3.07")
    g = Guard(w, _costs(k))
    for t in (4, 3, 3):  # (8.2 + 10) / 5 = 3.64: pays by 1.14x ...
        _cycle(g, t)
    assert g.state == "draft"
    g = Guard(w, _costs(k))
    for t in (4, 2, 2):  # ... but (8.2 + 8) / 5 = 3.24 only by 1.01x, not by MARGIN -> plain
        _cycle(g, t)
    assert g.state == "plain"


def test_guard_falls_back_probes_with_backoff_and_recovers():
    g = Guard(5, _costs(3.0))
    seq = _drive(g, tau=2.0, cycles=60)  # 0.67x
    plain = [-x for x in seq if x < 0]
    assert plain[:3] == [Guard.BACKOFF0, 2 * Guard.BACKOFF0, 4 * Guard.BACKOFF0]  # doubling
    assert max(plain) == Guard.BACKOFF_MAX and g.fallbacks >= 3 and g.probes >= 3
    assert all(x == 5 for x in seq if x > 0)  # probes draft at the user's width
    assert sum(x > 0 for x in seq) <= 3 * g.fallbacks  # each failed probe cost at most 3 cycles (0.67x)
    for _ in range(4):  # to the end of the current probe
        if g.state == "plain":
            break
        _drive(g, tau=2.0, cycles=1)
    assert g.state == "plain" and g.reason.startswith("plain: DFlash 0.")
    # the text becomes draftable: the next probe brings drafting back
    seq = _drive(g, tau=4.5, cycles=12)
    assert g.state == "draft" and seq[-3:] == [5, 5, 5] and g.backoff == Guard.BACKOFF0


def test_guard_never_drafts_where_even_full_acceptance_loses():
    # a cycle = 6 plain tokens > width 5; 4.2 (bf16 on mlx-cpu): w / k = 1.19 < 1.25, only a
    # drafter right > 90% of the time could pay; 3.9: w / k = 1.28, worth probing
    for k, hopeless in ((6.0, True), (4.2, True), (3.9, False)):
        g = Guard(5, _costs(k), Observed(tau={5: 4.0}))
        assert g.hopeless == hopeless
        if not hopeless:
            assert g.state == "draft" and _plain_due(g) == 0
            continue
        assert _plain_due(g) == Guard.BACKOFF_MAX and "cannot pay" in g.reason
        for _ in range(5):  # plain for good: it never probes
            _plain(g, _plain_due(g))
            assert g.state == "plain" and _plain_due(g) == Guard.BACKOFF_MAX and g.probes == 0
        assert g.observed().wait == 0  # nothing to carry: the next request decides the same from the costs


def test_guard_prior_carries_acceptance_and_backoff():
    g = Guard(5, _costs(3.0), Observed(tau={5: 2.0}, backoff=64, wait=40))
    assert _plain_due(g) == 40  # the last request ended plain: this one continues it
    o = g.observed()
    assert o.tau[5] == 2.0 and o.backoff == 64 and o.wait == 40
    g = Guard(5, _costs(3.0), Observed(tau={5: 4.0}))
    assert _plain_due(g) == 0 and g.state == "draft" and g.speedup() == pytest.approx(4 / 3)
    f = Fixed(4)
    assert f.next(STATE) == Draft(4, DFLASH) and f.reason == "fixed width 4"


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
    assert r.token_ids == ref and r.stats.mode == "dflash" and r.stats.block_size == 5
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


# -- the guard choosing its width (costs measured at several widths) ----------------------


def _multi(c, d, tp=0.01):
    """A curve measured at several widths: c, d dicts over the same widths (1 included)."""
    return Costs(0.01, c, d, t_plain=tp)


def _accepting(g, a, n):
    g.observe(CycleResult(n + 1, a, a + 1, source=DFLASH))


def test_guard_chooses_the_width_that_pays_best():
    from mlx_dflash.policy.guard import monotone

    assert monotone([1.0, 1.5, 1.3, 1.4, 3.0]) == pytest.approx([1.0, 1.4, 1.4, 1.4, 3.0])  # noise pooled
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.05 * (w - 1) for w in ws}  # a cheap verify (memory-bound target)
    d = {w: 0.0 if w == 1 else 0.2 for w in ws}
    g = Guard(8, _multi(c, d))
    assert g.multi and g.state == "probe" and g.next(STATE) == Draft(8, DFLASH)  # the probe's prior: widest
    for _ in range(12):  # every draft accepted: the widest block pays best
        _accepting(g, 7, 7)
    assert g.state == "draft" and g.next(STATE) == Draft(8, DFLASH) and g.speedup() > 3
    for _ in range(40):  # the first draft right, the second wrong: two-token blocks are the most a cycle emits
        _accepting(g, 1, g.next(STATE).width - 1)
    x = g.next(STATE)
    assert isinstance(x, Draft) and x.width in (2, 3)
    assert g.widths[8] >= 12 and sum(v for w, v in g.widths.items() if w < 8) > 0
    o = g.observed()
    assert o.p is not None and len(o.p) == 7 and o.p[0] > 0.9 and o.p[1] < 0.2
    nxt = Guard(8, _multi(c, d), o)  # the next request starts where this one left off
    assert nxt.state == "draft" and nxt.next(STATE).width == x.width


def test_guard_with_several_widths_still_falls_back_and_never_drafts_where_none_pays():
    ws = (1, 2, 3, 5, 8)
    c = {w: 1 + 0.25 * (w - 1) for w in ws}  # a verify of 8 costs 2.75 steps, a draft 0.6
    d = {w: 0.0 if w == 1 else 0.6 for w in ws}
    g = Guard(8, _multi(c, d))
    cycles = 0
    while isinstance(g.next(STATE), Draft) and cycles < 10:  # nothing accepted: no width pays
        _accepting(g, 0, g.next(STATE).width - 1)
        cycles += 1
    assert cycles <= 4 and g.state == "plain" and g.next(STATE) == Plain(Guard.BACKOFF0) and g.fallbacks == 1
    assert g.reason.startswith("plain: DFlash") and g.reason.endswith("probe in 64")
    dear = {w: 0.0 if w == 1 else 0.9 * w for w in ws}  # drafting costs more than any block can emit
    h = Guard(8, _multi(c, dear))
    assert h.hopeless and isinstance(h.next(STATE), Plain) and "cannot pay" in h.reason


def test_guard_prices_cycles_at_the_length_of_the_context():
    """Two curves, measured over 128 and 4096 cached tokens: the cycle cost at any
    length is linear between (and past) them, and the guard follows it as the
    context grows (a verify's attention reads grow with the context, a plain step's too)."""
    short = Costs(0.010, {1: 1.0, 5: 1.2}, {1: 0.0, 5: 0.3}, context=128, t_plain=0.010)
    long = Costs(0.020, {1: 1.0, 5: 2.4}, {1: 0.0, 5: 0.3}, context=4096, t_plain=0.020)  # drafts dearer at length
    g = Guard(5, short, long=long, context=128)
    assert g.k == pytest.approx(1.5)
    g.set_context(4096)
    assert g.k == pytest.approx(2.7)
    g.set_context(2112)  # halfway: seconds interpolated, then the ratio
    assert g.k == pytest.approx((0.5 * (0.015 + 0.054)) / 0.015)
    g.set_context(2112 + 50)  # a small move: not recomputed
    assert g.at == 2112
    g = Guard(5, short, long=long, context=128)
    for _ in range(6):
        _cycle(g, 2)  # 2 tokens a cycle: pays at 1.5, not at 2.7
    assert g.state == "draft"
    g.next(LoopState(100, {DFLASH: lambda n: n}, context=4096))
    _cycle(g, 2)
    assert g.state == "plain" and "cycle = 2.70" in g.reason
    far = Guard(5, short, long=long, context=64000)  # past both: extrapolated
    assert far.k == pytest.approx((0.015 + 0.039 * (64000 - 128) / 3968) / (0.01 + 0.01 * (64000 - 128) / 3968))
    steep = Costs(0.020, {1: 1.0, 5: 4.0}, {1: 0.0, 5: 1.0}, context=4096, t_plain=0.020)
    assert not Guard(5, short, long=steep, context=128).hopeless and Guard(5, short, long=steep, context=64000).hopeless
