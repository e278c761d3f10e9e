"""What a cached prefix is only valid for: the model's weights and dtype, the
drafter's, the tokenizer and its chat template, and the versions of the code
that computed it. The disk tier keeps each identity's entries in a folder of
their own (disk.py), so nothing is ever reused across any of these."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from importlib import metadata
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import __version__

# bumped whenever what the disk tier writes, or what a PromptCache holds, changes meaning
FORMAT = 1
_SAMPLE = 8  # elements read from each end of every parameter (a fine-tune changes them all)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def _config(obj) -> dict:
    args = getattr(obj, "args", None) or getattr(obj, "config", None)
    if args is None:
        return {}
    if hasattr(args, "to_dict"):
        return args.to_dict()
    if is_dataclass(args):
        return asdict(args)
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def weights(module) -> str:
    """A digest of a module's parameters: names, shapes, dtypes (quantization
    included) and a few values from each end of every one, so two checkpoints of
    one architecture, or one checkpoint in two dtypes, differ."""
    params = tree_flatten(module.parameters())
    ends = []
    for _, a in params:
        flat = a.reshape(-1)
        n = min(_SAMPLE, flat.size)
        ends.append(mx.concatenate([flat[:n], flat[-n:]]).view(mx.uint8))  # the bits, any dtype
    mx.eval(ends)
    h = hashlib.sha256()
    for (name, a), e in zip(params, ends):
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
        h.update(memoryview(e))
    return h.hexdigest()[:24]


def _tokenizer(tok) -> Optional[dict]:
    if tok is None:
        return None
    inner = getattr(tok, "_tokenizer", tok)
    try:
        vocab = inner.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        vocab = {}
    h = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:24]
    return {"class": type(inner).__name__, "vocab": h, "size": len(vocab),
            "chat_template": hashlib.sha256(str(getattr(inner, "chat_template", None)).encode()).hexdigest()[:24],
            "eos": sorted(getattr(tok, "eos_token_ids", None) or []), "bos": getattr(inner, "bos_token", None)}


def identity(model, tokenizer=None, drafter=None, name: Optional[str] = None) -> dict:
    """Everything a cached prefix of `model` (with `drafter`'s context) depends
    on; `name` (the model's id) is only a label for `mlx-dflash cache list`."""
    return json.loads(json.dumps({
        "format": FORMAT, "name": name, "mlx_dflash": __version__, "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "model": {"type": type(model).__module__, "config": _config(model), "weights": weights(model)},
        "drafter": None if drafter is None else {"config": _config(drafter), "weights": weights(drafter)},
        "tokenizer": _tokenizer(tokenizer),
    }, default=str, sort_keys=True))


def digest(ident: dict) -> str:
    """The folder name of an identity (its label excluded)."""
    body = {k: v for k, v in ident.items() if k != "name"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:20]
