"""An id the tokenizer has no text for (a model vocabulary padded past its
tokenizer's, or a hole in it) is emitted as U+FFFD and counted, never a crash
(issue 37: mlx-lm's detokenizer fails with a TypeError on such an id, or writes
"!"): in the engine (mlx_dflash/engine/emitter.py), every API, and `generate`."""

import mlx_dflash  # noqa: F401  (fast BLAS; must precede mlx)

import json
import subprocess
import sys

import httpx
import mlx.core as mx
import pytest
from make_test_pair import make_target, write_tokenizer
from scripted import LocalServer, OneModelCatalog

from mlx_dflash import DecodeConfig, load, stream_generate
from mlx_dflash.engine.emitter import REPLACEMENT, textless
from mlx_dflash.settings.schema import ModelSettings

pytestmark = pytest.mark.timeout(600)
TOK_VOCAB, MODEL_VOCAB = 512, 640
PAST = 600  # an id past the tokenizer's vocabulary


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A tiny random target whose vocabulary (640) is larger than its tokenizer's (512)."""
    d = tmp_path_factory.mktemp("padded")
    make_target(d, "qwen3", 64, 2, MODEL_VOCAB, 0)
    write_tokenizer(d, TOK_VOCAB)  # the tokenizer of 512 ids, over the one of 640
    return d


@pytest.fixture(scope="module")
def holed(tmp_path_factory):
    """The same target with a hole in its tokenizer: one id in the middle has no token
    (mlx-lm's BPE detokenizer maps it to None and fails on it with a TypeError)."""
    d = tmp_path_factory.mktemp("holed")
    make_target(d, "qwen3", 64, 2, TOK_VOCAB, 0)
    t = json.loads((d / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    gone = max(vocab, key=vocab.get)  # the last merge's token: nothing merges into it
    hole = vocab.pop(gone)
    t["model"]["merges"] = [m for m in t["model"]["merges"]
                            if (m if isinstance(m, str) else " ".join(m)).replace(" ", "") != gone]
    (d / "tokenizer.json").write_text(json.dumps(t))
    return d, hole


def pattern(a, bad):
    """A logits processor that makes the generated tokens a, a, bad, a, a, bad, ..."""
    def proc(tokens, logits):
        want = bad if tokens.size % 3 == 2 else a
        return mx.where(mx.arange(logits.shape[-1]) == want, 1e4, logits)

    return proc


def test_engine_emits_the_replacement_character(padded, holed):
    for path, bad in ((padded, PAST), (holed[0], holed[1])):
        model, tok, _ = load(str(path))
        no_text = textless(tok)
        assert no_text(bad) and not no_text(5)
        [a] = tok.encode("a", add_special_tokens=False)
        n0 = 3  # the prompt: 3 ids, so the pattern starts at the first generated token
        cfg = DecodeConfig(max_tokens=24, verify_mode="off", logits_processors=[pattern(a, bad)])
        rs = list(stream_generate(model, tok, [5, 6, 7][:n0], None, config=cfg))
        assert [r.token for r in rs] == [a, a, bad] * 8 and rs[-1].stats.generation_tokens == 24  # counted
        assert "".join(r.text for r in rs) == ("aa" + REPLACEMENT) * 8


class Padded(OneModelCatalog):
    def __init__(self, path):
        super().__init__("padded", ModelSettings(max_tokens=12, dflash_enabled=False), 16 << 20)
        self.path = path

    def load(self, model_id):
        from types import SimpleNamespace

        model, tok, _ = load(str(self.path))
        return SimpleNamespace(id="padded", model=model, tokenizer=tok, drafter=None, settings=self.settings_)


def test_every_api_answers_with_the_replacement_character(padded):
    bias = {str(PAST): 100}
    with LocalServer(Padded(padded), model="padded") as srv:
        c = httpx.Client(base_url=srv.url, timeout=120)
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"model": "padded", "messages": msgs, "logit_bias": bias})
        d = r.json()
        assert r.status_code == 200 and d["choices"][0]["message"]["content"] == REPLACEMENT * 12
        assert d["usage"]["completion_tokens"] == 12
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": "padded", "messages": msgs, "logit_bias": bias, "stream": True}) as s:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in s.iter_lines() if line.startswith("data: {"))
        assert text == REPLACEMENT * 12
        r = c.post("/v1/completions", json={"model": "padded", "prompt": "hi", "logit_bias": bias})
        assert r.json()["choices"][0]["text"] == REPLACEMENT * 12
        r = c.post("/v1/completions", json={"model": "padded", "prompt": "hi", "logit_bias": bias, "logprobs": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLACEMENT * 12
        # Messages and Responses take no logit_bias: the random model's own ids, some past the tokenizer
        r = c.post("/v1/messages", json={"model": "padded", "max_tokens": 64, "messages": msgs})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
        r = c.post("/v1/responses", json={"model": "padded", "input": "hi", "max_output_tokens": 64, "store": False})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1


@pytest.mark.slow
def test_generate_prints_it(padded):
    """`generate` on the padded model: the random model's greedy answer has ids past
    the tokenizer (checked), printed as U+FFFD."""
    model, tok, _ = load(str(padded))
    ids = [r.token for r in stream_generate(model, tok, "hello", None, config=DecodeConfig(max_tokens=40))]
    assert any(textless(tok)(t) for t in ids)
    r = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", str(padded), "--prompt", "hello",
                        "--max-tokens", "40", "--verify-mode", "off"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert REPLACEMENT in r.stdout and "Traceback" not in r.stderr
