"""A scripted target for the agent-API tests: its next token is a fixed
function of the conversation it reads back from its own KV cache, so tool-call
parsing and the three protocols are tested through the real engine (DFlash
with a drafter that knows the script, prompt store, worker, HTTP) with
outputs the tests choose.

Script (applied to the last turn before the generation prompt):
  user "RAW:<text>"   -> the assistant writes <text> verbatim
  tool turn <output>  -> "Answer: <output>"
  user <text>         -> "Echo: <text>"
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

import pytest

import mlx_dflash
from mlx_dflash.models.discovery import models_dir
from mlx_dflash.drafting.drafter import Proposal
from drafters import DrafterDouble

from app.server.catalog import Catalog

# Qwen2.5-style tool template (mlx-lm infers its json_tools parser from it)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{%- for tool_call in m['tool_calls'] or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARK = "<|im_start|>assistant\n"


def tool_call_text(name="get_weather", args=None) -> str:
    """A tool call as the template writes it (send it as "RAW:" + text to have the script call)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args or {"city": "Paris"}}) + "\n</tool_call>"


def tool_tokenizer(src: Path, out: Path):
    """The test pair's tokenizer with the tool template (mlx-lm's TokenizerWrapper)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return load_tokenizer(out)


class Script:
    """The next token after a history of ids (the rules in the module doc)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos = tok.eos_token_id
        self.mark = tok.encode(MARK, add_special_tokens=False)
        self.answers = {}

    def _answer(self, prompt_ids) -> str:
        key = tuple(prompt_ids)
        if key not in self.answers:
            text = self.tok.decode(list(prompt_ids), skip_special_tokens=False)
            turn = text.rsplit("<|im_start|>", 1)[-1].removesuffix("<|im_end|>\n")
            role, _, content = turn.partition("\n")
            content = content.removesuffix("<|im_end|>")
            if role == "tool":
                a = "Answer: " + content.replace("<tool_response>\n", "").replace("\n</tool_response>", "")
            elif content.startswith("RAW:"):
                a = content[4:]
            else:
                a = "Echo: " + content
            self.answers[key] = a
        return self.answers[key]

    def marker_end(self, hist) -> int:
        m = self.mark
        for i in range(len(hist) - len(m), -1, -1):
            if hist[i: i + len(m)] == m:
                return i + len(m)
        return -1

    def next(self, hist, end=None) -> int:
        end = self.marker_end(hist) if end is None else end
        if end < 0:
            return 0
        answer = self._answer(hist[: end - len(self.mark)])
        said = self.tok.decode(hist[end:])
        if not answer.startswith(said) or said == answer:
            return self.eos
        return self.tok.encode(answer[len(said):], add_special_tokens=False)[0]

    def continuation(self, hist, n):
        hist, out = list(hist), []
        end = self.marker_end(hist)
        for _ in range(n):
            t = self.next(hist, end)
            out.append(t)
            hist.append(t)
        return out


class _Layer(nn.Module):
    """Keeps token ids in its KV cache; outputs [current id, next id, 0...]."""

    def __init__(self, script, hidden):
        super().__init__()
        self.script, self.hidden = script, hidden

    def __call__(self, h, mask=None, cache=None):
        L = h.shape[1]
        ids = h[..., :1].reshape(1, 1, L, 1)
        keys, _ = cache.update_and_fetch(ids, ids)
        hist = [int(x) for x in keys[0, 0, :, 0].tolist()]
        end = self.script.marker_end(hist)
        start = len(hist) - L
        nxt = [self.script.next(hist[: start + i + 1], end) if start + i + 1 >= end >= 0 else 0 for i in range(L)]
        out = mx.zeros((1, L, self.hidden))
        return out.at[0, :, 0].add(mx.array(hist[start:], dtype=mx.float32)).at[0, :, 1].add(
            mx.array(nxt, dtype=mx.float32))


class _Head(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def __call__(self, h):
        nxt = mx.clip(mx.round(h[..., 1:2]), 0, self.vocab - 1)
        return mx.where(mx.arange(self.vocab) == nxt, 30.0, 0.0)


class _Inner(nn.Module):
    def __init__(self, script, vocab, hidden):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_tokens.weight = mx.zeros((vocab, hidden)).at[:, 0].add(mx.arange(vocab, dtype=mx.float32))
        self.layers = [_Layer(script, hidden)]


class ScriptModel(nn.Module):
    """An mlx-lm-shaped model (model.layers, embed_tokens, lm_head, its own
    forward) whose one layer runs the script."""

    def __init__(self, script, vocab, hidden=8):
        super().__init__()
        self.args = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=4096)
        self.model = _Inner(script, vocab, hidden)
        self.lm_head = _Head(vocab)
        self.model_type = "scripted"

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache=None):
        h = self.model.embed_tokens(inputs)
        for layer, c in zip(self.model.layers, cache or [KVCache()]):
            h = layer(h, None, c)
        return self.lm_head(h)


