"""Model discovery: every model on this machine (embedded, user model folders,
the Hugging Face cache), read from configs and safetensors headers only, never
weights; and which drafters fit which target, by config.

    discover(store) -> [ModelEntry]       every model found, drafters included
    list_targets(store) -> [ModelEntry]   what a user can chat with
    weights_problem(path) -> str | None   a truncated or corrupt weights file, by name
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from ..drafting.drafter import validate
from ..drafting.drafter_config import DrafterConfig, DrafterError
from ..settings.schema import ModelSettings, SettingsError
from ..settings.store import SettingsStore
from . import dtype_choice

KINDS = {"target": "target", "dflash1": "DFlash 1 drafter", "dflash2": "DFlash 2 drafter",
         "draft": "classic draft model"}
DRAFTER_KINDS = ("dflash2", "dflash1")  # preference order when none is chosen
TINY_BYTES = 1_500_000_000  # a "draft"-named model under this is a classic draft model
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class ModelEntry:
    id: str
    path: Path
    kind: str  # target | dflash1 | dflash2 | draft
    source: str  # embedded | hf-cache | folder
    size_bytes: int  # on disk
    est_memory_bytes: int  # weights as loaded here + KV cache for max_context tokens
    compatible_drafters: list = field(default_factory=list)  # ids, best first
    block_size: Optional[int] = None  # drafters: trained block size
    config: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def kind_label(self) -> str:
        return KINDS[self.kind]

    @property
    def is_drafter(self) -> bool:
        return self.kind != "target"

    def to_dict(self) -> dict:
        return dict(id=self.id, path=str(self.path), kind=self.kind, source=self.source,
                    size_bytes=self.size_bytes, est_memory_bytes=self.est_memory_bytes,
                    compatible_drafters=list(self.compatible_drafters), block_size=self.block_size)


def notice(msg: str) -> None:
    print(f"mlx-dflash: {msg}", file=sys.stderr)


# -- reading model folders (configs and safetensors headers only, never weights) ---------


def read_config(path: Path) -> Optional[dict]:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _text_cfg(cfg: dict) -> dict:
    """Language-model fields (multimodal configs nest them under text_config)."""
    t = cfg.get("text_config")
    return {**cfg, **t} if isinstance(t, dict) else cfg


def _tensors(path: Path):
    """(dtype, n_bytes) of every tensor in the folder's safetensors files, from the headers."""
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                if n > 100_000_000:
                    continue
                hdr = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for k, t in hdr.items():
            if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t:
                yield t.get("dtype", "F32"), t["data_offsets"][1] - t["data_offsets"][0]


