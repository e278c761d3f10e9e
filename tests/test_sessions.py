"""Sessions observe a loaded model without changing it (issue 28 item 5): each
Target forwards through its own view (copies of the module path down to the
layer list, the same weights), so two Decoders on one model in two threads
give exactly their single-threaded outputs, and the model instance (its layer
list entries, every module's children and attributes) stays as loaded."""

import threading

import mlx.core as mx
import pytest
from drafters import OracleDrafter, reference_tokens
from tiny_families import build

from mlx_dflash import generate
from mlx_dflash.target import verify_attention as va
from mlx_dflash.target.adapter import Target

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "Janet's ducks lay 16 eggs per day. She eats",
           "import os\nimport sys\nimport json\n", "class Stack:\n    def push(self, x):"]
MAX = 24
WIDTHS = (3, 5, 8)


def fingerprint(model):
    """Identity of everything a forward could be redirected through: per module,
    its children / arrays / lists (element identities) and its instance attributes."""
    out = []
    for name, m in model.named_modules():
        items = tuple((k, tuple(map(id, v)) if isinstance(v, (list, tuple)) else id(v)) for k, v in m.items())
        attrs = tuple(sorted((k, id(v)) for k, v in vars(m).items()))
        out.append((name, type(m), items, attrs))
    return out


class Watching(OracleDrafter):
    """An oracle that, at every draft (between two verify forwards, while other
    sessions run), checks that the model instance is as loaded."""

    def __init__(self, model, before, *a, **k):
        super().__init__(*a, **k)
        self.model, self.before, self.checks = model, before, 0

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        assert fingerprint(self.model) == self.before, "the loaded model changed during decoding"
        self.checks += 1
        return super().propose(target, anchor, new_feats, cache, width, temperature)


def _runs(model, tok, prompt, refs, before, seed):
    """DFlash greedy at several widths, a 30%-noisy oracle: rollback on most cycles."""
    out = []
    for w in WIDTHS:
        d = Watching(model, before, len(tok.encode(prompt)), refs[prompt], 512, noise=0.3, seed=seed + w,
                     layer_ids=(0, 2))
        r = generate(model, tok, prompt, d, max_tokens=MAX, block_size=w, guard=False)
        assert r.stats.mode == "dflash" and d.checks > 0
        out.append((r.token_ids, r.stats.accepted, r.stats.cycles))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "qwen3"])
def test_two_sessions_in_two_threads_equal_their_single_threaded_runs(family, tok):
    model = build(family)
    before = fingerprint(model)
    prompts = PROMPTS[:2] if family != "nemotron_h" else PROMPTS[2:]
    refs = {p: reference_tokens(model, tok, p, MAX) for p in prompts}
    alone = {p: _runs(model, tok, p, refs, before, seed=i) for i, p in enumerate(prompts)}
    for p in prompts:
        assert all(ids == refs[p] for ids, _, _ in alone[p])  # lossless, and rollback ran
        assert any(0 < acc for _, acc, _ in alone[p])

    got, errors = {}, []
    start = threading.Barrier(len(prompts))

    def work(i, p):
        try:
            start.wait()
            for _ in range(2):  # overlap on every cycle kind
                got.setdefault(p, []).append(_runs(model, tok, p, refs, before, seed=i))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for p in prompts:
        assert got[p] == [alone[p], alone[p]], (family, p)
    assert fingerprint(model) == before


@pytest.mark.parametrize("family", ["falcon_h1", "gemma3_text", "qwen3_5", "lfm2"])
def test_targets_and_rollback_leave_the_model_as_loaded(family, monkeypatch):
    """Probe, capture, verify (split attention included), rollback and training
    features: no entry of the layer list, no child and no attribute of any
    module is replaced, even for a moment (checked from inside the forward,
    through a layer's own call)."""
    monkeypatch.setattr(va, "MIN_SCORES", 0)  # the split form at these short contexts
    monkeypatch.setattr(va, "MIN_SCORES_HALF", 0)
    model = build(family)
    before = fingerprint(model)
    layers = list(model.layers)
    t = Target(model)
    t2 = Target(model)  # a second session on the same instance
    seen = []
    inner = t.layers[1]

    class Check:  # runs inside t's forward, between two layers, on a copy t's view holds
        def __init__(self, mod):
            self.mod = mod

        def __call__(self, *a, **k):
            seen.append(fingerprint(model) == before)
            return self.mod(*a, **k)

        def __getattr__(self, name):
            return getattr(self.mod, name)

    assert inner is layers[1]
    # the view is a copy of the model whose layer list (not the model's) holds the taps
    view_list = next(v for _, m in t._view.named_modules() for v in m.values()
                     if isinstance(v, list) and v and all(hasattr(x, "_layer") for x in v))
    assert t._view is not model and all(x._layer is y or type(x._layer) is type(y)
                                        for x, y in zip(view_list, layers))
    c, c2 = t.make_cache(), t2.make_cache()
    t(mx.arange(4, 14)[None], c, [0, 2])
    t2(mx.arange(4, 9)[None], c2, [1])
    t(mx.arange(20, 28)[None], c, [0, 2])
    t.trim(c, 3)
    t.verify_forward(mx.arange(40, 46)[None], c, [0, 2])  # split attention, on copies of the attention modules
    t.trim(c, 2)
    t.features(mx.arange(4, 12)[None], [0, 1])
    view_list[2] = Check(view_list[2])  # only t's view: the model never sees it
    t(mx.arange(30, 36)[None], c, [0])
    t.verify_forward(mx.arange(50, 55)[None], c, [0])
    assert seen == [True, True]
    assert fingerprint(model) == before
    assert all(x is y for x, y in zip(model.layers, layers))


def test_batched_tokens_capture_and_roll_back():
    """tokens [B, L] (the batching engine's call): logits and features per row are
    the model's own, and a trim drops the same rows of every batch entry."""
    model = build("qwen3_next")
    t = Target(model)
    x = mx.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    c = t.make_cache()
    ref = model(x, cache=model.make_cache() if hasattr(model, "make_cache") else t.make_cache())
    got, f = t(x, c, [0, 3])
    assert mx.array_equal(ref, got).item()
    assert f.shape == (2, 6, 2 * t.hidden_size)
    t(mx.array([[20, 21, 22, 23], [24, 25, 26, 27]]), c)
    t.trim(c, 2)
    b = t.make_cache()
    t(x, b)
    t(mx.array([[20, 21], [24, 25]]), b)
    la, _ = t(mx.array([[30], [31]]), c)
    lb, _ = t(mx.array([[30], [31]]), b)
    assert mx.allclose(la, lb, atol=2e-4, rtol=2e-4).item()
