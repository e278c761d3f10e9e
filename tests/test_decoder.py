"""The decode session (mlx_dflash.engine.decoder.Decoder), its policy interface and
registry (modes.py), and DecodeConfig."""

import threading

import mlx.core as mx
import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import DecodeConfig, Decoder, load
from mlx_dflash import generate
from mlx_dflash.policy import registry as modes
from mlx_dflash.policy.base import DFLASH, LOOKUP, Decision, Policy
from mlx_dflash.settings.schema import ModelSettings

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\nimport os\nimport", "The answer is", "while True:",
           "class Stack:\n    def push(self, x):", "for line in open(path):"]


class Alternate(Policy):
    """A verify mode written for this test: two plain tokens, then one DFlash
    cycle at width 3, then a lookup cycle wherever the context repeats itself."""

    def __init__(self, width):
        self.w, self.seen = width, []

    def decide(self, rows):
        (r,) = rows
        n = r.offers(LOOKUP, self.w - 1)
        if n and self.seen and self.seen[-1] == DFLASH:
            return Decision((n + 1,), (LOOKUP,))
        if self.seen[-2:] == ["", ""]:
            return Decision((3,), (DFLASH,))
        return Decision.plain(rows)

    def observe(self, rows, results):
        self.seen.append(results[0].source)

    def reason(self, row):
        return "alternate"


@pytest.mark.slow
def test_a_new_verify_mode_is_one_class_and_one_registry_line(pairs, monkeypatch):
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    made = []
    monkeypatch.setitem(modes.MODES, "alternate",
                        modes.Mode(True, True, lambda ctx: made.append(Alternate(ctx.plan.cap)) or made[-1]))
    for i, prompt in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, prompt, 40)
        o = OracleDrafter(len(tok.encode(prompt)), ref, model.args.vocab_size, noise=0.3, seed=i)
        r = generate(model, tok, prompt, o, max_tokens=40, verify_mode="alternate", block_size=5)
        assert r.token_ids == ref
        seen = made[-1].seen
        assert r.stats.mode == "alternate" and r.stats.policy == "alternate"
        assert seen.count(DFLASH) == r.stats.cycles - r.stats.plain_cycles - r.stats.lookup_cycles > 2
        assert r.stats.plain_cycles == seen.count("") >= 2 * seen.count(DFLASH)
    assert any(LOOKUP in p.seen for p in made)  # the repetitive prompt drafted from lookup too


def test_last_cycle_drafts_the_published_width(pairs):
    """Near max_tokens the block is min(w, tokens left + 1), as the z-lab loops
    draft; a bonus token past max_tokens is dropped."""
    d = pairs("qwen3", version=1)
    model, tok, _ = load(str(d / "target"))
    prompt = PROMPTS[0]
    ref = reference_tokens(model, tok, prompt, 12)
    widths = []

    class Spy(OracleDrafter):
        def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
            widths.append(width)
            return super().propose(target, anchor, new_feats, cache, width, temperature)

    r = generate(model, tok, prompt, Spy(len(tok.encode(prompt)), ref, model.args.vocab_size), max_tokens=12,
                 block_size=8)
    assert r.token_ids == ref[:12]
    # an oracle: every draft accepted; 1 token from the prefill, then 8, then the last 3 + a dropped bonus
    assert widths == [8, 4] and r.stats.cycles == 2 and r.stats.accepted == 7 + 3


@pytest.mark.slow
def test_two_sessions_on_one_model_in_two_threads(pairs):
    """Decoders on the same loaded target and drafter in two threads give what
    each gives alone (the captures and rollback records are per forward)."""
    d = pairs("qwen3", version=2)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    alone = {p: generate(model, tok, p, drafter, max_tokens=32, block_size=4).token_ids for p in PROMPTS[:4]}
    got, errors = {}, []

    def work(ps):
        try:
            for p in ps:
                got[p] = generate(model, tok, p, drafter, max_tokens=32, block_size=4).token_ids
        except Exception as e:  # reported below, with the thread's failure
            errors.append(e)

    threads = [threading.Thread(target=work, args=(PROMPTS[i:4:2],)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == alone


def test_decode_config_from_settings_fits_the_drafter_and_takes_overrides():
    class D:
        block_size = 4

    s = ModelSettings(block_size=8, temperature=0.5, max_tokens=100, verify_mode="adaptive")
    c = DecodeConfig.from_settings(s, D(), temperature=None, max_tokens=7, stop=["x"])
    assert (c.block_size, c.temperature, c.max_tokens, c.stop, c.verify_mode) == (4, 0.5, 7, ["x"], "adaptive")
    assert DecodeConfig.from_settings(ModelSettings(dflash_enabled=False)).verify_mode == "off"
    with pytest.raises(ValueError, match="unknown verify mode 'fast'"):
        DecodeConfig(verify_mode="fast")
    with pytest.raises(ValueError, match="top_p"):
        DecodeConfig(top_p=0)
    with pytest.raises(TypeError, match="unknown decode option"):
        DecodeConfig.from_settings(s, colour="red")


def test_logits_processors_and_logprobs_run_in_the_session(pairs):
    """The engine's plain path (logprobs ask for it) applies mlx-lm logits
    processors and reports each step's log-probabilities, as mlx-lm's
    generate_step does."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    d = pairs("qwen3", version=1)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    prompt = tok.encode(PROMPTS[0])
    procs = make_logits_processors({5: 3.0}, 1.3, 20)
    want, want_lp = [], []
    for t, lp in generate_step(mx.array(prompt), model, max_tokens=16, logits_processors=procs):
        want.append(int(t))
        want_lp.append(lp)
    cfg = DecodeConfig(max_tokens=16, logits_processors=make_logits_processors({5: 3.0}, 1.3, 20), logprobs=True)
    rs = list(Decoder(model, tok, drafter, cfg).run(prompt))
    eos = set(tok.eos_token_ids)
    got = [r.token for r in rs if not (r.finish_reason == "stop" and r.token in eos)]
    assert got == want[: len(got)] and len(got) >= 8
    # logprobs decode plainly (the entries are per plain step); processors alone would not
    assert rs[0].stats.mode == "off" and "logprobs" in rs[0].stats.fallback
    assert DecodeConfig(logits_processors=procs).needs_plain is None
    for r, lp in zip(rs, want_lp):
        assert mx.allclose(r.logprobs, lp, atol=1e-5).item()


@pytest.mark.slow
def test_a_long_prompt_is_priced_at_its_length(pairs, monkeypatch):
    """No fallback by length: a prompt past LONG_FROM tokens in the default mode
    measures (once) a second cost curve at the first length that covers it, and
    the guard prices its cycles there; the output stays mlx-lm's."""
    from mlx_dflash.engine import calibrate
    from mlx_dflash.policy.registry import LONG_CONTEXTS, LONG_FROM

    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())
    d = pairs("qwen3", version=2)
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(45))
    n = len(tok.encode(text))
    assert LONG_FROM < n <= LONG_CONTEXTS[0]
    r = generate(model, tok, text, drafter, max_tokens=16)
    assert r.token_ids == reference_tokens(model, tok, text, 16)
    assert r.stats.mode == "dflash" and r.stats.fallback is None
    book = calibrate.DEFAULT.book
    assert book.curve(model, drafter, 0, (1,), context=LONG_CONTEXTS[0]).context == LONG_CONTEXTS[0]
    assert book.curve(model, drafter, 0, (1,)).context != LONG_CONTEXTS[0]
