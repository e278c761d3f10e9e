"""The embedded target's loop measures and its unlikelihood phase: loops are found
exactly, only the model's own looping responses are penalized (from the first
token that copies the cycle), and an unlikelihood step lowers the probability
of continuing the loop."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx import nn

from tools.embedded import target as TT


def test_loop_region_finds_the_periodic_tail():
    head = list(range(100, 130))
    assert TT.loop_region(head + [4, 5, 6] * 20) == (30, 3)
    # the earliest start wins: period 2 and period 4 both describe this tail
    assert TT.loop_region(head + [7, 8] * 30) == (30, 2)
    assert TT.loop_region([9] * 60) == (0, 1)
    # a cycle that does not cover 48 tokens, a cycle longer than 24, and no cycle
    assert TT.loop_region(head + [4, 5] * 20) is None
    assert TT.loop_region(list(range(25)) * 3) is None
    assert TT.loop_region(head + list(range(200, 260))) is None
    # the stuck measure of the evaluation agrees on a never-ending output
    assert TT.stuck_in_loop(head + [4, 5, 6] * 20, finished=False)
    assert not TT.stuck_in_loop(head + [4, 5, 6] * 20, finished=True)


def test_unlikelihood_rows_mark_only_the_repeats_of_unfinished_loops(tmp_path):
    prompt = [1, 2, 3]
    looping = list(range(10, 60)) + [4, 5, 6] * 20          # loop starts at response index 50
    rows = [
        {"i": 0, "prompt": prompt, "response": looping, "finish": "length"},
        {"i": 1, "prompt": prompt, "response": looping, "finish": "stop"},   # ended: not a loop
        {"i": 2, "prompt": prompt, "response": list(range(10, 80)), "finish": "length"},
    ]
    f = tmp_path / "responses.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    x, m = TT.unlikelihood_rows([f], pad_id=0, max_len=128)
    assert x.shape == (1, 129) and m.shape == (1, 128)
    ids = prompt + looping
    assert x[0, :len(ids)].tolist() == ids and not x[0, len(ids):].any()
    first_copy = len(prompt) + 50 + 3                        # second cycle's first token
    want = np.zeros(128)
    want[first_copy - 1:len(ids) - 1] = 1                    # target t-1 predicts ids[t]
    assert m[0].tolist() == want.tolist()

    # cut to a shorter window: the loop start stays in view, the mask follows the tokens
    x, m = TT.unlikelihood_rows([f], pad_id=0, max_len=40)
    assert x.shape == (1, 41)
    cut = first_copy - 20
    assert x[0].tolist() == ids[cut:cut + 41]
    assert m[0].tolist() == [0.0] * 19 + [1.0] * 21

    # near-loops: with ngram=4, an unfinished response whose repeats are not one exact
    # cycle is kept, and only the tokens completing a repeated 4-gram are marked
    near = list(range(10, 60)) + [4, 5, 6, 7, 8] + [50, 51] + [4, 5, 6, 7, 8] + [52]
    f.write_text(json.dumps({"i": 0, "prompt": prompt, "response": near, "finish": "length"}) + "\n")
    assert TT.unlikelihood_rows([f], pad_id=0, max_len=128)[0].shape == (0, 129)
    x, m = TT.unlikelihood_rows([f], pad_id=0, max_len=128, ngram=4)
    assert TT.repeat_positions(near, 4) == [60, 61] and TT.repeat_positions([1, 2, 3], 4) == []
    assert np.flatnonzero(m[0]).tolist() == [len(prompt) + 60 - 1, len(prompt) + 61 - 1]


@pytest.mark.slow
def test_unlikelihood_steps_lower_the_probability_of_the_loop(pairs):
    from mlx_lm import load

    model, _ = load(str(pairs(hidden=64, layers=2, vocab=512) / "target"))
    seq = mx.array([[7, 8, 9] * 11])
    x, y = seq[:, :-1], seq[:, 1:]
    mask = mx.array((np.arange(32) >= 5).astype(np.float32))[None]

    def p_loop():
        logp = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        return mx.exp(mx.take_along_axis(logp, y[..., None], axis=-1)[..., 0])[0, 5:].mean().item()

    def loss(m):
        return TT.unlikelihood_loss(m(x).astype(mx.float32), y, mask)

    # teach the loop first, so that there is something to unlearn
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(30):
        _, g = nn.value_and_grad(model, lambda m: nn.losses.cross_entropy(m(x), y, reduction="mean"))(model)
        opt.update(model, g)
    before = p_loop()
    assert before > 0.5
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(10):
        _, g = nn.value_and_grad(model, loss)(model)
        opt.update(model, g)
    assert p_loop() < before / 2


@pytest.mark.slow
def test_shipped_target_does_not_loop_on_dev_prompts(tmp_path):
    """The embedded target's greedy answers to the first 24 GSM8K dev questions each
    end, or at least are not one cycle repeated (its model card measures 100)."""
    from mlx_lm import load

    from mlx_dflash.train import loop as T
    from mlx_dflash.train.data import _batched_generator
    from mlx_dflash.models.discovery import models_dir

    model, tok = load(str(models_dir() / "target"))
    dev = [json.loads(l) for l in TT.write_gsm8k_dev(tmp_path / "dev.jsonl").read_text().splitlines()]
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in dev[:24]]
    # the batched greedy generation that makes on-policy (and unlikelihood) data
    outs = _batched_generator(model, tok, T.TrainConfig(out=str(tmp_path), gen_max_tokens=160))(prompts)
    stuck = [i for i, (ids, finish) in enumerate(outs) if TT.stuck_in_loop(ids, finish == "stop")]
    assert len(outs) == 24 and stuck == []
