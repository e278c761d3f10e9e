"""Long context (issue 23): the drafter's bounded context (a sink of the first
rows plus a window of the last ones), the target's KV cache quantized exactly as
mlx-lm's kv_bits, and chunked prefill with progress and cancellation."""

import random

import mlx.core as mx
import pytest
from drafters import OracleDrafter
from make_test_pair import make_drafter
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache, trim_prompt_cache
from tiny_families import build, config

from mlx_dflash import stream_generate
from mlx_dflash.engine import calibrate
from mlx_dflash.engine.decode_config import DecodeConfig
from mlx_dflash.engine.engine import Engine
from mlx_dflash.policy.base import DFLASH
from mlx_dflash.drafting.drafter import ContextCache, Drafter
from mlx_dflash.drafting.drafter_config import DrafterConfig
from mlx_dflash.cache.prompt_cache import PromptCache, common_prefix
from mlx_dflash.cache.prompt_store import cache_bytes
from mlx_dflash.target.adapter import Target
from tiers import fast_first

H = 64
_models = {}


def model_of(family):
    if family not in _models:
        _models[family] = build(family)
    return _models[family]


def ids_of(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(n)]


def run(model, ids, drafter=None, pc=None, stats=None, **kw):
    """Token ids of one DFlash call (no tokenizer: no EOS, runs to max_tokens);
    its stats appended to `stats`."""
    rs = list(stream_generate(model, None, ids, drafter, prompt_cache=pc, **kw))
    if stats is not None:
        stats.append(rs[-1].stats)
    return [r.token for r in rs]


def mlx_lm_tokens(model, ids, n, cache=None, **kw):
    """mlx-lm's own greedy generate_step: the reference."""
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache, **kw)]


# -- the drafter's bounded context ---------------------------------------------------------
def _kept(events, sink, window):
    """The positions a sink + window context holds after `events` (("add", n) or
    ("trim", n)): the model ContextCache must follow, written out."""
    s, w, off = [], [], 0
    for op, n in events:
        if op == "add":
            for p in range(off, off + n):
                (s if p < sink else w).append(p)
            w, off = w[-window:], off + n
        else:
            off -= n
            s, w = [p for p in s if p < off], [p for p in w if p < off]
    return s + w, off


@pytest.mark.parametrize("sink,window", [(0, 7), (4, 16), (9, 5)])
def test_context_cache_keeps_the_sink_and_the_window_through_trims(sink, window):
    rng = random.Random(sink * 100 + window)
    c, events = ContextCache(window, sink), []
    for _ in range(300):
        if c.offset and rng.random() < 0.25:
            n = rng.randrange(1, c.offset + 1)
            assert c.trim(n) == n
            events.append(("trim", n))
        else:
            n = rng.choice([1, 1, 2, 5, 30])
            pos = mx.arange(c.offset, c.offset + n, dtype=mx.float32).reshape(1, 1, n, 1)
            c.update_and_fetch(pos, -pos)
            events.append(("add", n))
        want, off = _kept(events, sink, window)
        assert c.offset == off
        got = c.keys[0, 0, :, 0].tolist() if c.keys is not None else []
        assert got == want, events[-3:]
        if want:
            assert c.values[0, 0, :, 0].tolist() == [-p for p in want]
        assert c.rows <= sink + window
        win = [p for p in want if p >= sink]
        assert c.first == (win[0] if win else off)


def _drafter(version, seed=0, **over):
    cfg = DrafterConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, vocab_size=512, mask_token_id=3,
                        target_layer_ids=[0, 2], block_size=8, num_target_layers=4, version=version,
                        selector_rank=16, conv_group_size=16, **over)
    mx.random.seed(seed)
    d = Drafter(cfg)
    mx.eval(d.parameters())
    return d


def _selected(d, block, feats, sink, window):
    """The drafter's hidden states when it attends to exactly the sink rows and
    the last `window` rows of the whole context, computed from all of it at once."""
    ctx, n = d.context(feats), feats.shape[1]
    keep = mx.array(list(range(min(sink, n))) + list(range(sink, n))[-window:])
    x = block
    for layer in d.layers:
        k, v = layer.self_attn._kv(ctx, 0)
        x = layer(x, k[:, :, keep], v[:, :, keep], n, x.shape[1])
    return d.norm(x)


