"""Target adapter: the mlx-lm model's OWN forward (`model(tokens, cache=cache)`,
whatever it does inside: embedding scales, soft-capping, per-layer masks,
sliding windows, MoE routing, recurrent layers) plus the outputs of chosen
decoder layers, captured on the one loaded instance; rollback after a verify
for every cache kind (rollback.py)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from . import rollback as rb


class TargetError(ValueError):
    """A model this adapter cannot drive exactly (the reason is in the message)."""


# The layer list and sub-modules of the loaded instance are swapped for
# recorders during one forward and restored right after; one forward at a time.
_LOCK = threading.RLock()
_PROBES: dict = {}  # id(model) -> _Probe, dropped with the model
# Forwards of up to this many tokens (verify blocks) keep the recurrent
# sub-modules' inputs for a rollback; a long prefill chunk does not hold them.
MAX_REPLAY = 64


@dataclass
class _Probe:
    """What one lazy forward (never evaluated) told about a model."""

    problem: Optional[str] = None
    head: object = None  # index into _heads(model), or "tied"
    mixers: List[Tuple[int, str]] = field(default_factory=list)  # (layer, child) owning a recurrent state


class _Tap:
    """Stands in for decoder layer i in the instance's layer list during one
    forward and keeps its output (the first element when a layer returns a tuple)."""

    def __init__(self, layer, i: int, out: dict, stop_at: Optional[int] = None):
        self._layer, self._i, self._out, self._stop = layer, i, out, stop_at

    def __call__(self, *args, **kwargs):
        y = self._layer(*args, **kwargs)
        self._out[self._i] = y[0] if isinstance(y, tuple) else y
        if self._i == self._stop:
            raise _Stop
        return y

    def __getattr__(self, name):
        return getattr(self._layer, name)


class _Stop(Exception):
    pass


class _Counting:
    """Counts the calls of a head candidate during the probe."""

    def __init__(self, fn):
        self._fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def _layers(model) -> list:
    layers = getattr(model, "layers", None)  # every mlx-lm model exposes its decoder list
    if isinstance(layers, (list, tuple)) and layers and all(isinstance(l, nn.Module) for l in layers):
        return layers
    raise TargetError(f"model type '{_name(model)}' exposes no decoder layer list (model.layers)")


def _layer_list(model, layers) -> Tuple[list, List[int]]:
    """The list object the forward iterates (`model.layers` may be a slice copy,
    e.g. pipeline_layers) and each layer's position in it."""
    first = layers[0]
    for _, m in model.named_modules():
        for v in m.values():
            if isinstance(v, list) and any(x is first for x in v):
                ids = {id(x): k for k, x in enumerate(v)}
                if all(id(l) in ids for l in layers):
                    return v, [ids[id(l)] for l in layers]
    raise TargetError(f"model type '{_name(model)}': its decoder layers are not held in a list")


def _name(model) -> str:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None) \
        or type(model).__module__.rsplit(".", 1)[-1]


_EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "tok_embeddings", "word_embeddings", "embedding")


