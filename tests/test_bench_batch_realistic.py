"""The realistic-regime concurrency bench (`mlx-dflash bench --realistic --batch`,
issue 24): the batch engine with replayed acceptance keeps every row exact,
each row's drafts follow its own continuation (accepted in ragged counts, the
real batched drafter forward run), and the bench end to end on a tiny target."""

import json
import random

import pytest

from app.bench import batch_realistic as bbr
from app.bench import realistic as br
from app.bench.runs import run_mlx_lm
from mlx_dflash import DecodeConfig
from mlx_dflash.policy.fixed import FixedWidth
from tiers import fast_first

TINY = dict(br._QWEN3_06B, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)


@pytest.fixture(scope="module")
def tiny():
    br.TARGETS["tiny-batch"] = (TINY, 0, "tiny Qwen3")
    model = br.build_target("tiny-batch", "float32")
    drafter = br.build_drafter(model, 1, "float32")
    yield model, drafter, br.word_tokenizer(drafter.config.vocab_size)
    del br.TARGETS["tiny-batch"]


@pytest.mark.parametrize("width", fast_first([5, 16]))
def test_replayed_rows_equal_plain_and_accept_their_own_drafts(tiny, width):
    model, drafter, tok = tiny
    vocab, block = drafter.config.vocab_size, drafter.block_size
    rng = random.Random(width)
    prompts = [[rng.randrange(4, vocab - 1) for _ in range(n)] for n in (9, 23, 40, 15)]
    maxes = [30, 12, 41, 25]  # rows leave at different cycles
    conts = [run_mlx_lm(model, tok, p, m).tokens for p, m in zip(prompts, maxes)]
    lengths = []
    eng = bbr.ReplayBatchEngine(model, tok, drafter, max_batch=4, policy=FixedWidth(width))
    forwards = []
    real = bbr.BatchEngine.propose

    def counted(self, rows, widths, sources):  # the real batched drafter forward runs in every drafting cycle
        n = sum(1 for src, w in zip(sources, widths) if src == "dflash" and w > 1)
        if n:
            forwards.append(n)
        return real(self, rows, widths, sources)

    bbr.BatchEngine.propose = counted
    try:
        uids = [eng.submit_replay(p, br.Replay(p, c, br.alpha_for(4.0, block), block, vocab, i, lengths),
                                  DecodeConfig(max_tokens=m, lookup=False)) for i, (p, c, m) in enumerate(zip(prompts, conts, maxes))]
        out = {u: [] for u in uids}
        last = {}
        for u, r in eng.run():
            out[u].append(r.token)
            last[u] = r
    finally:
        bbr.BatchEngine.propose = real
    for u, c in zip(uids, conts):
        assert out[u] == c  # greedy: the replay never changes the output
    assert forwards and max(forwards) == 4 and len(lengths) == sum(forwards)
    # each row accepts what its replay drew (min(length, drafts verified)), so the rows accept ragged counts
    acc = [last[u].stats.accepted for u in uids]
    assert sum(acc) > 0 and len(set(acc)) > 1
    assert sum(acc) <= sum(min(n, width - 1) for n in lengths)


@pytest.mark.slow
def test_bench_batch_realistic_tiny(tmp_path, tiny):
    from app.cli import main

    out = tmp_path / "r"
    assert main(["bench", "--realistic", "--batch", "--targets", "tiny-batch", "--draft-layers", "1", "--streams", "1,3",
                 "--max-tokens", "20", "--reps", "1", "--prompt-len", "16", "--batch-widths", "8",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {(r["system"], r["streams"]): r for r in res["rows"]}
    assert set(rows) == {(s, n) for s in ("dflash-serial", "dflash-batched", "dflash-batched-w8", "plain-batched")
                         for n in (1, 3)}
    for key, r in rows.items():
        assert r["exact"], key  # every stream's ids equal the target's own continuation
        assert r["tokens"] == 20 * key[1]
    for n in (1, 3):
        w8 = rows[("dflash-batched-w8", n)]
        assert w8["tau"] > 1 and 8 in w8["widths"]  # (a row's last cycle may be shorter: its tokens left)
        assert w8["efficiency"] == pytest.approx(w8["speedup"] / w8["limit"])
    assert set(res["curves"]) == {"1", "2", "4"}  # the guard's sizes around 3 rows