@pytest.mark.parametrize("version", [1, 2])
def test_bounded_draft_attends_to_the_sink_and_the_window(version):
    """Over cycles of new rows (a long first block whose middle no window keeps,
    then a few per cycle), the drafts see exactly the sink and the last rows,
    at their real positions; below the bound it is the unbounded drafter, bit for bit."""
    d, t = _drafter(version), Target(model_of("qwen3"))
    sink, window = 4, 16
    feats = mx.random.normal((1, 300, 2 * H), key=mx.random.key(1))
    bounded, full = d.make_cache(window, sink), d.make_cache()
    assert all(isinstance(c, ContextCache) for c in bounded) and all(isinstance(c, KVCache) for c in full)
    small = feats[:, : sink + window]
    block = t.embed(mx.array([[7] + [3] * 7]))
    assert mx.array_equal(d(block, small[:, :11], bounded), d(block, small[:, :11], full))
    assert mx.array_equal(d(block, small[:, 11:], bounded), d(block, small[:, 11:], full))
    c = d.make_cache(window, sink)
    rng, seen = random.Random(version), 0
    for n in [250, 1, 3, 8, 2, 30, 1]:
        h = d(block, feats[:, seen: seen + n], c)
        seen += n
        ref = _selected(d, block, feats[:, :seen], sink, window)
        assert mx.allclose(h, ref, atol=1e-4).item(), (n, mx.abs(h - ref).max().item())
        assert all(x.offset == seen and x.rows == sink + window for x in c)
        block = t.embed(mx.array([[rng.randrange(4, 512)] + [3] * 7]))