def weights_problem(path: Path) -> Optional[str]:
    """Why the folder's weights cannot load (a missing, truncated or corrupt
    .safetensors file, named), from the headers and file sizes; None if they look whole."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return f"{path} holds no .safetensors weights"
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index} is corrupt; restore it or download the model again"
        missing = sorted(s for s in shards if not (path / str(s)).exists())
        if missing:
            return f"{path / missing[0]} is missing (listed in {index.name}); download the model again"
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    return f"{f} is truncated ({size} bytes); download the model again"
                n = struct.unpack("<Q", head)[0]
                if n > size - 8:
                    return f"{f} is truncated or corrupt (header of {n} bytes in a {size}-byte file)"
                hdr = json.loads(fh.read(n))
        except OSError as e:
            return f"{f} cannot be read ({e.strerror})"
        except (ValueError, RecursionError):
            return f"{f} is corrupt (unreadable header); download the model again"
        if not isinstance(hdr, dict):
            return f"{f} is corrupt (unreadable header); download the model again"
        try:
            end = max((int(t["data_offsets"][1]) for k, t in hdr.items() if k != "__metadata__"), default=0)
        except (TypeError, KeyError, IndexError, ValueError):
            return f"{f} is corrupt (bad tensor offsets in its header)"
        if 8 + n + end > size:
            return f"{f} is truncated ({size} of {8 + n + end} bytes); download the model again"
    return None


def _weight_bytes(path: Path, dtype=None) -> tuple:
    """(bytes as loaded here, bytes per activation). Float weights take the compute
    dtype when one is asked for (`dtype`, else $MLX_DFLASH_DTYPE: see
    dtype_choice.compute_dtype), else stay as stored."""
    try:
        want = dtype_choice.compute_dtype(dtype)[0]
    except ValueError:  # an unknown $MLX_DFLASH_DTYPE: the loader says so when loading
        want = None
    size = want.size if want is not None else None
    total, act = 0, 0
    for dt, nb in _tensors(path):
        if size and dt in ("F32", "F16", "BF16"):
            nb = nb // _DTYPE_BYTES[dt] * size
        total += nb
        if dt in ("F32", "F16", "BF16") and not act:
            act = size or _DTYPE_BYTES[dt]
    return total, act or 4


def dir_size(path: Path) -> int:
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                n += os.stat(os.path.join(root, f)).st_size  # follows HF-cache symlinks to blobs
            except OSError:
                pass
    return n


def _kind(cfg: dict, name: str, weight_bytes: int) -> Optional[str]:
    archs = cfg.get("architectures") or []
    if "DFlash2DraftModel" in archs:
        return "dflash2"
    if "DFlashDraftModel" in archs:
        return "dflash1"
    role = (cfg.get("mlx_dflash") or {}).get("role") if isinstance(cfg.get("mlx_dflash"), dict) else None
    if role == "draft" or name == "draft-ar" or ("draft" in name.lower() and weight_bytes < TINY_BYTES):
        return "draft"
    if "model_type" in cfg or "text_config" in cfg:
        return "target"
    return None  # not a language model mlx-lm could load


def make_entry(model_id: str, path: Path, source: str, store: SettingsStore, size=None) -> Optional[ModelEntry]:
    try:
        return _make_entry(model_id, path, source, store, size)
    except (TypeError, ValueError, AttributeError) as e:  # e.g. "num_hidden_layers": null
        # one bad folder must not take the whole listing down
        notice(f"skipping {path}: its config.json has a value of the wrong type ({type(e).__name__}: {e})")
        return None


def _make_entry(model_id: str, path: Path, source: str, store: SettingsStore, size=None) -> Optional[ModelEntry]:
    cfg = read_config(path)
    if cfg is None or not any(Path(path).glob("*.safetensors")):
        return None
    try:
        ms = store.model(model_id)
    except SettingsError:
        ms = ModelSettings()
    wbytes, act = _weight_bytes(path, None if ms.dtype == "auto" else ms.dtype)
    kind = _kind(cfg, model_id.rsplit("/", 1)[-1], wbytes)
    if kind is None:
        return None
    t = _text_cfg(cfg)
    block = None
    if kind in ("dflash1", "dflash2"):
        dc = cfg.get("dflash_config") or {}
        block = int(dc.get("block_size", cfg.get("block_size", 16)))
    ctx = ms.max_context if kind == "target" else 0
    # int(): a string such as "2" would otherwise multiply into a giant str, not a number
    heads = int(t.get("num_attention_heads") or 1)
    kv = int(t.get("num_key_value_heads") or heads)
    head_dim = int(t.get("head_dim") or (int(t.get("hidden_size", 0)) // heads))
    kv_bytes = 2 * int(t.get("num_hidden_layers", 0)) * kv * head_dim * ctx * act
    return ModelEntry(model_id, Path(path), kind, source, dir_size(path) if size is None else size,
                      wbytes + kv_bytes, block_size=block, config=cfg)


# -- sources ---------------------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The hub cache, read from the environment at call time (HF_HUB_CACHE, HF_HOME)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def models_dir() -> Path:
    """The embedded models: the top-level folder `models/` of the checkout this
    package runs from, else (installed from a wheel) the data-only package
    `mlx_dflash_models` that folder installs as (pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "models" / "target").is_dir():
        return root / "models"
    spec = find_spec("mlx_dflash_models")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded models are not installed; reinstall mlx-dflash")
    return Path(list(spec.submodule_search_locations)[0])