class ScriptDrafter(DrafterDouble):
    """Drafts the script's continuation from the context the engine gives it;
    the last draft of a block of 3+ is corrupted, so rejection and rollback run too."""

    version = 1

    def __init__(self, script, vocab, block_size=8):
        self.script, self.vocab, self.block_size = script, vocab, block_size
        self.config = SimpleNamespace(target_layer_ids=[0], mask_token_id=0)

    def make_cache(self, window=None, sink=0):  # (a bounded context changes nothing here)
        return [KVCache()]

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        if new_feats is not None and new_feats.shape[1]:
            n = new_feats.shape[1]
            ids = new_feats[..., :1].reshape(1, 1, n, 1)
            cache[0].update_and_fetch(ids, ids)
        ctx = [int(x) for x in cache[0].keys[0, 0, : cache[0].offset, 0].tolist()] if cache[0].offset else []
        drafts = self.script.continuation(ctx + [anchor], width - 1)
        if len(drafts) >= 3:
            drafts[-1] = (drafts[-1] + 1) % self.vocab
        return Proposal(drafts, None, [1.0] * len(drafts))


class OneModelCatalog(Catalog):
    """A catalog for the server's worker with one model, `model_id`: fixed settings
    and a prompt-cache budget in bytes; `load` is the subclass's."""

    def __init__(self, model_id: str, settings, budget: int):
        self.model_id, self.settings_, self.budget = model_id, settings, budget

    def targets(self):
        return [{"id": self.model_id, "owned_by": "tests", "drafters": []}]

    def default(self):
        return self.model_id

    def settings(self, model_id):
        return self.settings_

    def prompt_cache_bytes(self):
        return self.budget


class EmbeddedCatalog(OneModelCatalog):
    """The server's worker on the embedded pair (target + DFlash 2 drafter), with `settings`."""

    def __init__(self, settings, budget_mb=64):
        super().__init__("embedded/target", settings, budget_mb << 20)

    def load(self, model_id):  # on the worker's thread: MLX streams belong to the thread that made them
        model, tok, drafter = mlx_dflash.load(str(models_dir() / "target"), str(models_dir() / "dflash2"))
        return SimpleNamespace(id=self.model_id, model=model, tokenizer=tok, drafter=drafter, settings=self.settings_)


class ScriptCatalog(OneModelCatalog):
    """The catalog the server's worker loads from: one scripted model, "script"."""

    def __init__(self, tok, budget_mb=64, max_tokens=256, drafter=True):
        from mlx_dflash.settings.schema import ModelSettings

        super().__init__("script", ModelSettings(max_tokens=max_tokens, block_size=4), budget_mb << 20)
        self.tok, self.with_drafter = tok, drafter
        self.script = Script(tok)

    def load(self, model_id):
        if model_id != "script":
            raise ValueError(f"no model '{model_id}'")
        # built here, on the worker's thread: MLX streams belong to the thread that made them
        vocab = len(self.tok.get_vocab())
        model = ScriptModel(self.script, vocab)
        mx.eval(model.parameters())
        drafter = ScriptDrafter(self.script, vocab) if self.with_drafter else None
        return SimpleNamespace(id="script", model=model, tokenizer=self.tok, drafter=drafter, settings=self.settings_)


class LocalServer:
    """create_app(catalog) on uvicorn in a thread, on a free loopback port."""

    def __init__(self, catalog, model="script", **kw):
        import uvicorn

        from app.server import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(catalog, model=model, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.05)

    @property
    def worker(self):
        return self.app.state.worker

    def warmed(self, timeout: float = 300) -> "LocalServer":
        """Wait until the model the server loads at start has every cost curve its
        guard wants (measured while idle, or read from the session's cache), as on a
        server that has run a while. Until then requests decode plain by design, so
        a test that checks drafting would pass or fail by which module ran first."""
        deadline = time.monotonic() + timeout
        while self.worker.engine is None:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not load its model")
            time.sleep(0.05)
        if not self.worker.engine.costs_ready.wait(max(0.0, deadline - time.monotonic())):
            raise RuntimeError("test server did not measure its costs")
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def script_server(key: str):
    """A module-scoped fixture: a LocalServer on the scripted catalog (the test pair's
    tokenizer with the tool template) that wants API key `key`. In a test module:
    `srv = script_server(KEY)`."""
    @pytest.fixture(scope="module")
    def srv(pairs, tmp_path_factory):
        tok = tool_tokenizer(pairs() / "target", tmp_path_factory.mktemp("tok"))
        with LocalServer(ScriptCatalog(tok), api_key=key) as s:
            yield s.warmed()

    return srv


def mutations(body, rng, n):
    """Bodies with one value somewhere replaced by a random JSON value."""
    junk = [None, 0, -1, 1.5, "", "x", [], {}, [1], {"type": "text"}, True, [{"type": "nope"}]]

    def paths(x, p=()):
        yield p
        if isinstance(x, dict):
            for k, v in x.items():
                yield from paths(v, p + (k,))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                yield from paths(v, p + (i,))

    all_paths = [p for p in paths(body) if p]
    for _ in range(n):
        b = copy.deepcopy(body)
        p = rng.choice(all_paths)
        parent = b
        for k in p[:-1]:
            parent = parent[k]
        parent[p[-1]] = rng.choice(junk)
        yield b
