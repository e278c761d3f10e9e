"""`load`: a target (mlx-lm) and, optionally, its DFlash drafter."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .drafter import Drafter, load_drafter, validate
from .hub import HubError, resolve_path
from .target import Target


def models_dir() -> Path:
    """The embedded models: `models/` in a checkout, `mlx_dflash_models` when installed."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").exists() and (root / "models").is_dir():  # a checkout
        return root / "models"
    import mlx_dflash_models

    return Path(mlx_dflash_models.__path__[0])


def default_pair() -> tuple:
    """(target, drafter) folders of the embedded default pair."""
    d = models_dir()
    return d / "target", d / "dflash2"


def _cpu() -> bool:
    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def load(model: Optional[str] = None, drafter: Optional[str] = None, *, dtype=None, auto_drafter: bool = True):
    """Returns (model, tokenizer, drafter or None).

    With no model, the embedded default pair. With a model and no drafter, its
    drafter is looked up (registry.find_drafter) unless `auto_drafter` is False;
    an explicit drafter always wins. The target keeps the dtype mlx-lm loads
    (bf16 stays bf16: output is token for token mlx-lm's) unless `dtype` or
    $MLX_DFLASH_DTYPE asks for another (float32 is several times faster on the
    CPU backend; see `compute_dtype`). A model the engine cannot drive exactly is
    refused (TargetError, one line) before its weights are read."""
    import mlx_lm

    if model is None:
        t, d = default_pair()
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
    dtype, _ = compute_dtype(dtype)
    try:
        m, tok = mlx_lm.load(str(path), lazy=True)  # weights are read at the eval below
    except ValueError as e:  # unsupported model type and similar, from mlx-lm
        raise HubError(f"mlx-lm cannot load {path}: {str(e).splitlines()[0]}") from None
    Target(m)  # refuses an unsupported model (TargetError) before its weights load
    if dtype is not None:
        _cast(m, dtype)
    mx.eval(m.parameters())
    d = None
    if drafter is None and auto_drafter and str(path) != str(default_pair()[0]):
        d = _auto_drafter(model, path, cfg, m)
    elif drafter is not None:
        d = load_drafter(drafter)
        validate(d, Target(m))
    if d is not None and dtype is not None:  # else the drafter runs in its checkpoint's dtype
        _cast(d, dtype)  # the compute dtype the user asked for applies to both models
    return m, tok, d


DTYPE_ENV = "MLX_DFLASH_DTYPE"
_DTYPES = {"float32": mx.float32, "fp32": mx.float32, "float16": mx.float16, "fp16": mx.float16,
           "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}


def compute_dtype(dtype=None) -> tuple:
    """(the dtype the target's float weights are cast to, or None for the
    checkpoint's own; where that choice came from: "argument", "$MLX_DFLASH_DTYPE"
    or "checkpoint"). For doctor and stats."""
    src = "argument"
    if dtype is None:
        dtype, src = os.environ.get(DTYPE_ENV, ""), f"${DTYPE_ENV}"
    if isinstance(dtype, str):
        if dtype.strip().lower() in ("", "checkpoint", "auto", "none"):
            return None, "checkpoint"
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"unknown dtype '{dtype}' ({src}); use one of float32, float16, bfloat16, checkpoint")
        dtype = _DTYPES[dtype.lower()]
    return dtype, src


def model_dtype(m) -> str:
    """The dtype a loaded model computes in (its first floating parameter), e.g. 'bfloat16'."""
    return str(_param_dtype(m)).rsplit(".", 1)[-1]


def _param_dtype(m):
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(m.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def _cast(m, dtype) -> None:
    """Cast floating, non-quantized parameters (quantized weights stay as they are)."""
    from mlx.utils import tree_flatten, tree_unflatten

    upd = [(k, v.astype(dtype)) for k, v in tree_flatten(m.parameters())
           if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype]
    if upd:
        m.update(tree_unflatten(upd))
        mx.eval(m.parameters())


def _auto_drafter(model_ref: str, path: Path, cfg: dict, m) -> Optional[Drafter]:
    """The target's own drafter, found locally or through the registry; a notice
    (one line, stderr) and plain decoding when it is missing or does not fit."""
    import sys

    from .drafter import DrafterError
    from .registry import find_drafter, missing_message

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
