"""Whether new requests that arrive together are prefilled in one batched
forward is measured on the machine (batch_costs.prefill_together_pays): the
probe times the engine's own two ways on the target, says which it chose and
why in one line, keeps the answer beside the cost curves, and refuses targets
whose caches cannot be left-padded."""

import mlx.core as mx
import pytest
from tiny_families import build

from mlx_dflash.engine import batch_costs
from mlx_dflash.engine.batch_costs import PREFILL_GAIN, prefill_together_pays


def test_probe_times_both_ways_and_follows_the_measured_share(monkeypatch):
    model = build("qwen3", seed=11)  # parameters no other test measures: not cached yet
    seen = []
    timed = batch_costs.prefill_s  # wrapped, not replaced: the real forwards run

    def spy(target, prompts, capture, together):
        t = timed(target, prompts, capture, together)
        seen.append((len(prompts), together, t))
        return t

    monkeypatch.setattr(batch_costs, "prefill_s", spy)
    pays, why = prefill_together_pays(model, None, 4)
    assert {(4, False), (4, True)} <= {(n, tog) for n, tog, _ in seen}  # both ways, all 4 prompts
    alone = min(t for n, tog, t in seen if n == 4 and not tog)
    together = min(t for n, tog, t in seen if n == 4 and tog)
    assert pays == (together / alone <= PREFILL_GAIN)
    assert "\n" not in why and ("together" if pays else "one after another") in why.split(": ")[-1]
    monkeypatch.setattr(batch_costs, "prefill_s", lambda *a: pytest.fail("measured again"))
    assert prefill_together_pays(model, None, 4) == (pays, why)  # a new load: the kept answer


def test_probe_refuses_what_cannot_be_padded_and_one_row():
    pays, why = prefill_together_pays(build("gemma3_text"), None, 4)  # sliding windows: prefilled alone
    assert not pays and "left-padded" in why
    assert prefill_together_pays(build("qwen3"), None, 1) == (False, "one row at a time")


def test_probe_leaves_no_state_behind():
    """The probe uses caches of its own: the model's next forward is unchanged."""
    model = build("qwen3")
    x = mx.array([[5, 6, 7, 8]])
    before = model(x)
    prefill_together_pays(model, None, 2)
    assert mx.array_equal(model(x), before)
