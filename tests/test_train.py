"""Drafter training: the teacher-forced block forward is the inference forward,
a short run lowers the loss and writes a loadable drafter, `--resume` continues
exactly, on-policy responses are the target's own and resumable."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from app.cli import main
from mlx_dflash import generate
from mlx_dflash.train import loop as T
from mlx_dflash.train import data as TD
from mlx_dflash.train import init as TI
from mlx_dflash.train import loss as TL
from mlx_dflash.drafting.drafter import load_drafter, save_drafter, validate
from mlx_dflash.target.adapter import Target

B = 8


@pytest.fixture(scope="module")
def target(pairs):
    path = pairs(hidden=64, layers=4, vocab=512) / "target"
    model, tok = T.load_target(str(path))
    return path, model, tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    f = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    with open(f, "w") as fh:
        for name in ("bisect.py", "heapq.py", "keyword.py", "colorsys.py"):
            fh.write(json.dumps({"text": (root / name).read_text()[:3000]}) + "\n")
    return f


def make_drafter(model, tok, version, seed=0, live=False):
    t = Target(model)
    cfg = T.TrainConfig(out="unused", version=version, block_size=B, layers=2)
    d = TI.init_drafter(TI.drafter_config(t, model, cfg, TI.mask_token_id(tok)), seed)
    if live:  # non-trivial convs and selector, so every DFlash 2 path is exercised
        mx.random.seed(seed + 7)
        d.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.1) for k, v in tree_flatten(d.parameters())
                                 if "conv" in k or "successor" in k]))
    return t, d


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_block_forward_is_the_inference_forward(target, version):
    _, model, tok = target
    t, d = make_drafter(model, tok, version, live=True)
    rng = np.random.default_rng(0)
    tokens = mx.array(rng.integers(4, 500, size=(2, 48)).astype(np.int32))
    anchors = mx.array([[1, 17, 40], [6, 25, 33]], dtype=mx.int32)
    h, truth = TL.block_forward(d, t, tokens, anchors)
    for s in range(2):
        for j in range(3):
            p = int(anchors[s, j])
            np.testing.assert_array_equal(np.array(truth[s * 3 + j]), np.array(tokens[s, p:p + B]))
            # inference: the context is the prefill of every row before the anchor
            _, feats = t(tokens[s:s + 1, :p], t.make_cache(), capture=d.config.target_layer_ids)
            blk = mx.array([[int(tokens[s, p])] + [d.config.mask_token_id] * (B - 1)])
            ref = d(t.embed(blk), feats, d.make_cache())[0]
            np.testing.assert_allclose(np.array(h[s * 3 + j]), np.array(ref), atol=1e-4, rtol=1e-4)


def test_v2_starts_as_v1(target):
    """Same seed: DFlash 2 starts as the DFlash 1 function, and its selector walk
    is the per-position argmax (an honest ablation)."""
    _, model, tok = target
    t, d1 = make_drafter(model, tok, 1)
    _, d2 = make_drafter(model, tok, 2)
    tokens = mx.array(np.random.default_rng(1).integers(4, 500, size=(1, 40)).astype(np.int32))
    anchors = mx.array([[3, 12, 30]], dtype=mx.int32)
    w = TL.position_weights(B)
    l1, (ce1, _, c1, lg1, _, _) = TL.losses(d1, t, tokens, anchors, w, 0.5)
    l2, (ce2, sel, c2, lg2, hd, truth) = TL.losses(d2, t, tokens, anchors, w, 0.5)
    np.testing.assert_allclose(np.array(lg1), np.array(lg2), atol=1e-5)
    assert abs(ce1.item() - ce2.item()) < 1e-5
    walk = TL.selector_walk(d2, t, lg2, hd, truth[:, 0])
    np.testing.assert_array_equal(np.array(walk), np.array(mx.argmax(lg2, axis=-1)))


def test_selector_loss_scores_true_tokens_among_candidates(target):
    _, model, tok = target
    t, d = make_drafter(model, tok, 2, live=True)
    N, V = 6, t.vocab_size
    rng = np.random.default_rng(2)
    truth = mx.array(rng.integers(4, 500, size=(N, B)).astype(np.int32))
    hd = mx.random.normal((N, B - 1, t.hidden_size))
    w = TL.position_weights(B)
    onehot = (mx.arange(V) == truth[:, 1:, None]).astype(mx.float32)
    base = mx.random.normal((N, B - 1, V))
    # the true token is a top candidate: the loss is the candidate CE, and trains the selector
    up = base + 4 * onehot  # in the top K nearly always, not so far above the rest that the CE vanishes
    loss = TL.selector_loss(d, t, up, hd, truth, w)
    ids, cl = d.candidate_selector.candidates(up.reshape(-1, V))
    s = d.candidate_selector.pair_scores(truth[:, :-1].reshape(-1), ids, cl, hd.reshape(-1, t.hidden_size),
                                         t.embed_tokens)
    hit = ids == truth[:, 1:].reshape(-1, 1)
    ce = mx.logsumexp(s, axis=-1) - mx.take_along_axis(s, mx.argmax(hit, axis=-1)[:, None], -1)[:, 0]
    ww = mx.broadcast_to(w, (N, B - 1)).reshape(-1) * hit.any(-1)
    assert hit.any(-1).sum().item() > N  # most positions count
    assert loss.item() == pytest.approx(((ce * ww).sum() / ww.sum()).item(), rel=1e-4)
    g = mx.grad(lambda p: (d.candidate_selector.update(p), TL.selector_loss(d, t, up, hd, truth, w))[1])(
        d.candidate_selector.trainable_parameters())
    assert float(mx.abs(g["successor_projection"]["weight"]).sum()) > 0
    # never a candidate: skipped
    assert TL.selector_loss(d, t, base - 50 * onehot, hd, truth, w).item() == 0.0


def test_fast_math_matches_mlx():
    import mlx.nn as nn

    x = mx.random.normal((64, 300), key=mx.random.key(0)) * 6
    x = mx.concatenate([x, mx.array([[-1e4] * 300, [90.0] * 300])])
    lab = mx.random.randint(0, 300, (66,), key=mx.random.key(1))
    pairs = [(TL.fast_softmax, lambda v: mx.softmax(v, axis=-1)),
             (lambda v: TL.fast_cross_entropy(v, lab), lambda v: nn.losses.cross_entropy(v, lab)),
             (TL.fast_silu, nn.silu)]
    for fast, ref in pairs:
        np.testing.assert_allclose(np.array(fast(x)), np.array(ref(x)), rtol=2e-5, atol=1e-6)
        w = mx.cos(x[:, 0]) if fast(x).ndim == 1 else mx.cos(x)  # an arbitrary cotangent
        gf = mx.grad(lambda v: (fast(v) * w).sum())(x)
        gr = mx.grad(lambda v: (ref(v) * w).sum())(x)
        np.testing.assert_allclose(np.array(gf), np.array(gr), rtol=2e-4, atol=1e-5)


def test_tau_estimate_counts_leading_correct_drafts():
    c = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=bool)
    assert TL.tau_estimate(c, 5) == pytest.approx(1 + (2 + 0 + 4) / 3)
    assert TL.tau_estimate(c, 3) == pytest.approx(1 + (2 + 0 + 2) / 3)


def _train_args(tpath, corpus, out, *extra):
    return ["train-drafter", "--target", str(tpath), "--out", str(out), "--corpus", str(corpus),
            "--block-size", str(B), "--layers", "1", "--seq-len", "128", "--batch", "2", "--anchors", "16",
            "--lr", "3e-3", "--log-every", "4", "--eval-every", "8", "--ckpt-every", "8",
            "--quiet", *extra]


def _log(out):
    return [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]


def test_holdout_rows_are_spread_over_the_source():
    # a source sorted by kind (100 rows of 1s, then 100 of 2s): both kinds are held out,
    # no row is both trained on and held out, and the cap holds
    ex = [([1] * 8, [1] * 8)] * 100 + [([2] * 8, [1] * 8)] * 100
    ds = TD.build_dataset({"r": ex}, seq_len=9, sep=0, holdout=0.1)
    kinds = {int(r[0]) for r in ds.val_tokens}
    assert kinds == {1, 2} and len(ds.val_tokens) == 20 and len(ds.tokens) == 180
    capped = TD.build_dataset({"r": ex}, seq_len=9, sep=0, holdout=0.5, max_val_rows=7)
    assert len(capped.val_tokens) == 7 and len(capped.tokens) == 193


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_training_lowers_loss_and_resume_continues(target, corpus, tmp_path, version):
    tpath, model, _ = target
    out = tmp_path / "run"
    assert main(_train_args(tpath, corpus, out, "--version", str(version), "--steps", "16")) == 0
    log = _log(out)
    evals = [r for r in log if "val_loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 16
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert log[-1]["loss"] < log[1]["loss"]
    assert len(log[-1]["acc"]) == B - 1 and "5" in evals[-1]["tau_est"]
    assert (version == 2) == ("tau_est_selector" in evals[-1])
    # the final drafter loads and fits its target
    d = load_drafter(str(out))
    validate(d, Target(model))
    assert d.version == version and d.block_size == B
    final = dict(tree_flatten(d.parameters()))
    assert (out / "loss.png").exists()

    # resume from the step-8 checkpoint: the same weights come out at step 16
    ck = sorted((out / "checkpoints").glob("step_*"))
    assert [c.name for c in ck] == ["step_0000008", "step_0000016"]
    import shutil

    shutil.rmtree(ck[-1])
    assert main(_train_args(tpath, corpus, out, "--version", str(version), "--steps", "16", "--resume")) == 0
    again = dict(tree_flatten(load_drafter(str(out)).parameters()))
    for k, v in final.items():
        np.testing.assert_allclose(np.array(again[k].astype(mx.float32)), np.array(v.astype(mx.float32)),
                                   atol=1e-2, err_msg=k)
    log2 = _log(out)
    assert [r["step"] for r in log2] == [r["step"] for r in log]  # no duplicated or lost records

    # and a resume with a larger budget continues past it
    assert main(_train_args(tpath, corpus, out, "--version", str(version), "--steps", "20", "--resume")) == 0
    assert _log(out)[-1]["step"] == 20


def test_onpolicy_responses_are_the_targets_and_resumable(target, tmp_path):
    tpath, model, tok = target
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Add two numbers."}]}, {"prompt": "def add(a, b):"},
            {"prompt": "import os\n"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = T.TrainConfig(out=str(tmp_path / "o"), prompts=str(prompts), gen_max_tokens=6, gen_batch=1, max_prompts=2)
    cache = T.generate_responses(model, tok, cfg, progress=False)
    got = [json.loads(l) for l in cache.read_text().splitlines()]
    assert [r["i"] for r in got] == [0, 1]
    for r in got:
        ref = generate(model, tok, r["prompt"], None, max_tokens=6, verify_mode="off")
        assert r["response"] == [t for t in ref.token_ids if t not in tok.eos_token_ids]
    assert got[0]["prompt"] == list(tok.apply_chat_template(rows[0]["messages"], add_generation_prompt=True))
    cfg.max_prompts = None
    T.generate_responses(model, tok, cfg, progress=False)
    got2 = [json.loads(l) for l in cache.read_text().splitlines()]
    assert got2[:2] == got and [r["i"] for r in got2] == [0, 1, 2]  # only the new prompt was generated
    # a last line cut short by a crash is dropped and regenerated
    with open(cache, "a") as f:
        f.write('{"i": 3, "prompt": [1, 2')
    cfg.max_prompts = None
    T.generate_responses(model, tok, cfg, progress=False)
    assert [json.loads(l) for l in cache.read_text().splitlines()] == got2
    # the responses become training rows whose anchors sit in the responses
    ex = TD.examples_from_responses(cache, tok)
    assert all(sum(m) == len(r["response"]) and m[: len(r["prompt"])] == [0] * len(r["prompt"])
               for (ids, m), r in zip(ex, got2))
    # a cache made from other prompts is refused, not overwritten
    prompts.write_text(json.dumps({"prompt": "something else"}) + "\n")
    with pytest.raises(T.TrainError, match="other prompts"):
        T.generate_responses(model, tok, cfg, progress=False)
    assert [json.loads(l) for l in cache.read_text().splitlines()] == got2


def test_cli_errors_are_one_line(target, tmp_path, capsys):
    tpath, _, _ = target
    assert main(["train-drafter", "--target", str(tpath), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no training data" in err and len(err.splitlines()) == 1
    assert main(["train-drafter", "--target", str(tpath), "--out", str(tmp_path / "o"),
                 "--corpus", str(tmp_path / "missing.jsonl"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert main(["train-drafter", "--target", str(tpath), "--out", str(tmp_path / "o"),
                 "--corpus", str(bad), "--quiet"]) == 2
    assert "line 2" in capsys.readouterr().err


def _saved_drafter(model, tok, version, out):
    """A non-trivial drafter for the target, saved in the published layout (bf16)."""
    t, d = make_drafter(model, tok, version, seed=3, live=True)
    save_drafter(d, out, dtype=mx.bfloat16, embed=t.embed_tokens)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_init_starts_from_a_saved_drafter(target, corpus, tmp_path, version):
    tpath, model, tok = target
    src = _saved_drafter(model, tok, version, tmp_path / "src")
    saved = dict(tree_flatten(load_drafter(str(src)).parameters()))
    # no step taken: the run's drafter is the saved one, weight for weight
    cfg = T.TrainConfig(out=str(tmp_path / "zero"), target=str(tpath), version=version, block_size=B, layers=2,
                        corpus=str(corpus), seq_len=128, batch=2, anchors=16, steps=0, init=str(src))
    T.train(cfg, model, tok, progress=False, log=lambda m: None)
    got = dict(tree_flatten(load_drafter(str(tmp_path / "zero")).parameters()))
    assert got.keys() == saved.keys() and len(got) > 0
    for k, v in saved.items():
        np.testing.assert_array_equal(np.array(got[k].astype(mx.float32)), np.array(v.astype(mx.float32)), k)
    zero_eval = _log(tmp_path / "zero")[0]

    # trained from it: step 0 evaluates the saved drafter, training lowers the held-out loss,
    # and a resumed run continues (a published DFlash 2 drafter trains its selector tables)
    out = tmp_path / "run"
    args = _train_args(tpath, corpus, out, "--version", str(version), "--layers", "2", "--init", str(src))
    assert main(args + ["--steps", "16"]) == 0
    log = _log(out)
    assert log[0]["step"] == 0 and log[0]["val_loss"] == pytest.approx(zero_eval["val_loss"], rel=1e-5)
    assert log[-1]["val_loss"] < log[0]["val_loss"]
    assert main(args + ["--steps", "20", "--resume"]) == 0
    assert _log(out)[-1]["step"] == 20
    d = load_drafter(str(out))
    validate(d, Target(model))
    assert d.version == version and d.config.num_hidden_layers == 2


@pytest.mark.slow
def test_init_that_does_not_fit_is_refused_in_one_line(target, corpus, tmp_path, capsys):
    tpath, model, tok = target
    src = _saved_drafter(model, tok, 2, tmp_path / "src")
    run = lambda *extra: main(_train_args(tpath, corpus, tmp_path / "o", "--init", str(src), *extra))  # noqa: E731
    for extra, says in ((["--version", "2", "--layers", "1"], "--layers: 2 here, 1 asked"),
                        (["--version", "1", "--layers", "2"], "--version: 2 here, 1 asked"),
                        (["--version", "2", "--layers", "2", "--block-size", "4"], "--block-size: 8 here, 4 asked"),
                        (["--version", "2", "--layers", "2", "--taps", "2"], "--taps")):
        assert run(*extra) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    # a drafter of another target (here: one with more layers)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_target_layers"] = 9
    (src / "config.json").write_text(json.dumps(cfg))
    assert run("--version", "2", "--layers", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "another target" in err and len(err.splitlines()) == 1, err
    assert main(_train_args(tpath, corpus, tmp_path / "o", "--init", str(tmp_path / "nowhere"))) == 2
    err = capsys.readouterr().err.strip()
    assert "nowhere" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o" / "checkpoints").exists()  # refused before any training


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "qwen3_next"])
def test_training_features_are_the_inference_features(family):
    """Drafter training reads the same tapped rows the decode loop feeds the drafter:
    the model's own forward (gemma's embedding scale, gpt-oss's sliding layers,
    gated-delta layers), where the old hand-written layer loop differed."""
    from tiny_families import build

    from mlx_dflash.train.init import target_features

    model = build(family)
    t = Target(model)
    ids = mx.array([[5, 9, 33, 17, 100, 7, 8, 250, 12, 41, 6, 77]])
    taps = [0, t.num_layers - 2]
    _, want = t(ids, t.make_cache(), taps)
    got = target_features(t, ids, taps)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
