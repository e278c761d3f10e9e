"""Adaptive verify width (policy.AdaptiveWidth): lossless, falls back and
re-probes, follows its cost model (pure tests, no model); calibration caches
its measurements (calibrate.py). The default mode's guard: test_guard.py."""

import json

import pytest

from drafters import PROMPTS, OracleDrafter, reference_tokens
from mlx_dflash import generate
from mlx_dflash.engine import calibrate
from mlx_dflash.policy import costs
from mlx_dflash import load, stream_generate
from mlx_dflash.policy.costs import Costs
from mlx_dflash.policy.adaptive import AdaptiveWidth
from mlx_dflash.policy.base import CycleResult
from rows import Row

pytestmark = pytest.mark.usefixtures("fresh_costs")


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
