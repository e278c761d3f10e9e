"""Greedy output is token-for-token mlx-lm's own stream_generate."""

import pytest

from drafters import OracleDrafter, reference_tokens
from mlx_dflash import generate
from mlx_dflash import load, stream_generate
from tiers import fast_first

PROMPTS = [
    "def fibonacci(n):", "Natalia sold clips to 48 of her friends", "import os\nimport sys\n",
    "class Stack:\n    def push(self, x):", "The answer is", "x = [i * i for i in range(10)]",
    "Question: how many apples", "return self._cache[key]", "for line in open(path):",
    "# Compute the mean\n", "if __name__ == '__main__':", "Janet's ducks lay 16 eggs per day.",
    "try:\n    import json\nexcept ImportError:", "A robe takes 2 bolts", "while True:",
    "print('hello world')", "async def fetch(url):", "He bought 3 pens for $2 each.",
    "with open('f') as fh:", "lambda x: x + 1",
]
WIDTHS = [1, 2, 3, 5, 8, 16]
MAX = 24


def load_pair(pairs, family="qwen3", version=1, drafter=True):
    """(target, tokenizer, drafter or None) of a test pair."""
    d = pairs(family, version=version)
    return load(str(d / "target"), str(d / "drafter") if drafter else None)


def walk_away(model, tok, prompt, drafter, prompt_cache, max_tokens, after):
    """The tokens a streaming caller got before it stopped reading after `after` of them."""
    out = []
    for r in stream_generate(model, tok, prompt, drafter, max_tokens=max_tokens, prompt_cache=prompt_cache):
        out.append(r.token)
        if len(out) == after:
            break
    return out



@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_equals_mlx_lm_with_real_drafter(pairs, family):
    model, tok, drafter = load_pair(pairs, family)
    checked = 0
    for prompt in PROMPTS:
        ref = reference_tokens(model, tok, prompt)
        for w in WIDTHS:
            r = generate(model, tok, prompt, drafter, max_tokens=MAX, block_size=w, guard=False)
            assert r.token_ids == ref, (prompt, w)
            assert r.stats.mode == "dflash" and r.stats.max_width == w
            checked += 1
        # the default block size: the guard may choose any width up to the drafter's
        r = generate(model, tok, prompt, drafter, max_tokens=MAX)
        assert r.token_ids == ref and 5 <= r.stats.max_width <= drafter.block_size
    assert checked == len(PROMPTS) * len(WIDTHS)


@pytest.mark.slow
def test_greedy_equals_mlx_lm_with_dflash2_and_the_default_mode(pairs):
    """DFlash 2: the selector walks its lattice on the device and the drafts go
    to the verify as a lazy array; fixed widths, and the default (guarded) mode."""
    model, tok, drafter = load_pair(pairs, version=2)
    drafted = 0
    for prompt in PROMPTS:
        ref = reference_tokens(model, tok, prompt)
        for w in WIDTHS:
            r = generate(model, tok, prompt, drafter, max_tokens=MAX, block_size=w, guard=False)
            assert r.token_ids == ref, (prompt, w)
            assert r.stats.policy == f"fixed width {w}"
            drafted += r.stats.drafted
        r = generate(model, tok, prompt, drafter, max_tokens=MAX)  # the default: guard on
        assert r.token_ids == ref and r.stats.mode == "dflash" and r.stats.policy, prompt
    assert drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_equals_mlx_lm_with_partly_right_drafts(pairs, family):
    """A noisy oracle makes cycles accept 0..w-1 drafts: every trim/rollback path runs."""
    model, tok, _ = load_pair(pairs, family, drafter=False)
    vocab = model.args.vocab_size
    acc = {w: [0, 0] for w in WIDTHS}
    for i, prompt in enumerate(PROMPTS):
        ref = reference_tokens(model, tok, prompt)
        n_prompt = len(tok.encode(prompt))
        for w in WIDTHS:
            o = OracleDrafter(n_prompt, ref, vocab, noise=0.3, seed=i * 31 + w)
            r = generate(model, tok, prompt, o, max_tokens=MAX, block_size=w, guard=False)
            assert r.token_ids == ref, (prompt, w)
            acc[w][0] += r.stats.accepted
            acc[w][1] += r.stats.drafted
    for w in WIDTHS[1:]:  # some drafts accepted, some rejected, at every width
        assert 0 < acc[w][0] < acc[w][1], (w, acc[w])


