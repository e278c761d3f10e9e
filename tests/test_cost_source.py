"""Costs measured ahead of the requests (mlx_dflash/engine/cost_source.py): an
engine that defers (the server's) measures nothing inside a request. While a
curve its set needs is missing (short contexts, a long length, a batch size)
the guarded rows decode plain, token for token mlx-lm's output, and say why;
the curve is queued, and once the engine's owner measures it the guard prices
and drafts again. `prepare_at_load` (generate, the chat) measures at load what
the first answer needs, once per machine."""

import mlx.core as mx
import pytest
from drafters import reference_tokens

from mlx_dflash import DecodeConfig, load
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash.engine.cost_source import PREPARED_CONTEXTS, prepare_at_load
from mlx_dflash.engine.engine import Engine
from mlx_dflash.engine.measuring import Interrupted
from mlx_dflash.platform.paths import cache_dir
from mlx_dflash.policy.base import Plan
from mlx_dflash.policy.costs import CostModel, Costs, Unpriced
from mlx_dflash.policy.guard import Guard
from mlx_dflash.policy.registry import priced_at

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "Janet's ducks lay 16 eggs per day. She eats"]


@pytest.fixture
def pair(pairs, tmp_path, monkeypatch):
    """The tiny pair on a machine that has measured nothing yet."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    out = pairs(version=2)
    return load(str(out / "target"), str(out / "drafter"))


def curves_on_disk() -> list:
    return sorted(p.name for p in (cache_dir() / "calibration").glob("costs-*.json"))


def decode(eng, prompts, max_tokens=20):
    uids = {eng.submit(p, DecodeConfig(max_tokens=max_tokens)): p for p in prompts}
    toks, stats = {u: [] for u in uids}, {}
    for uid, r in eng.run():
        if not (r.finish_reason == "stop" and r.token in eng.tokenizer.eos_token_ids):
            toks[uid].append(r.token)
        stats[uid] = r.stats
    return [(uids[u], toks[u], stats[u]) for u in uids]


def test_a_deferring_engine_decodes_plain_until_its_costs_are_measured(pair):
    model, tok, drafter = pair
    eng = Engine(model, tok, drafter, calibration=Calibration(), defer_costs=True)
    ((prompt, got, st),) = decode(eng, PROMPTS[:1])
    assert got == reference_tokens(model, tok, prompt, 20)
    assert st.cycles == st.plain_cycles and st.drafted == 0 and eng.drafter_forwards == 0
    assert st.policy == "plain: the costs at short contexts are not measured yet (measured while the server is idle)"
    assert st.adaptive["state"] == "unpriced"
    assert curves_on_disk() == [] and eng.costs.wanted == [("length", None)]  # queued, not measured
    ((_, got, st),) = decode(eng, PROMPTS[:1], max_tokens=1)  # done at its prefill, before any decision
    assert got == reference_tokens(model, tok, PROMPTS[0], 1) and eng.costs.wanted == [("length", None)]

    what, seconds, fresh = eng.costs.measure_next()
    assert what == "short contexts" and fresh and seconds > 0 and len(curves_on_disk()) == 1
    assert eng.costs.measure_next() is None
    ((prompt, got, st),) = decode(eng, PROMPTS[1:], 64)  # (room enough to repay a probe)
    assert got == reference_tokens(model, tok, prompt, 64)
    assert "not measured" not in st.policy and st.adaptive["state"] != "unpriced"
    assert eng.drafter_forwards > 0  # priced: the guard probes the drafter


def test_a_long_prompt_waits_for_its_own_length_and_a_batch_for_its_size(pair):
    model, tok, drafter = pair
    cal = Calibration()
    eng = BatchEngine(model, tok, drafter, max_batch=2, calibration=cal, defer_costs=True)
    eng.costs.want(("length", None))
    eng.costs.measure_next()  # short contexts measured; not the batch sizes nor the long lengths
    long_prompt = tok.encode("\n".join(PROMPTS * 40))[:600]  # 600 tokens: priced with the 1024-token curve
    assert priced_at(len(long_prompt)) == 1024
    ((_, got, st),) = decode(eng, [long_prompt], 8)
    assert got == reference_tokens(model, tok, mx.array(long_prompt), 8)
    assert st.drafted == 0 and "the costs at 1024 tokens are not measured yet" in st.policy
    assert eng.costs.wanted == [("length", 1024)]

    results = decode(eng, PROMPTS)  # two rows: the 2-row curve is missing
    for prompt, got, st in results:
        assert got == reference_tokens(model, tok, prompt, 20)
        assert st.drafted == 0
    assert "the costs at 2 rows are not measured yet" in results[0][2].policy
    assert eng.costs.wanted[0] == ("rows", 2)

    while eng.costs.measure_next() is not None:
        pass
    results = decode(eng, PROMPTS, 64)
    for prompt, got, st in results:
        assert got == reference_tokens(model, tok, prompt, 64)
        assert "not measured" not in st.policy
    assert eng.drafter_forwards > 0
    # a set's plain step in seconds (the unit of what the guard's cycles paid is held near it): the
    # measured [B, 1] step, linear in B between the sizes measured, growing with the length as one row's
    eng.costs.rows.at(4)
    m, step = eng.costs.cost_model(), {b: cal.book.curve(model, drafter, widths=(1,), batch=b).t1 for b in (2, 4)}
    assert m.plain_seconds(2, 0) == pytest.approx(step[2]) and m.plain_seconds(3, 0) == pytest.approx(
        (step[2] + step[4]) / 2)
    assert m.plain_seconds(2, 600) / m.plain_seconds(2, 0) == pytest.approx(m.plain_seconds(1, 600) / m.plain_seconds(1, 0))


def test_prepare_queues_what_a_server_will_need_in_order(pair):
    model, tok, drafter = pair
    eng = BatchEngine(model, tok, drafter, max_batch=3, calibration=Calibration(), defer_costs=True)
    eng.costs.prepare(3)
    assert eng.costs.wanted == [("length", None), ("rows", 2), ("rows", 4)] + \
        [("length", priced_at(n)) for n in PREPARED_CONTEXTS]
    eng.costs.want(("length", 65536), first=True)  # a request waits for it: first
    assert eng.costs.wanted[0] == ("length", 65536)


def test_prepare_at_load_measures_once_per_machine(pair):
    model, tok, drafter = pair
    line = prepare_at_load(model, drafter, Calibration(), (600,))
    assert line.startswith("measured the guard's costs on this machine once (short contexts, 1024 tokens) in ")
    assert len(curves_on_disk()) == 2
    assert prepare_at_load(model, drafter, Calibration(), (600,)) is None  # a later load: from the cache
    assert prepare_at_load(model, None, Calibration()) is None  # no drafter: nothing to price


def test_a_curve_measured_for_other_widths_never_narrows_the_cached_one(pair):
    """Verify mode adaptive needs widths 1..5 where the guard's curve has 1, 2,
    3, 5, 8: its measurement covers 8 too, so the guard, reading the curve
    cached after it, still chooses among widths up to 8."""
    model, tok, drafter = pair
    quick = dict(budget_s=0.1, min_rounds=2, max_rounds=2)
    guard_widths = (1, 2, 3, 5, 8)
    Calibration().costs(model, drafter, widths=guard_widths, enough=(1, 5), **quick)
    adaptive = Calibration().costs(model, drafter, max_width=5, **quick)  # (4 is missing: measured again)
    assert set(adaptive.c) == {1, 2, 3, 4, 5, 8}
    later = Calibration().book.curve(model, drafter, 0, (1, 5))  # what the next process reads
    assert set(guard_widths) <= set(later.c) and len(curves_on_disk()) == 1


class _Row:
    def __init__(self, context, uid=1):
        self.uid, self.context, self.left, self.unseen = uid, context, 10**6, 0
        self.plan = Plan("dflash", 5, False, True, False, carry=True)

    def offers(self, source, n):
        return n

    def grade(self, source):
        return 0


def test_the_guard_prices_again_once_a_missing_curve_arrives():
    base = Costs(0.01, {1: 1.0, 5: 1.2}, {1: 0.0, 5: 0.2}, t_plain=0.01)
    held = {None: base}

    def curve(at):
        if at not in held:
            raise Unpriced(("length", at))
        return held[at]

    g = Guard(CostModel(curve, [1, 5], priced_at=lambda n: 4096 if n > 512 else None))
    short, long_row = _Row(100), _Row(3000, uid=2)
    assert g.decide([short]).width == 5  # probing: priced from the base curve
    assert g.uses_drafter(long_row.plan, 3000)  # (kept ready to draft once priced)
    assert g.decide([long_row]).width == 1
    assert g.reason(long_row) == "plain: the costs at 4096 tokens are not measured yet (measured while the server is idle)"
    held[4096] = Costs(0.01, {1: 1.0, 5: 1.3}, {1: 0.0, 5: 0.2}, t_plain=0.01, context=4096)
    assert g.decide([long_row]).width == 5 and not g.unpriced


def test_the_server_engine_measures_while_idle_and_says_so_once(pair, capfd):
    from types import SimpleNamespace

    from app.server.engines import LocalEngine

    model, tok, drafter = pair
    lm = SimpleNamespace(model=model, tokenizer=tok, drafter=drafter, id="tiny")
    eng = LocalEngine(lm, max_batch=2)
    assert eng.engine.costs.wanted  # queued at start: nothing measured inside a request
    assert eng.summary()["costs"].startswith("measuring while idle: short contexts, 2 rows")
    ids = tok.encode(PROMPTS[0])
    got = [r.token for r in eng.stream(ids, DecodeConfig(max_tokens=12))]  # served at once, however far it got
    assert got[:len(reference_tokens(model, tok, PROMPTS[0], 12))] == reference_tokens(model, tok, PROMPTS[0], 12)
    assert eng.costs_ready.wait(300)
    assert eng.summary()["costs"] == "ready"
    eng.close()
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "the guard's costs for 'tiny'" in x]
    n = 2 + len(PREPARED_CONTEXTS)  # short contexts, 2 rows, the long lengths
    assert len(lines) == 1 and f": {n} curves measured, 0 read from the cache" in lines[0]
    assert len(curves_on_disk()) == n


def test_a_measurement_gives_way_to_a_request_and_is_taken_up_again(pair):
    model, tok, drafter = pair
    eng = BatchEngine(model, tok, drafter, max_batch=2, calibration=Calibration(), defer_costs=True)
    eng.costs.prepare(2, contexts=())
    asked = []

    def stop():  # a request arrives during the third timed piece
        asked.append(1)
        return len(asked) >= 3

    for key in list(eng.costs.wanted):
        before = curves_on_disk()
        with pytest.raises(Interrupted):
            eng.costs.measure_next(stop)
        assert eng.costs.wanted[0] == key and curves_on_disk() == before  # still first in line, nothing kept
        asked.clear()
        eng.costs.measure_next()
    assert eng.costs.wanted == [] and len(curves_on_disk()) == 2


def test_a_curve_that_cannot_be_measured_is_not_asked_for_again(pair, monkeypatch):
    model, tok, drafter = pair
    eng = Engine(model, tok, drafter, calibration=Calibration(), defer_costs=True)
    eng.costs.prepare(contexts=())

    def broken(at, stop=None):
        raise RuntimeError("no memory for the probe")

    monkeypatch.setattr(eng.costs, "_measure_curve", broken)
    with pytest.raises(RuntimeError):
        eng.costs.measure_next()
    assert eng.costs.wanted == []
    ((prompt, got, st),) = decode(eng, PROMPTS[:1])  # still served, plainly, and nothing queued again
    assert got == reference_tokens(model, tok, prompt, 20) and st.drafted == 0 and eng.costs.wanted == []