def default_pair() -> tuple:
    """(target, drafter) folders of the embedded default pair."""
    d = models_dir()
    return d / "target", d / "dflash2"


def _embedded(store):
    root = models_dir()
    for p in sorted(root.iterdir()) if root.is_dir() else ():
        if p.is_dir():
            e = make_entry(f"embedded/{p.name}", p, "embedded", store)
            if e:
                yield e


def _folders(store, dirs):
    for d in dirs:
        root = Path(d).expanduser()
        if not root.is_dir():
            continue
        if (root / "config.json").exists():  # the folder is itself a model
            e = make_entry(root.name, root, "folder", store)
            if e:
                yield e
            continue
        for p in sorted(root.iterdir()):
            if not p.is_dir():
                continue
            if (p / "config.json").exists():  # flat: dir/name
                e = make_entry(p.name, p, "folder", store)
                if e:
                    yield e
                continue
            for q in sorted(p.iterdir()):  # dir/org/name
                if q.is_dir() and (q / "config.json").exists():
                    e = make_entry(f"{p.name}/{q.name}", q, "folder", store)
                    if e:
                        yield e


def _hf_repos():
    from huggingface_hub import scan_cache_dir

    cache = hf_cache_dir()
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, unreadable cache: no models from there
        notice(f"cannot scan the Hugging Face cache {cache} ({type(e).__name__})")
        return []
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def _hf(store):
    for repo in _hf_repos():
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        if revs:
            e = make_entry(repo.repo_id, revs[0].snapshot_path, "hf-cache", store, size=revs[0].size_on_disk)
            if e:
                yield e


# -- pairing ---------------------------------------------------------------------------


def pair_problem(target_cfg: dict, drafter_cfg: dict) -> Optional[str]:
    """Why this drafter cannot serve this target, from the configs alone (None: it fits).
    The rules are drafter.validate's, applied to config-shaped stand-ins."""
    try:
        dc = DrafterConfig.from_dict(drafter_cfg)
    except DrafterError as e:
        return str(e)
    t = _text_cfg(target_cfg)
    try:
        tgt = SimpleNamespace(hidden_size=int(t["hidden_size"]), vocab_size=int(t["vocab_size"]),
                              num_layers=int(t["num_hidden_layers"]))
    except (KeyError, TypeError, ValueError):
        return "the target config lacks hidden_size, vocab_size or num_hidden_layers"
    try:
        validate(SimpleNamespace(config=dc), tgt)
    except DrafterError as e:
        return str(e)
    return None


def discover(store: Optional[SettingsStore] = None) -> list:
    """Every model found: embedded, user model folders, then the Hugging Face cache
    (an id found twice keeps its first place). Targets get their compatible drafters."""
    store = store or SettingsStore()
    dirs = store.globals().model_dirs
    out, seen = [], set()
    for e in [*_embedded(store), *_folders(store, dirs), *_hf(store)]:
        if e.id not in seen:
            seen.add(e.id)
            out.append(e)
    for t in out:
        if t.kind == "target":
            t.compatible_drafters = compatible_drafters(t, out)
    return out


def compatible_drafters(target: ModelEntry, entries: list) -> list:
    """Ids of the drafters that fit `target`: DFlash 2 first, else in discovery order."""
    drafters = sorted((d for d in entries if d.kind in DRAFTER_KINDS), key=lambda d: DRAFTER_KINDS.index(d.kind))
    return [d.id for d in drafters if pair_problem(target.config, d.config) is None]


def list_targets(store: Optional[SettingsStore] = None) -> list:
    """Models a user can chat with or serve (drafters and draft models hidden)."""
    return [e for e in discover(store) if e.kind == "target"]
