"""Target adapter: the mlx-lm model's OWN forward (`model(tokens, cache=cache)`,
whatever it does inside: embedding scales, soft-capping, per-layer masks,
sliding windows, MoE routing, recurrent layers) plus the outputs of chosen
decoder layers; rollback after a verify for every cache kind (rollback.py);
for a verify, attention in a form whose cost does not grow with the context
where that is faster (`verify_forward`, verify_attention.py).

The loaded instance is never changed. Each Target observes through its own
view: shallow copies of the modules from the model down to the list holding
the decoder layers (same weight arrays, no copy), whose list holds permanent
taps around the layers (a layer with a recurrent mixer or an attention module:
a copy whose mixer records its calls and whose attention module can run the
verify's form). So any number of sessions on one model, in any threads, share
nothing but read-only weights."""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from . import rollback as rb
from . import rope_tables
from . import verify_attention as va
from .rebind import forward_with, uses


class TargetError(ValueError):
    """A model this adapter cannot drive exactly (the reason is in the message)."""


# Forwards of up to this many tokens (verify blocks) keep what a rollback
# selects from; a long prefill chunk does not hold them.
MAX_REPLAY = 64


@dataclass
class _Probe:
    """What one lazy forward (never evaluated) told about a model."""

    problem: Optional[str] = None
    head: object = None  # index into _heads(model), or "tied"
    mixers: List[Tuple[int, str]] = field(default_factory=list)  # (layer, child) owning a recurrent state


class _Probes:
    """Probe results per loaded model, held by weak reference and found by
    identity (an mlx Module is a dict, so it cannot key a WeakKeyDictionary);
    an entry goes with its model."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: List[Tuple[weakref.ref, _Probe]] = []

    def get(self, model) -> Optional[_Probe]:
        with self._lock:
            self._items = [(r, p) for r, p in self._items if r() is not None]
            return next((p for r, p in self._items if r() is model), None)

    def drop(self, model) -> None:
        with self._lock:
            self._items = [(r, p) for r, p in self._items if r() is not None and r() is not model]

    def put(self, model, probe: _Probe) -> None:
        with self._lock:
            self._items.append((weakref.ref(model), probe))


PROBES = _Probes()


class _Owned:
    """A shallow copy of `model` in which the modules (and lists) on the paths
    asked for are copies too, so their entries can be replaced without touching
    the loaded instance; everything else, weights included, is shared."""

    def __init__(self, model):
        self.root = copy.copy(model)
        self._done: Dict[str, object] = {"": self.root}

    def get(self, path: str):
        """The copy of the module or list at dotted `path` ("" is the root)."""
        if path in self._done:
            return self._done[path]
        up, _, part = path.rpartition(".")
        parent = self.get(up)
        key = int(part) if isinstance(parent, list) else part
        child = parent[key]
        mine = list(child) if isinstance(child, list) else copy.copy(child)
        parent[key] = mine
        self._done[path] = mine
        return mine


class _State:
    """The per-forward settings the taps of one Target's view read."""

    def __init__(self):
        self.want: set = set()  # the layers whose outputs this forward keeps
        self.feats: Optional[dict] = None  # layer index -> output
        self.stop: Optional[int] = None  # raise _Stop after this layer (training features)
        self.verify = False  # attention modules run verify_attention's form where it pays


class _Tap:
    """Stands in for decoder layer i in a view's layer list and keeps its output
    (the first element when a layer returns a tuple) when asked."""

    def __init__(self, layer, i: int, state: _State):
        self._layer, self._i, self._state = layer, i, state

    def __call__(self, *args, **kwargs):
        y = self._layer(*args, **kwargs)
        st = self._state
        if self._i in st.want:
            st.feats[self._i] = y[0] if isinstance(y, tuple) else y
            if self._i == st.stop:
                raise _Stop
        return y

    def __getattr__(self, name):
        return getattr(self._layer, name)


class _Stop(Exception):
    pass