def test_checkpoint_sliding_layers_keep_their_window():
    """A layer the checkpoint gives a sliding window keeps that window (as
    published), whatever the drafter_window setting; the others get the setting."""
    d = _drafter(1, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    a, b = d.make_cache(32, 2)
    assert (a.window, a.sink) == (6, 0) and (b.window, b.sink) == (32, 2)
    assert isinstance(d.make_cache()[1], KVCache) and d.make_cache()[0].window == 6


def _pair(tmp_path, family="qwen3", version=1, **over):
    return make_drafter(tmp_path / f"d{family}{version}", config(family, **over), 3, version=version, block_size=8,
                        seed=version)


# one attention layer (two for the hybrid: gated-delta + attention): a tiny model's
# 8k-token prefill costs ~10 s on this CPU (mlx's CPU attention), two per test
LONG = {"qwen3": 1, "qwen3_next": 2}


@pytest.mark.slow
@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("family", list(LONG))
def test_greedy_lossless_at_8k_with_the_window_wrapped(tmp_path, family, kv_bits):
    """8k+ tokens of context, a real (random) drafter whose window wrapped long
    ago and whose sink is in use: mlx-lm's greedy output. On the attention
    target the conversation goes on through the prompt cache, then branches
    back inside the window and below it (the bounded context is trimmed), each
    call equal to mlx-lm continuing its own cache cut back the same way. With
    kv_bits the target's cache is quantized in the prefill's last chunk."""
    model = _models.setdefault((family, 8), build(family, num_hidden_layers=LONG[family]))
    d = _pair(tmp_path, family, num_hidden_layers=LONG[family])
    d.config.target_layer_ids = [min(i, LONG[family] - 1) for i in d.config.target_layer_ids]
    ids = ids_of(8300, seed=3)
    q = dict(kv_bits=kv_bits, kv_group_size=32, quantized_kv_start=8100)
    kw = dict(max_tokens=24, block_size=5, guard=False, drafter_window=48, drafter_sink=8, **q)
    pc, ref_cache, stats = PromptCache(), make_prompt_cache(model), []
    out = run(model, ids, d, pc, stats, **kw)
    assert out == mlx_lm_tokens(model, ids, 24, cache=ref_cache, **q)
    assert stats[-1].drafted > 0 and stats[-1].cycles > 1
    assert any(isinstance(c, QuantizedKVCache) for c in pc.target) == (kv_bits is not None)
    for c in pc.drafter:  # the window wrapped, the sink holds the first rows
        assert c.rows == 56 and c.offset + (pc.pending.shape[1] if pc.pending is not None else 0) == len(pc.tokens)
        assert c.first == c.offset - 48
    if family != "qwen3":
        return  # (a recurrent state cannot be cut back: mlx-lm's cache cannot branch)
    turns = [ids + out + ids_of(40, seed=4),  # continues
             ids + out[:10] + ids_of(30, seed=5),  # back inside the window
             ids[:8000] + ids_of(50, seed=6)]  # back below it
    for prompt in turns:
        common = common_prefix(pc.tokens, prompt[:-1])
        got = run(model, prompt, d, pc, stats, **kw)
        trim_prompt_cache(ref_cache, ref_cache[0].offset - common)
        assert got == mlx_lm_tokens(model, prompt[common:], 24, cache=ref_cache, **q)
        assert stats[-1].reused_tokens == common
        assert pc.drafter[0].offset > 8000 and pc.drafter[0].rows <= 56


# -- quantized KV cache --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_quantized_kv_is_mlx_lms_kv_bits(tmp_path, family):
    """kv_bits 4 and 8 quantize as mlx-lm's generate_step does, at prompt lengths
    and starts that convert the cache in the prefill, in a verify's range and
    in a plain step: the greedy tokens are mlx-lm's, drafts accepted and rejected."""
    model = model_of(family)
    checked = differs = 0
    for i, (n, start, bits) in enumerate([(40, 20, 4), (30, 35, 8), (33, 38, 4), (50, 200, 8)]):
        ids = ids_of(n, seed=10 + i)
        q = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
        ref = mlx_lm_tokens(model, ids, 30, prefill_step_size=16, **q)
        differs += ref != mlx_lm_tokens(model, ids, 30, prefill_step_size=16)
        for w in (2, 3, 5, 8):
            o = OracleDrafter(n, ref, 512, noise=0.3, seed=w + i)
            pc = PromptCache()
            got = run(model, ids, o, pc, max_tokens=30, block_size=w, guard=False, prefill_step_size=16, **q)
            assert got == ref, (n, start, bits, w)
            kinds = {type(c).__name__ for c in pc.target}
            assert ("QuantizedKVCache" in kinds) == (len(pc.tokens) >= start), kinds
            checked += 1
    assert checked == 16 and differs  # the quantization changes the output: a real check


@pytest.mark.slow
def test_quantized_kv_prompt_cache_continued_across_calls(tmp_path):
    """A chat-like sequence of calls on one prompt cache, quantized mid-way: each
    call equals mlx-lm's generate_step continuing its own cache trimmed the same way."""
    model, d = model_of("qwen3"), _pair(tmp_path)
    q = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=60)
    pc, ref_cache = PromptCache(), make_prompt_cache(model)
    prompt = ids_of(30, seed=20)
    for turn in range(3):
        got = run(model, prompt, d, pc, max_tokens=20, block_size=4, guard=False, **q)
        common = 0 if turn == 0 else n_kept
        trim_prompt_cache(ref_cache, ref_cache[0].offset - common)
        ref = mlx_lm_tokens(model, prompt[common:], 20, cache=ref_cache, **q)
        assert got == ref, turn
        n_kept = len(pc.tokens)
        assert pc.tokens == (prompt + got)[:n_kept]
        prompt = prompt + got + ids_of(15, seed=21 + turn)
    assert isinstance(pc.target[0], QuantizedKVCache)


def test_another_kv_quantization_starts_the_cache_over(tmp_path):
    model = model_of("qwen3")
    ids = ids_of(40, seed=30)
    pc = PromptCache()
    run(model, ids, None, pc, max_tokens=5, kv_bits=4, kv_group_size=32, quantized_kv_start=0, verify_mode="off")
    assert isinstance(pc.target[0], QuantizedKVCache) and pc.target[0].bits == 4
    got = run(model, ids + [9], None, pc, max_tokens=8, verify_mode="off")
    assert got == mlx_lm_tokens(model, ids + [9], 8)
    assert isinstance(pc.target[0], KVCache)


