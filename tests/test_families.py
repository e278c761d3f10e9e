"""Every supported mlx-lm family, exactly: tiny random-weight models built from
mlx-lm's own ModelArgs (tests/tiny_families.py). Per family:
1. the adapter's logits are `model(inputs, cache=cache)`'s, prefill and decode;
2. DFlash greedy == mlx_lm.stream_generate over prompts and widths (every
   sliding window wraps: windows of 6, prompts + outputs of 30+ tokens);
3. an oracle right for a random-length prefix of each block reaches exactly
   the expected tau with identical text (rollback at every position)."""

import random

import mlx.core as mx
import pytest
from drafters import OracleDrafter, PrefixOracle, reference_tokens
from tiny_families import FAMILIES, build

from mlx_dflash import generate
from mlx_dflash.target.adapter import Target
from tiers import fast_first

QUANT = {"qwen3:q4": dict(bits=4, group_size=64), "qwen3_next:q4": dict(bits=4, group_size=32)}
ALL = list(FAMILIES) + list(QUANT)
WIDTHS = [1, 3, 5, 8, 16]
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:", "Natalia sold clips to 48 of her friends in April",
    "import os\nimport sys\nimport json\n", "class Stack:\n    def push(self, x):",
    "Janet's ducks lay 16 eggs per day. She eats", "for line in open(path):\n    line = line.strip()",
]
MAX = 26
_models = {}


def model_of(family):
    if family not in _models:
        _models[family] = build(family, **QUANT_ALL.get(family, {}))
    return _models[family]


MORE_QUANT = {"gpt_oss:q8": dict(bits=8, group_size=32), "lfm2:mixed": dict(bits="mixed", group_size=32),
              "granitemoehybrid:q8": dict(bits=8, group_size=64)}
QUANT_ALL = dict(QUANT, **MORE_QUANT)


@pytest.mark.parametrize("family", fast_first(ALL + list(MORE_QUANT)))
def test_logits_are_the_models_own(family):
    model = model_of(family)
    t = Target(model)
    assert t.can_trim(t.make_cache())
    rng = random.Random(1)
    ids = [rng.randrange(4, 512) for _ in range(40)]
    c_ref, c_t = t.make_cache(), t.make_cache()
    steps = [ids[:14], ids[14:15], ids[15:20], ids[20:21], ids[21:29], ids[29:30], ids[30:40]]
    for s in steps:  # prefill, then decode steps of 1 and of several tokens (past the window)
        x = mx.array(s)[None]
        ref = model(x, cache=c_ref)
        got, feats = t(x, c_t, [0, t.num_layers - 1])
        assert mx.array_equal(ref, got), (family, len(s))
        assert feats.shape == (1, len(s), 2 * t.hidden_size)


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL + list(MORE_QUANT))
def test_greedy_equals_mlx_lm(family, tok):
    model = model_of(family)
    vocab = 512
    acc = [0, 0]
    for i, prompt in enumerate(PROMPTS[:5]):
        ref = reference_tokens(model, tok, prompt, MAX)
        assert len(ref) == MAX
        n = len(tok.encode(prompt))
        for w in WIDTHS:
            o = OracleDrafter(n, ref, vocab, noise=0.3, seed=i * 31 + w, layer_ids=(0, 2))
            r = generate(model, tok, prompt, o, max_tokens=MAX, block_size=w)
            assert r.token_ids == ref, (family, prompt, w)
            assert r.stats.mode == "dflash" and r.stats.fallback is None
            acc[0] += r.stats.accepted
            acc[1] += r.stats.drafted
    assert 0 < acc[0] < acc[1]  # drafts both accepted and rejected: rollback ran