class _Attention:
    """Stands in for a decoder layer's attention module in a view: the module
    itself, or during a verify forward (state.verify) the same forward on a
    copy of it that calls verify_attention.attention where its code calls
    mlx-lm's scaled_dot_product_attention."""

    NAME = "scaled_dot_product_attention"

    def __init__(self, module, state: _State):
        self._module, self._state = module, state
        mine = copy.copy(module)
        for name, child in module.children().items():  # its rope shares one table per forward (rope_tables.py)
            rope = rope_tables.shared(child)
            if rope is not None:
                mine[name] = rope
        self._verify = forward_with(mine, {self.NAME: va.attention})

    def __call__(self, *args, **kwargs):
        return (self._verify if self._state.verify else self._module)(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _Counting:
    """Counts the calls of a head candidate during the probe."""

    def __init__(self, fn):
        self._fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


class _Spy:
    """Stands in for a child of a decoder layer during the probe and reports the
    caches it is called with."""

    def __init__(self, module, where: Tuple[int, str], on_call):
        self._module, self._where, self._on_call = module, where, on_call

    def __call__(self, *args, **kwargs):
        self._on_call(self._where, rb.caches_in(args, kwargs))
        return self._module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _layers(model) -> list:
    layers = getattr(model, "layers", None)  # every mlx-lm model exposes its decoder list
    if isinstance(layers, (list, tuple)) and layers and all(isinstance(l, nn.Module) for l in layers):
        return layers
    raise TargetError(f"model type '{_name(model)}' exposes no decoder layer list (model.layers)")


def _layer_list(model, layers) -> Tuple[str, str, List[int]]:
    """Where the list the forward iterates lives (`model.layers` may be a slice
    copy, e.g. pipeline_layers): (dotted path of its module, key, each layer's
    position in it)."""
    first = layers[0]
    for name, m in model.named_modules():
        for k, v in m.items():
            if isinstance(v, list) and any(x is first for x in v):
                ids = {id(x): j for j, x in enumerate(v)}
                if all(id(l) in ids for l in layers):
                    return name, k, [ids[id(l)] for l in layers]
    raise TargetError(f"model type '{_name(model)}': its decoder layers are not held in a list")


def _name(model) -> str:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None) \
        or type(model).__module__.rsplit(".", 1)[-1]


_EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "tok_embeddings", "word_embeddings", "embedding")


def _embedding(model) -> Tuple[str, nn.Module]:
    """(path, module) of the token embedding table: a named input embedding
    first, else the largest table."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    if not found:
        raise TargetError(f"model type '{_name(model)}' has no token embedding")
    named = [(n, m) for n, m in found if n.rsplit(".", 1)[-1] in _EMBED_NAMES]
    return named[0] if named else max(found, key=lambda nm: nm[1].weight.shape[0])


def _heads(model) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every sub-module named lm_head."""
    return [(n, m) for n, m in model.named_modules() if n == "lm_head" or n.endswith(".lm_head")]