def test_prompt_store_counts_quantized_bytes():
    model = model_of("qwen3")
    ids = ids_of(300, seed=31)
    sizes = {}
    for bits in (None, 8, 4):
        pc = PromptCache()
        run(model, ids, None, pc, max_tokens=2, verify_mode="off", kv_bits=bits, kv_group_size=32,
            quantized_kv_start=0)
        want = sum(a.nbytes for c in pc.target for a in ((c.keys, c.values) if bits is None
                                                          else (*c.keys, *c.values)))
        assert cache_bytes(pc) == want
        sizes[bits] = want
    assert sizes[4] < sizes[8] < 0.4 * sizes[None]  # float32 rows: 4.0x / 2.7x smaller with group 32


def test_kv_settings_are_checked():
    for bad in (dict(kv_bits=7), dict(kv_group_size=48), dict(quantized_kv_start=-1), dict(drafter_window=0),
                dict(drafter_sink=-1), dict(prefill_step_size=0)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


# -- prefill: progress and cancellation ----------------------------------------------------
class Cancel(Exception):
    pass


@pytest.mark.slow
def test_prefill_reports_progress_and_keeps_the_first_logits(tmp_path):
    model, d = model_of("qwen3"), _pair(tmp_path)
    ids = ids_of(100, seed=40)
    seen = []
    got = run(model, ids, d, max_tokens=12, prefill_step_size=32, prefill_progress=lambda a, b: seen.append((a, b)))
    assert seen == [(32, 100), (64, 100), (96, 100), (99, 100), (100, 100)]  # mlx-lm's chunks: 1 token left
    assert got == mlx_lm_tokens(model, ids, 12, prefill_step_size=32)


@pytest.mark.parametrize("family", fast_first(["qwen3", "qwen3_next"]))
def test_cancelled_prefill_leaves_the_prompt_cache_consistent(tmp_path, family):
    """A progress callback that raises stops the call after that chunk: the
    prompt cache holds the chunks done (target rows, drafter features pending),
    and the next call continues from them to mlx-lm's output."""
    model, d = model_of(family), _pair(tmp_path, family)
    ids = ids_of(150, seed=41)

    def stop_at(n):
        def report(done, total):
            if done >= n:
                raise Cancel
        return report

    pc = PromptCache()
    with pytest.raises(Cancel):
        run(model, ids, d, pc, max_tokens=10, prefill_step_size=32, prefill_progress=stop_at(64))
    assert pc.tokens == ids[:64]
    t = Target(model)
    assert all(c.offset == 64 for c in pc.target if isinstance(c, KVCache))
    assert pc.pending.shape[1] == 64 and pc.drafter[0].offset == 0
    with pytest.raises(Cancel):  # cancelled again, one chunk later: the kept chunks are not redone
        run(model, ids, d, pc, max_tokens=10, prefill_step_size=32, prefill_progress=stop_at(32))
    assert pc.tokens == ids[:96] and pc.pending.shape[1] == 96
    stats = []
    for r in stream_generate(model, None, ids, d, prompt_cache=pc, max_tokens=10, prefill_step_size=32,
                             block_size=4, guard=False):
        stats.append(r)
    ref = mlx_lm_tokens(model, ids, 10, prefill_step_size=32)
    assert [r.token for r in stats] == ref
    assert stats[-1].stats.reused_tokens == 96
    assert t.can_trim(pc.target)


@pytest.mark.slow
def test_generate_shows_prefill_progress_for_long_prompts(pairs, tmp_path):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    d = pairs("qwen3", version=1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_DFLASH_HOME": str(tmp_path / "home")}

    def gen(text):
        return subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", str(d / "target"), "--prompt",
                               "-", "--raw", "--max-tokens", "2"], cwd=Path(__file__).resolve().parent.parent,
                              capture_output=True, text=True, env=env, timeout=600, input=text)

    r = gen("hello there " * 3000)
    assert r.returncode == 0, r.stderr
    steps = [(int(a), int(b)) for a, b in re.findall(r"prefill (\d+)/(\d+) tokens", r.stderr)]
    total = steps[-1][1]
    assert total > 4096 and steps[0] == (2048, total) and steps[-1] == (total, total), steps
    assert "prefill" not in gen("hello there").stderr  # a short prompt: no progress line