def test_oracle_reaches_tau_w_and_wrong_drafter_gives_tau_1(pairs):
    # guard=False: exactly width w every cycle (at w = 5 the default guard would
    # also take lookup drafts and plain steps)
    model, tok, _ = load_pair(pairs, drafter=False)
    vocab = model.args.vocab_size
    for w in [2, 3, 5, 8]:
        n = 1 + 4 * w  # the prefill token + 4 full cycles
        prompt = PROMPTS[w]
        ref = reference_tokens(model, tok, prompt, n)
        assert len(ref) == n
        p = len(tok.encode(prompt))
        r = generate(model, tok, prompt, OracleDrafter(p, ref, vocab), max_tokens=n, block_size=w, guard=False)
        assert r.token_ids == ref
        assert r.stats.tau == w and r.stats.cycles == 4 and r.stats.acceptance_rate == 1.0
        assert r.from_draft.count(True) == 4 * (w - 1)
        r = generate(model, tok, prompt, OracleDrafter(p, ref, vocab, noise=1.0), max_tokens=n, block_size=w, guard=False)
        assert r.token_ids == ref
        assert r.stats.tau == 1.0 and r.stats.accepted == 0 and r.stats.cycles == n - 1


def test_eos_inside_accepted_run(pairs):
    model, tok, _ = load_pair(pairs, drafter=False)
    prompt = PROMPTS[0]
    full = reference_tokens(model, tok, prompt, 40)
    p = len(tok.encode(prompt))
    for cut in range(5, 20):
        eos = full[cut]
        if eos in full[:cut]:
            continue
        tok.eos_token_ids = {eos}
        try:
            ref = reference_tokens(model, tok, prompt, 40)
            assert ref == full[:cut]
            for w in [3, 5, 8]:
                r = generate(model, tok, prompt, OracleDrafter(p, full, 512), max_tokens=40, block_size=w)
                assert r.token_ids == ref and r.finish_reason == "stop"
                assert eos not in r.token_ids
        finally:
            tok.eos_token_ids = {tok.convert_tokens_to_ids("<|im_end|>")}
        return
    pytest.fail("no usable EOS position in the reference")


def test_stop_string_across_block_boundary(pairs):
    model, tok, _ = load_pair(pairs, drafter=False)
    prompt = PROMPTS[3]
    full = reference_tokens(model, tok, prompt, 40)
    p = len(tok.encode(prompt))
    text = tok.decode(full)
    straddled = 0
    w = 4  # cycles emit tokens [1..4], [5..8], ...: token 4k|4k+1 is a boundary
    for i in range(2, 14):
        a, b = tok.decode(full[:i]), tok.decode(full[: i + 1])
        if not (text.startswith(b) and len(a) > 0 and len(b) > len(a)):
            continue
        stop = a[-1:] + b[len(a):]  # last char of token i-1 + the text of token i
        if text.find(stop) != len(a) - 1:
            continue
        r = generate(model, tok, prompt, OracleDrafter(p, full, 512), max_tokens=40, block_size=w, stop=[stop])
        assert r.finish_reason == "stop"
        assert r.text == text[: len(a) - 1], (i, stop)
        if (i - 1) % w == 0:
            straddled += 1
    assert straddled > 0, "no stop string straddled a block in this run"


@pytest.mark.slow
def test_verify_mode_off_is_plain_decoding(pairs):
    model, tok, drafter = load_pair(pairs)
    for prompt in PROMPTS[:5]:
        r = generate(model, tok, prompt, drafter, max_tokens=MAX, verify_mode="off")
        assert r.token_ids == reference_tokens(model, tok, prompt)
        assert r.stats.mode == "off" and r.stats.drafted == 0


def test_untrimmable_cache_falls_back(pairs, capsys):
    from mlx_lm.models.cache import KVCache

    from mlx_dflash.cache.prompt_cache import PromptCache

    class NoTrim(KVCache):
        def is_trimmable(self):
            return False

    model, tok, drafter = load_pair(pairs)
    pc = PromptCache(target=[NoTrim() for _ in model.layers])
    r = generate(model, tok, PROMPTS[1], drafter, max_tokens=MAX, prompt_cache=pc)
    assert r.token_ids == reference_tokens(model, tok, PROMPTS[1])
    assert r.stats.mode == "off" and "cannot be trimmed" in r.stats.fallback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plain decoding" in err[0]