def _probe(model, layers, where) -> _Probe:
    """One lazy forward over 2 tokens with a fresh cache, never evaluated (only
    the graph is built), through a copy of the model whose head candidates count
    their calls and whose layers' children report the caches they receive:
    which head the model applies, which decoder sub-module receives each
    recurrent state, and any cache kind rollback cannot handle."""
    p = PROBES.get(model)
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
    states = {id(a) for a in rb.recurrent(cache)}
    seen = {}  # id(state) -> (layer index, child name)

    def on_call(at, caches):
        for c in caches:
            if id(c) in states:
                seen[id(c)] = at

    view = _Owned(model)
    path, key, pos = where
    lst = view.get(path)[key] = list(view.get(path)[key])
    if states:
        for i, layer in enumerate(layers):
            mine = copy.copy(layer)
            for n, m in layer.children().items():
                if isinstance(m, nn.Module):
                    mine[n] = _Spy(m, (i, n), on_call)
            lst[pos[i]] = mine
    heads = []
    for n, m in _heads(model):
        up, _, attr = n.rpartition(".")
        heads.append(_Counting(m))
        view.get(up)[attr] = heads[-1]
    epath, emb = _embedding(model)
    tied = _Counting(emb.as_linear)
    view.get(epath).__dict__["as_linear"] = tied  # the copy's, not the loaded table's
    try:
        view.root(mx.zeros((1, 2), dtype=mx.int32), cache=cache)
    except Exception as e:  # noqa: BLE001 - the model's own forward refused the probe
        msg = str(e).splitlines()[0] if str(e) else ""
        p.problem = f"its forward failed on a probe ({type(e).__name__}: {msg})"
        return p
    fired = [k for k, c in enumerate(heads) if c.n]
    if fired:
        p.head = fired[0]
    elif tied.n:
        p.head = "tied"
    else:
        p.problem = "its output head is neither an lm_head nor the tied embedding"
        return p
    if any(k not in seen for k in states):
        p.problem = "a recurrent state is used outside a decoder layer's sub-modules"
        return p
    p.mixers = sorted(set(seen.values()))
    PROBES.put(model, p)
    return p


def forget(model) -> None:
    """Drop what was learnt about `model` (its probe): for a model whose layers
    were changed in place since, e.g. split over ranks (distributed.split_model)."""
    PROBES.drop(model)


