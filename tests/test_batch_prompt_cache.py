"""The batch engine with the prompt store's cached prefixes (issue 24, item 3):
a row started from a cached prefix prefills only the rest and emits exactly
the tokens of the request run alone without any cache (mlx-lm's); the row's
caches come back when it leaves, extracted from the batch as the single-stream
cache kinds, and serve the conversation's next turn, batched or alone; a
cache the single-stream Decoder left serves a batched turn."""

import pytest
from drafters import reference_tokens
from batch_rows import PROMPTS, SeqOracles, model_of, run_rows

from mlx_dflash import DecodeConfig, stream_generate
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.policy.fixed import FixedWidth
from mlx_dflash.cache.prompt_cache import PromptCache
from mlx_dflash.target.adapter import Target

# KV; KV + sliding windows (they wrap: the prompts grow past the window); gated-delta and short-conv recurrent
FAMILIES = ["qwen3", "gemma3_text", "qwen3_next", "lfm2"]
EXTRA = [[5, 6, 7], [40, 41, 42, 43, 44]]  # the user's next messages (token ids)
OTHERS = [(PROMPTS[1], 14), (PROMPTS[2], 9), (PROMPTS[4], 20)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width", [1, 5, 8])
def test_rows_from_cached_prefixes_equal_each_request_alone(family, width, tok):
    model = model_of(family)
    ids = [tok.encode(p) for p in [PROMPTS[0]] + [p for p, _ in OTHERS]]
    maxes = [12] + [m for _, m in OTHERS]
    refs = [reference_tokens(model, tok, p, m) for p, m in zip(ids, maxes)]
    seq = [p + r for p, r in zip(ids, refs)]
    # turn 1: the conversation's row (a fresh cache, its drafter context made at submit) beside others
    oracle = SeqOracles([(0, s) for s in seq + [seq[1], seq[3], seq[2]]], seed=width)  # in the order rows start
    eng = BatchEngine(model, tok, oracle, max_batch=3, policy=FixedWidth(width))
    pc1 = PromptCache()
    out, last, uids = run_rows(eng, [(ids[0], maxes[0], pc1), (ids[1], maxes[1], None)],
                               [(ids[2], maxes[2], None), (ids[3], maxes[3], None)])
    assert [out[u] for u in uids] == refs
    back = eng.released()
    assert [u for u, _ in back] == [uids[0]] and back[0][1] is pc1
    assert last[uids[0]].stats.reused_tokens == 0
    # what its cache holds: the prompt and all it generated but the last token (the next call's first input)
    n1 = len(pc1.tokens)
    assert pc1.tokens == seq[0][:n1] and n1 >= len(seq[0]) - 1
    assert [type(c) for c in pc1.target] == [type(c) for c in Target(model).make_cache()]

    # turn 2, from the cached prefix, joining a running batch
    p2 = seq[0] + EXTRA[0]
    ref2 = reference_tokens(model, tok, p2, 10)
    oracle.bind(pc1, p2 + ref2)
    out, last, uids = run_rows(eng, [(ids[1], maxes[1], None), (ids[3], maxes[3], None)],
                               [(p2, 10, pc1), (ids[2], maxes[2], None)])
    assert out[uids[2]] == ref2 and [out[u] for u in (uids[0], uids[1], uids[3])] == [refs[1], refs[3], refs[2]]
    assert last[uids[2]].stats.reused_tokens == n1 and last[uids[2]].stats.prompt_tokens == len(p2)
    (u, pc2), = eng.released()
    assert u == uids[2] and pc2.tokens == (p2 + ref2)[: len(pc2.tokens)] and len(pc2.tokens) >= len(p2 + ref2) - 1

    # turn 3, alone (the single-stream Decoder) from the row's stored cache
    p3 = p2 + ref2 + EXTRA[1]
    ref3 = reference_tokens(model, tok, p3, 8)
    oracle.bind(pc2, p3 + ref3)
    n2 = len(pc2.tokens)
    rs = list(stream_generate(model, tok, p3, oracle, prompt_cache=pc2,
                              config=DecodeConfig(max_tokens=8, block_size=max(2, width), guard=False)))
    assert [r.token for r in rs] == ref3 and rs[-1].stats.reused_tokens == n2

    # turn 4, batched again, from the cache the single-stream Decoder left
    p4 = p3 + ref3 + EXTRA[0]
    ref4 = reference_tokens(model, tok, p4, 9)
    oracle.bind(pc2, p4 + ref4)
    oracle.plans = [(0, seq[1])]
    n3 = len(pc2.tokens)
    assert n3 >= len(p3) + len(ref3) - 1
    out, last, uids = run_rows(eng, [(ids[1], maxes[1], None)], [(p4, 9, pc2)], steps_before=1)
    assert out[uids[1]] == ref4 and out[uids[0]] == refs[1] and last[uids[1]].stats.reused_tokens == n3
    if width > 1:
        assert oracle.tried > 0


def test_cancelled_row_gives_its_cache_back_consistent(tok):
    """A row cancelled mid-way (or while queued) still gives its cache back: it
    holds exactly the tokens it says, so the next turn from it is exact."""
    model = model_of("gemma3_text")
    p = tok.encode(PROMPTS[3])
    ref = reference_tokens(model, tok, p, 30)
    eng = BatchEngine(model, tok, None, max_batch=2)
    pc, queued = PromptCache(), PromptCache()
    uid = eng.submit(p, DecodeConfig(max_tokens=30), prompt_cache=pc)
    eng.submit(tok.encode(PROMPTS[1]), DecodeConfig(max_tokens=30))
    eng.submit(tok.encode(PROMPTS[2]), DecodeConfig(max_tokens=30))
    late = eng.submit(tok.encode(PROMPTS[4]), DecodeConfig(max_tokens=30), prompt_cache=queued)
    got = []
    while len(got) < 6:
        got += [r.token for u, r in eng.step() if u == uid]
    eng.cancel(uid)
    eng.cancel(late)
    eng.step()
    back = dict(eng.released())
    assert back[uid] is pc and back[late] is queued
    assert pc.tokens == (p + ref)[: len(pc.tokens)] and len(pc.tokens) >= len(p) + len(got) - 1
    q = tok.encode(PROMPTS[4])
    assert queued.tokens == q[: len(queued.tokens)]
    assert pc.drafter is None  # no drafter: the cache serves calls without one
    list(eng.run())
    nxt = list(pc.tokens) + EXTRA[0]
    n = len(pc.tokens)
    rs = list(stream_generate(model, tok, nxt, None, prompt_cache=pc, config=DecodeConfig(max_tokens=8)))
    assert [r.token for r in rs] == reference_tokens(model, tok, nxt, 8) and rs[-1].stats.reused_tokens == n

