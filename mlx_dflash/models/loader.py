"""`load`: a target (mlx-lm) and, optionally, its DFlash drafter."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..drafting.drafter import Drafter, load_drafter, validate
from ..drafting.drafter_config import DrafterError
from ..platform.hub import HubError, resolve_path
from ..target.adapter import Target
from . import discovery, dtype_choice
from .dtype_choice import cast, param_dtype
from .registry import find_drafter, missing_message


def load(model: Optional[str] = None, drafter: Optional[str] = None, *, dtype=None, auto_drafter: bool = True):
    """Returns (model, tokenizer, drafter or None).

    With no model, the embedded default pair. With a model and no drafter, its
    drafter is looked up (registry.find_drafter) unless `auto_drafter` is False;
    an explicit drafter always wins. The target keeps the dtype mlx-lm loads
    (bf16 stays bf16: output is token for token mlx-lm's) unless `dtype` or
    $MLX_DFLASH_DTYPE asks for another, or for auto (the fastest here; see
    dtype_choice). A model the engine cannot drive exactly is refused
    (TargetError, one line) before its weights are read."""
    return load_with_choice(model, drafter, dtype=dtype, auto_drafter=auto_drafter)[:3]


def load_with_choice(model: Optional[str] = None, drafter: Optional[str] = None, *, dtype=None,
                     auto_drafter: bool = True) -> tuple:
    """`load`, plus the compute dtype chosen and why (dtype_choice.DtypeChoice)."""
    import mlx_lm

    if model is None:
        t, d = discovery.default_pair()
        if not (t / "config.json").exists():
            raise HubError(f"the embedded default model is missing from {t}; reinstall mlx-dflash or pass --model")
        model = str(t)
        if drafter is None and (d / "config.json").exists():
            drafter = str(d)
    path = resolve_path(model, "model")
    if not (path / "config.json").exists():
        raise HubError(f"{path} has no config.json; not an mlx-lm model folder")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HubError(f"{path / 'config.json'} is not valid JSON (line {e.lineno})") from None
    if "dflash_config" in cfg:
        raise HubError(f"{path} is a DFlash drafter, not a target model; pass it as the drafter")
    setting, src = dtype_choice.requested(None if dtype is None else dtype_choice.name_of(dtype))
    try:
        m, tok = mlx_lm.load(str(path), lazy=True)  # weights are read at the eval below
    except ValueError as e:  # unsupported model type and similar, from mlx-lm
        raise HubError(f"mlx-lm cannot load {path}: {str(e).splitlines()[0]}") from None
    Target(m)  # refuses an unsupported model (TargetError) before its weights load
    choice = dtype_choice.choose(m, setting, src, path)  # auto: may read the weights to time a step
    if choice.cast is not None:
        cast(m, choice.cast)
    mx.eval(m.parameters())
    d = None
    if drafter is None and auto_drafter and str(path) != str(discovery.default_pair()[0]):
        d = _auto_drafter(model, path, cfg, m)
    elif drafter is not None:
        d = load_drafter(drafter)
        validate(d, Target(m))
    if d is not None and choice.cast is not None:  # else the drafter runs in its checkpoint's dtype
        cast(d, choice.cast)  # the compute dtype chosen applies to both models
    materialize(m, d)
    return m, tok, d, choice


def materialize(model, drafter=None) -> None:
    """Evaluate every array a model and its drafter hold, private ones too (a
    RoPE's frequencies, a selector's codebooks): MLX streams are per thread, so a
    model loaded on one thread and decoded on another must hold no lazy array."""
    mx.eval([v for m in (model, drafter) if m is not None for mod in m.modules() for v in mod.values()
             if isinstance(v, mx.array)])


def model_dtype(m) -> str:
    """The dtype a loaded model computes in (its first floating parameter), e.g. 'bfloat16'."""
    return dtype_choice.dtype_name(param_dtype(m))


def _auto_drafter(model_ref: str, path: Path, cfg: dict, m) -> Optional[Drafter]:
    """The target's own drafter, found locally or through the registry; a notice
    (one line, stderr) and plain decoding when it is missing or does not fit."""
    found = find_drafter(model_ref, path, cfg)
    if found is None:
        return None
    where = found.path
    if where is None:
        try:
            where = resolve_path(found.repo, "drafter")  # the Hugging Face cache, or a download when online
        except HubError:
            print(missing_message(model_ref, found.repo), file=sys.stderr)
            return None
    try:
        d = load_drafter(str(where))
        validate(d, Target(m))
    except DrafterError as e:
        print(f"found drafter {found.repo or where} for {model_ref} but cannot use it: {e}; using plain decoding",
              file=sys.stderr)
        return None
    return d