@pytest.mark.slow
@pytest.mark.parametrize("family", fast_first(["qwen3", "gemma3_text", "qwen3_next"]))
def test_costs_at_long_context_need_no_long_prefill(tmp_path, family, monkeypatch):
    """The guard's long-context curves are timed over `context` cached rows, most
    of them random K/V rows (a step's cost depends on shapes, not values): the
    session prefills at most SYNTHETIC_FROM tokens, and every attention layer
    holds the full context (a sliding one its window) when the steps are timed."""
    model, d = model_of(family), _pair(tmp_path, family)
    fed, seen = [], []
    real_prefill, real_verify = Engine._prefill, Engine.verify

    def prefill(self, s):
        before = len(s.rest)
        out = real_prefill(self, s)
        fed.append(before - len(s.rest))
        return out

    def verify(self, *a, **k):  # what the timed steps see
        seen.append([(type(c).__name__, c.offset, getattr(c, "max_size", None)) for c in self.rows[0].pc.target
                     if isinstance(c, (KVCache, calibrate.RotatingKVCache))])
        return real_verify(self, *a, **k)

    monkeypatch.setattr(Engine, "_prefill", prefill)
    monkeypatch.setattr(Engine, "verify", verify)
    context = 3 * calibrate.SYNTHETIC_FROM
    costs = calibrate.measure_costs(model, d, max_width=3, context=context, widths=(1, 3), min_rounds=1,
                                    max_rounds=2, budget_s=0.01)
    assert sum(fed) <= calibrate.SYNTHETIC_FROM and costs.context == context
    assert costs.t1 > 0 and costs.c[3] > 0 and costs.d[3] > 0
    assert seen and all(off == context if size is None else off >= min(size, context)
                        for layers in seen for _, off, size in layers)


@pytest.mark.slow
def test_a_rows_unseen_context_is_what_its_next_draft_takes_in(tmp_path):
    """What the guard prices as a probe's catch-up (Sequence.unseen): the context
    rows the drafter takes in at its next draft, within its sink and window (a
    prompt's first sink rows and its last window rows), none right after a draft,
    and each row a plain step captures after it."""
    model, d = model_of("qwen3"), _pair(tmp_path)
    eng = Engine(model, None, d)
    eng.submit(ids_of(40), DecodeConfig(drafter_window=8, drafter_sink=2, guard=False, block_size=4, max_tokens=64))
    while not eng.rows:
        eng._prefill(eng.waiting[0])
    s = eng.rows[0]
    assert sum(f.shape[1] for f in s.pending) == 40 and s.unseen == 2 + 8
    mx.eval(eng.propose([s], [4], [DFLASH])[1])
    assert s.unseen == 0
    for _ in range(3):
        eng._plain()
    assert s.unseen == sum(f.shape[1] for f in s.pending) >= 3


def test_costs_at_long_context_time_the_draft_a_decode_pays(tmp_path, monkeypatch):
    """The long curves time each draft with the drafter's context bounded as a
    decode bounds it by default (a sink and a window): timed over every context
    row, a draft at 16k tokens cost 4-5x what decoding pays, and the guard's
    prices as paid only ever raise a price, so it drafted too little at length."""
    model, d = model_of("qwen3"), _pair(tmp_path)
    window, sink = DecodeConfig().drafter_layout
    seen, real_propose = [], Engine.propose

    def propose(self, rows, *a, **k):  # the drafter context each timed draft attends to
        out = real_propose(self, rows, *a, **k)
        seen.append([(c.offset, c.keys.shape[2]) for c in rows[0].pc.drafter])
        return out

    monkeypatch.setattr(Engine, "propose", propose)
    context = window + sink + 3 * calibrate.SYNTHETIC_FROM
    calibrate.measure_costs(model, d, max_width=3, context=context, widths=(1, 3), min_rounds=1, max_rounds=2,
                            budget_s=0.01)
    assert seen and all(off >= context and rows <= window + sink for layers in seen for off, rows in layers), seen