def _expected(log, width, max_tokens):
    """(accepted, cycle tokens, cycles) the loop must report for the oracle's
    choices, replaying its width rule (the published loops': the last block is at
    most the tokens left + 1 wide, a bonus past max_tokens dropped)."""
    emitted, acc, tokens, cycles, log = 1, 0, 0, 0, list(log)  # 1: the prefill token
    while emitted < max_tokens:
        ww = min(width, max_tokens - emitted + 1)
        a = 0
        if ww > 1:
            w, k = log.pop(0)
            assert w == ww
            a = k
        acc += a
        e = min(a + 1, max_tokens - emitted)
        emitted, tokens, cycles = emitted + e, tokens + e, cycles + 1
    assert not log
    return acc, tokens, cycles


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_partial_acceptance_reaches_exact_tau(family, tok):
    model = model_of(family)
    rng = random.Random(family)
    for w in WIDTHS:
        prompt = PROMPTS[(WIDTHS.index(w) + 1) % len(PROMPTS)]
        ref = reference_tokens(model, tok, prompt, MAX)
        o = PrefixOracle(len(tok.encode(prompt)), ref, 512, seed=rng.randrange(1 << 30), layer_ids=(1,))
        r = generate(model, tok, prompt, o, max_tokens=MAX, block_size=w, guard=False)  # fixed widths
        assert r.token_ids == ref, (family, w)
        acc, cyc_tokens, cycles = _expected(o.log, w, MAX)
        assert (r.stats.accepted, r.stats.cycle_tokens, r.stats.cycles) == (acc, cyc_tokens, cycles), (family, w)
        assert r.stats.tau == cyc_tokens / cycles
        if w > 1:
            assert any(0 < k < w - 1 for _, k in o.log)  # partial acceptance happened


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_real_random_drafter_is_lossless(family, tok, tmp_path):
    """A real (random) DFlash drafter on a recurrent and a sliding-window target."""
    from make_test_pair import make_drafter
    from tiny_families import config

    model = model_of(family)
    for version in (1, 2):
        d = make_drafter(tmp_path / f"d{version}", config(family), 3, version=version, block_size=8, seed=version)
        for i, prompt in enumerate(PROMPTS[:3]):
            ref = reference_tokens(model, tok, prompt, MAX)
            for w in (3, 8):
                r = generate(model, tok, prompt, d, max_tokens=MAX, block_size=w)
                assert r.token_ids == ref, (family, version, prompt, w)
                assert r.stats.mode == "dflash" and r.stats.drafted > 0


def _write_checkpoint(out, family, model, dtype):
    import json

    from make_test_pair import write_tokenizer
    from mlx.utils import tree_flatten
    from tiny_families import config

    out.mkdir(parents=True)
    write_tokenizer(out, 512)
    w = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), w)
    (out / "config.json").write_text(json.dumps(dict(config(family), eos_token_id=2, torch_dtype="bfloat16")))


@pytest.mark.slow
def test_bf16_checkpoint_stays_bf16_and_equals_mlx_lm_generate(tmp_path, monkeypatch):
    import mlx_lm

    from mlx_dflash.models.loader import load
    from mlx_dflash.models.loader import model_dtype

    monkeypatch.delenv("MLX_DFLASH_DTYPE", raising=False)
    _write_checkpoint(tmp_path / "t", "gemma3_text", model_of("gemma3_text"), mx.bfloat16)
    model, tk, _ = load(str(tmp_path / "t"), auto_drafter=False)
    assert model_dtype(model) == "bfloat16"  # no silent widening
    for i, prompt in enumerate(PROMPTS[:5]):
        ref_text = mlx_lm.generate(model, tk, prompt, max_tokens=MAX)
        ref = reference_tokens(model, tk, prompt, MAX)
        for w in (3, 8):
            o = OracleDrafter(len(tk.encode(prompt)), ref, 512, noise=0.3, seed=i + w, layer_ids=(1,))
            r = generate(model, tk, prompt, o, max_tokens=MAX, block_size=w)
            assert r.text == ref_text and r.token_ids == ref, (prompt, w)
    monkeypatch.setenv("MLX_DFLASH_DTYPE", "float32")  # the explicit widening option
    model, _, _ = load(str(tmp_path / "t"), auto_drafter=False)
    assert model_dtype(model) == "float32"


def test_unsupported_family_is_refused_before_its_weights_load(tmp_path):
    """deepseek_v41 keeps a custom per-layer cache rollback cannot handle: refused
    with one line naming the reason, at the lazy load (no weight is read)."""
    from mlx_lm.utils import _get_classes

    from mlx_dflash.models.loader import load
    from mlx_dflash.target.adapter import TargetError

    cfg = dict(model_type="deepseek_v41", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
               head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2, o_lora_rank=32,
               moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=8,
               index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=2, candidate_topk_blocks=4)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    import json

    from make_test_pair import write_tokenizer
    from mlx.utils import tree_flatten

    out = tmp_path / "ds"
    out.mkdir()
    write_tokenizer(out, 512)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError) as e:
        load(str(out), auto_drafter=False)
    msg = str(e.value)
    assert "\n" not in msg and "deepseek_v41" in msg and "LayerCache" in msg


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_taps_are_decoder_layer_outputs(family):
    """On a plain decoder the captured rows are the residual stream after layer i
    (the reference meaning of target_layer_ids), recomputed here layer by layer."""
    from mlx_lm.models.base import create_attention_mask

    model = model_of(family)
    t = Target(model)
    x = mx.arange(4, 20)[None]
    _, feats = t(x, None, [0, 2, 3])
    h = model.model.embed_tokens(x)
    mask = create_attention_mask(h, None)
    outs = []
    for layer in model.model.layers:
        h = layer(h, mask, None)
        outs.append(h)
    want = mx.concatenate([outs[0], outs[2], outs[3]], axis=-1)
    assert mx.allclose(feats, want, atol=1e-5).item()