@pytest.mark.slow
def test_prompt_cache_reuse_is_lossless(pairs):
    from mlx_dflash.cache.prompt_cache import PromptCache

    model, tok, drafter = load_pair(pairs)
    pc = PromptCache()
    conv = PROMPTS[0]
    for turn in range(3):
        r = generate(model, tok, conv, drafter, max_tokens=12, prompt_cache=pc)
        assert r.token_ids == reference_tokens(model, tok, conv, 12)
        if turn:
            assert r.stats.reused_tokens > 0
        conv = conv + r.text + PROMPTS[turn + 1]
    # a diverging prompt trims back to the shared prefix and stays exact
    r = generate(model, tok, PROMPTS[5], drafter, max_tokens=12, prompt_cache=pc)
    assert r.token_ids == reference_tokens(model, tok, PROMPTS[5], 12)


def test_plain_path_keeps_the_prompt_cache_consistent(pairs):
    """Verify mode off runs pipelined (the next step is queued before a token is read):
    after a max-tokens stop, a stop string, or a caller that walks away mid-stream,
    the cached rows still match the cached tokens, so the next turn stays exact."""
    from mlx_dflash.cache.prompt_cache import PromptCache

    model, tok, _ = load_pair(pairs, drafter=False)
    pc = PromptCache()
    conv = PROMPTS[0]
    for turn, how in enumerate(["max", "walk-away", "stop", "max"]):
        ref = reference_tokens(model, tok, conv, 12)
        if how == "walk-away":
            out = walk_away(model, tok, conv, None, pc, max_tokens=12, after=5)
            assert out == ref[:5]
            text = tok.decode(out)
        else:
            stop = [tok.decode(ref[:8])[-3:]] if how == "stop" else None
            r = generate(model, tok, conv, max_tokens=12, prompt_cache=pc, stop=stop)
            assert r.token_ids == ref[: len(r.token_ids)]
            assert len(r.token_ids) == 12 if how == "max" else r.finish_reason == "stop"
            assert r.stats.mode == "off" and (turn == 0 or r.stats.reused_tokens > 0)
            text = r.text
        assert pc.target[0].offset == len(pc.tokens)  # a row per cached token, no stray one
        conv = conv + text + PROMPTS[turn + 1]


@pytest.mark.slow
@pytest.mark.parametrize("how", fast_first(["fixed", "plain-runs", "walk-away"]))
def test_prompt_cache_keeps_the_drafter_context_whole(pairs, how, tmp_path, monkeypatch):
    """Rows fed since the drafter's last draft (accepted rows, the guard's plain
    runs) stay with the cache as pending features: the next turn reuses every
    cached token, even after a caller that stops mid-run, and stays exact."""
    from mlx_dflash.engine import calibrate
    from mlx_dflash.policy.costs import Costs
    from mlx_dflash.cache.prompt_cache import PromptCache, reusable

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))  # this test's cost curve stays with it
    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())
    model, tok, drafter = load_pair(pairs)
    kw = dict(block_size=4) if how == "fixed" else {}
    if how != "fixed":  # costs under which a random drafter does not pay: after a probe, plain steps
        calibrate.remember(model, drafter, Costs(0.01, {1: 1.0, 5: 2.5}, {1: 0.0, 5: 1.0}, t_plain=0.01))
    pc = PromptCache()
    conv = PROMPTS[0]
    for turn in range(3):
        before = list(pc.tokens)
        ids = tok.encode(conv)
        shared = 0
        for x, y in zip(before, ids[:-1]):
            if x != y:
                break
            shared += 1
        ref = reference_tokens(model, tok, conv, 16)
        if how == "walk-away" and turn == 1:
            out = walk_away(model, tok, conv, drafter, pc, max_tokens=16, after=7)
            assert out == ref[:7]
            text = tok.decode(out)
        else:
            r = generate(model, tok, conv, drafter, max_tokens=16, prompt_cache=pc, **kw)
            assert r.token_ids == ref
            assert r.stats.reused_tokens == shared  # every shared cached token, not only the drafted ones
            if how != "fixed":
                assert r.stats.plain_cycles > 0
            text = r.text
        assert reusable(pc, drafter) == len(pc.tokens) == pc.target[0].offset
        rows = pc.pending.shape[1] if pc.pending is not None else 0
        assert pc.drafter[0].offset + rows == len(pc.tokens)
        conv = conv + text + PROMPTS[turn + 1]