def _embedding(model) -> nn.Module:
    """The token embedding table: a named input embedding first, else the largest table."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    if not found:
        raise TargetError(f"model type '{_name(model)}' has no token embedding")
    named = [m for n, m in found if n.rsplit(".", 1)[-1] in _EMBED_NAMES]
    return named[0] if named else max(found, key=lambda nm: nm[1].weight.shape[0])[1]


def _heads(model) -> list:
    """(parent, attribute) of every sub-module named lm_head."""
    out = []
    for n, m in model.named_modules():
        if n == "lm_head" or n.endswith(".lm_head"):
            parent = model
            for part in n.split(".")[:-1]:
                parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
            out.append((parent, "lm_head"))
    return out


def _probe(target: "Target") -> _Probe:
    """One lazy forward over 2 tokens with a fresh cache, never evaluated (only
    the graph is built): which head the model applies, which decoder sub-module
    receives each recurrent state, and any cache kind rollback cannot handle."""
    model = target.model
    p = _PROBES.get(id(model))
    if p is not None:
        return p
    p = _Probe()
    try:
        cache = make_prompt_cache(model)
    except Exception as e:  # noqa: BLE001 - a model without a usable cache
        p.problem = f"cannot build its cache ({type(e).__name__}: {e})"
        return p
    bad = rb.unsupported_kind(cache)
    if bad:
        p.problem = f"its cache kind {bad} cannot be rolled back after a verify"
        return p
    states = {id(a): a for a in rb.recurrent(cache)}
    owner = {}  # id(sub-module) -> (layer index, child name)
    names = []
    if states:
        for i, layer in enumerate(target.layers):
            for n, m in layer.children().items():
                if isinstance(m, nn.Module):
                    owner[id(m)] = (i, n)
                    names.append((i, n))
    seen = {}

    def on_call(mod, args, kwargs):
        for c in rb.caches_in(args, kwargs):
            if id(c) in states:
                seen[id(c)] = owner[id(mod)]

    heads = [(parent, attr, _Counting(getattr(parent, attr))) for parent, attr in _heads(model)]
    emb = target.embed_tokens
    tied = _Counting(emb.as_linear)
    undo = []
    try:
        emb.__dict__["as_linear"] = tied
        for parent, attr, c in heads:
            parent.__dict__[attr] = c
        undo = rb.install_spies(target.layers, names, on_call)
        model(mx.zeros((1, 2), dtype=mx.int32), cache=cache)
    except Exception as e:  # noqa: BLE001 - the model's own forward refused the probe
        msg = str(e).splitlines()[0] if str(e) else ""
        p.problem = f"its forward failed on a probe ({type(e).__name__}: {msg})"
        return p
    finally:
        rb.remove_spies(undo)
        emb.__dict__.pop("as_linear", None)
        for parent, attr, _ in heads:
            parent.__dict__.pop(attr, None)
    fired = [k for k, (_, _, c) in enumerate(heads) if c.n]
    if fired:
        p.head = fired[0]
    elif tied.n:
        p.head = "tied"
    else:
        p.problem = "its output head is neither an lm_head nor the tied embedding"
        return p
    missing = [k for k in states if k not in seen]
    if missing:
        p.problem = "a recurrent state is used outside a decoder layer's sub-modules"
        return p
    p.mixers = sorted(set(seen.values()))
    _PROBES[id(model)] = p
    weakref.finalize(model, _PROBES.pop, id(model), None)
    return p


def forget(model) -> None:
    """Drop what was learnt about `model` (its probe): for a model whose layers
    were changed in place since, e.g. split over ranks (distributed.split_model)."""
    _PROBES.pop(id(model), None)


class Target:
    """`__call__(tokens[1, L], cache, capture) -> (logits, feats)`: logits are
    exactly `model(tokens, cache=cache)`; feats concatenate the outputs of the
    decoder layers in `capture` (indices into `model.layers`, any layer kind)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = _layers(model)
        self.num_layers = len(self.layers)
        self._list, self._pos = _layer_list(model, self.layers)
        self.embed_tokens = _embedding(model)
        with _LOCK:
            probe = _probe(self)
        if probe.problem:
            raise TargetError(f"model type '{_name(model)}' is not supported: {probe.problem}")
        self._lm_head = None
        if probe.head != "tied":
            parent, attr = _heads(model)[probe.head]
            self._lm_head = getattr(parent, attr)
        self._mixers = probe.mixers
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.hidden_size = self.embed_tokens(mx.array([[0]])).shape[-1]  # shape only, not computed
        args = getattr(model, "args", None)
        self.sliding_window = getattr(args, "sliding_window", None)
        self._rec: Optional[rb.Record] = None  # the last forward's rollback record

    # -- pieces the drafter borrows ------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        """The raw embedding table (no model-specific scale), as the drafter is trained."""
        return self.embed_tokens(tokens)

    def head(self, h: mx.array) -> mx.array:
        """The LM head (or tied embedding), without any final soft-cap or scale."""
        if self._lm_head is not None:
            return self._lm_head(h)
        return self.embed_tokens.as_linear(h)

    # -- caches --------------------------------------------------------------------
    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def can_trim(self, cache: list, n: Optional[int] = None) -> bool:
        """Without n: whether every cache kind in `cache` can be rolled back after
        a verify. With n: whether the last n tokens can be dropped right now."""
        if rb.unsupported_kind(cache):
            return False
        for x in (x for c in cache for x in rb.leaves(c)):
            if isinstance(x, rb.ROW_CACHES) and not x.is_trimmable():
                return False
        if n is None or n <= 0:
            return True
        rec = self._rec
        for x in (x for c in cache for x in rb.leaves(c)):
            if isinstance(x, rb.RotatingKVCache) and not rb.rotating_can_trim(x, n):
                return False
            if isinstance(x, rb.ArraysCache) and not (
                rec is not None and rec.cache is cache and id(x) in rec.saved
                and (n == rec.length or (n < rec.length and rec.calls))
            ):
                return False
        return True

    def checkpoint(self, cache: list):
        """`restore = target.checkpoint(cache)`: `restore()` puts the cache back
        exactly as it is now, after any number of forwards (O(1), no copy)."""
        self._rec = None
        return rb.checkpoint(cache)

    def trim(self, cache: list, n: int) -> None:
        """Drop the last n tokens (n <= the last forward's length for recurrent
        and wrapped sliding-window caches)."""
        if n <= 0:
            return
        if not self.can_trim(cache, n):
            raise rb.RollbackError(f"this cache cannot drop its last {n} tokens now")
        for x in (x for c in cache for x in rb.leaves(c)):
            if isinstance(x, rb.ROW_CACHES):
                rb.row_trim(x, n)
            elif isinstance(x, rb.RotatingKVCache):
                rb.rotating_trim(x, n)
        if self._rec is not None and self._rec.cache is cache:
            rb.replay(self._rec, n)
            self._rec = None

    # -- the forward -----------------------------------------------------------------
    def __call__(self, tokens: mx.array, cache: list, capture: Sequence[int] = ()):
        """tokens [1, L] -> (logits [1, L, V], features [1, L, len(capture)*H] or None)."""
        capture = list(capture)
        bad = [i for i in capture if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(f"capture layers {bad} outside the target's {self.num_layers} layers")
        L = tokens.shape[1]
        rec = rb.snapshot(cache, L) if cache is not None and self._mixers else None
        if rec is not None and not rec.saved:
            rec = None
        feats: dict = {}
        with _LOCK:
            undo, taps = [], {}
            try:
                if rec is not None and 1 < L <= MAX_REPLAY:
                    undo = rb.install_spies(self.layers, self._mixers,
                                            lambda m, a, k: rec.calls.append(rb.Call(m, a, k)))
                for i in set(capture):
                    taps[i] = self.layers[i]
                    self._list[self._pos[i]] = _Tap(taps[i], i, feats)
                logits = self.model(tokens, cache=cache)
            finally:
                for i, layer in taps.items():
                    self._list[self._pos[i]] = layer
                rb.remove_spies(undo)
        self._rec = rec
        if not capture:
            return logits, None
        return logits, mx.concatenate([feats[i] for i in capture], axis=-1)

    def features(self, tokens: mx.array, layer_ids: Sequence[int]) -> mx.array:
        """tokens [S, L] -> tapped layer outputs [S, L, taps*H] through the model's
        own forward, no cache; layers after the last tap are not run (training)."""
        feats: dict = {}
        last = max(layer_ids)
        with _LOCK:
            taps = {}
            try:
                for i in set(layer_ids):
                    taps[i] = self.layers[i]
                    self._list[self._pos[i]] = _Tap(taps[i], i, feats, stop_at=last)
                self.model(tokens)
            except _Stop:
                pass
            finally:
                for i, layer in taps.items():
                    self._list[self._pos[i]] = layer
        return mx.concatenate([feats[i] for i in layer_ids], axis=-1)