class Target:
    """`__call__(tokens[B, L], cache, capture) -> (logits, feats)`: logits are
    exactly `model(tokens, cache=cache)`; feats concatenate the outputs of the
    decoder layers in `capture` (indices into `model.layers`, any layer kind).
    One Target per session: its forwards run one at a time (its own lock);
    Targets on the same model are independent. The view is built once: the
    modules it copies (those on the path to the layer list, the layers, their
    mixers and attention modules) keep the arrays they held then, so after changing the loaded
    model's weights (update, load_weights, quantize) build a new Target (each
    Decoder session builds its own)."""

    # its steps' wall-clock times may steer decisions (the guard's prices as paid); not on a split
    # target, whose ranks must decide alike from the same numbers (distributed.ShardedTarget)
    clocked = True

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = _layers(model)
        self.num_layers = len(self.layers)
        where = _layer_list(model, self.layers)
        _, self.embed_tokens = _embedding(model)
        probe = _probe(model, self.layers, where)
        if probe.problem:
            raise TargetError(f"model type '{_name(model)}' is not supported: {probe.problem}")
        self._lm_head = None
        if probe.head != "tied":
            self._lm_head = _heads(model)[probe.head][1]
        self._mixers = probe.mixers
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.hidden_size = self.embed_tokens(mx.array([[0]])).shape[-1]  # shape only, not computed
        args = getattr(model, "args", None)
        self.sliding_window = getattr(args, "sliding_window", None)
        self._rec: Optional[rb.Record] = None  # the last forward's rollback record
        self._verifying = False  # set by verify_forward around its __call__
        self._lock = threading.RLock()
        self._state = _State()
        self._view, self._recorders = self._build_view(where)

    def _build_view(self, where):
        """This session's copy of the model: its layer list holds a tap per layer;
        a layer with a recurrent mixer is a copy whose mixer records its calls."""
        view = _Owned(self.model)
        path, key, pos = where
        holder = view.get(path)
        lst = holder[key] = list(holder[key])
        recorders = []
        mixers: Dict[int, List[str]] = {}
        for i, n in self._mixers:
            mixers.setdefault(i, []).append(n)
        for i, layer in enumerate(self.layers):
            attn = [n for n, m in layer.children().items()
                    if isinstance(m, nn.Module) and n not in mixers.get(i, ()) and uses(m, [_Attention.NAME])]
            entry = copy.copy(layer) if i in mixers or attn else layer
            for n in mixers.get(i, ()):
                entry[n] = rb.Mixer(layer[n])
                recorders.append(entry[n])
            for n in attn:
                entry[n] = _Attention(layer[n], self._state)
            lst[pos[i]] = _Tap(entry, i, self._state)
        return view.root, recorders

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
        with self._lock:
            if self._rec is not None and self._rec.cache is cache:
                rb.replay(self._rec, n)
                self._rec = None

    def select_rows(self, cache: list, keeps: List[int]) -> None:
        """After a batched forward of L tokens over `cache`: batch row b keeps the
        recurrent states after its first keeps[b] tokens (row caches are the
        caller's: batch_cache.py). RollbackError where they cannot be selected."""
        with self._lock:
            rec = self._rec
            if rec is None or rec.cache is not cache:
                if any(isinstance(x, rb.ArraysCache) for c in cache for x in rb.leaves(c)):
                    raise rb.RollbackError("no recorded forward over this cache to select rows from")
                return
            rb.select_rows(rec, keeps)
            self._rec = None

    def rows_selectable(self, cache: list) -> bool:
        """Whether the last forward over `cache` kept per-row recurrent states."""
        rec = self._rec
        if rec is None or rec.cache is not cache:
            return not rb.recurrent(cache)
        return rb.selectable(rec)

    # -- the forward -----------------------------------------------------------------
    def _run(self, tokens, cache, want: Sequence[int], stop: Optional[int] = None, sink: Optional[list] = None,
             verify: bool = False):
        """The model's own forward through this session's view, keeping the
        outputs of the layers in `want` and recording the recurrent mixers'
        calls into `sink`; `verify`: attention in verify_attention's form."""
        st = self._state
        st.feats, st.want, st.stop, st.verify = {}, set(want), stop, verify
        for m in self._recorders:
            m.sink = sink
        logits = None
        try:
            if verify:
                with rope_tables.Tables():
                    logits = self._view(tokens, cache=cache)
            else:
                logits = self._view(tokens, cache=cache)
        except _Stop:
            pass
        finally:
            feats, st.feats, st.want, st.stop, st.verify = st.feats, None, set(), None, False
            for m in self._recorders:
                m.sink = None
        return logits, feats

    def checked_capture(self, capture: Sequence[int]) -> List[int]:
        """`capture` as a list, refused when it names a layer the target does not have."""
        capture = list(capture)
        bad = [i for i in capture if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(f"capture layers {bad} outside the target's {self.num_layers} layers")
        return capture

    def __call__(self, tokens: mx.array, cache: list, capture: Sequence[int] = ()):
        """tokens [B, L] -> (logits [B, L, V], features [B, L, len(capture)*H] or None)."""
        capture = self.checked_capture(capture)
        L = tokens.shape[1]
        with self._lock:
            rec = rb.snapshot(cache, L) if cache is not None and self._mixers else None
            if rec is not None and not rec.saved:
                rec = None
            sink = rec.calls if rec is not None and 1 < L <= MAX_REPLAY else None
            logits, feats = self._run(tokens, cache, capture, sink=sink, verify=self._verifying)
            self._rec = rec
        if not capture:
            return logits, None
        return logits, mx.concatenate([feats[i] for i in capture], axis=-1)

    def verify_forward(self, tokens: mx.array, cache: list, capture: Sequence[int] = ()):
        """`self(tokens, cache, capture)` for a verify (a few new rows over a
        cached context): the same forward (a subclass's __call__ included), with
        attention in verify_attention's split form where that is faster (a long
        context on the CPU): equal to __call__ within float rounding (the same
        sums in another order), and exactly __call__ elsewhere."""
        with self._lock:  # (reentrant: __call__ takes it again)
            self._verifying = True
            try:
                return self(tokens, cache, capture)
            finally:
                self._verifying = False

    def features(self, tokens: mx.array, layer_ids: Sequence[int]) -> mx.array:
        """tokens [S, L] -> tapped layer outputs [S, L, taps*H] through the model's
        own forward, no cache; layers after the last tap are not run (training)."""
        with self._lock:
            _, feats = self._run(tokens, None, layer_ids, stop=max(layer_ids))
        return mx.concatenate([feats[i] for i in layer_ids], axis=-1)
