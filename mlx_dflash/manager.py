"""The model manager: find models (embedded, Hugging Face cache, user folders),
pair targets with drafters by config, load a model with its settings (drafter
choice, drafter quantization), download and remove models.

One API for the CLI, the chat UI and the server:

    discover(store) -> [ModelEntry]       every model found, drafters included
    list_targets(store) -> [ModelEntry]   what a user can chat with
    resolve(model_id, store) -> ModelEntry
    load_model(model_id, store) -> LoadedModel
    pull(repo_id) -> Path;  remove(model_id, store) -> bytes freed
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .drafter import DrafterConfig, DrafterError, validate
from .hub import HubError
from .settings import ModelSettings, SettingsError, SettingsStore

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


@dataclass
class LoadedModel:
    id: str
    model: object
    tokenizer: object
    drafter: object  # Drafter or None (plain decoding)
    settings: ModelSettings  # block_size already fitted to the drafter
    entry: ModelEntry
    drafter_id: Optional[str] = None
    notices: list = field(default_factory=list)  # one-line notes for the user (fallbacks, forced dtypes)

    def generation_kwargs(self) -> dict:
        return self.settings.generation_kwargs()


def _notice(msg: str) -> None:
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


def _cpu() -> bool:
    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def _weight_bytes(path: Path) -> tuple:
    """(bytes as loaded here, bytes per activation). On the CPU backend the loader
    widens half-precision weights to float32 (see loader.load)."""
    cpu = _cpu()
    total, act = 0, 0
    for dt, nb in _tensors(path):
        if cpu and dt in ("F16", "BF16"):
            nb *= 2
        total += nb
        if dt in ("F32", "F16", "BF16") and not act:
            act = 4 if cpu else _DTYPE_BYTES[dt]
    return total, act or 4


def _dir_size(path: Path) -> int:
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


def _entry(model_id: str, path: Path, source: str, store: SettingsStore, size=None) -> Optional[ModelEntry]:
    cfg = read_config(path)
    if cfg is None or not any(Path(path).glob("*.safetensors")):
        return None
    wbytes, act = _weight_bytes(path)
    kind = _kind(cfg, model_id.rsplit("/", 1)[-1], wbytes)
    if kind is None:
        return None
    t = _text_cfg(cfg)
    block = None
    if kind in ("dflash1", "dflash2"):
        dc = cfg.get("dflash_config") or {}
        block = int(dc.get("block_size", cfg.get("block_size", 16)))
    try:
        ctx = store.model(model_id).max_context if kind == "target" else 0
    except SettingsError:
        ctx = ModelSettings().max_context
    heads = t.get("num_attention_heads") or 1
    kv = t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or (t.get("hidden_size", 0) // heads)
    kv_bytes = 2 * int(t.get("num_hidden_layers", 0)) * kv * head_dim * ctx * act
    return ModelEntry(model_id, Path(path), kind, source, _dir_size(path) if size is None else size,
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


def _embedded(store):
    from .loader import models_dir

    try:
        root = models_dir()
    except ImportError:  # installed without the data package
        return
    for p in sorted(root.iterdir()) if root.is_dir() else ():
        if p.is_dir():
            e = _entry(f"embedded/{p.name}", p, "embedded", store)
            if e:
                yield e


def _folders(store, dirs):
    for d in dirs:
        root = Path(d).expanduser()
        if not root.is_dir():
            continue
        if (root / "config.json").exists():  # the folder is itself a model
            e = _entry(root.name, root, "folder", store)
            if e:
                yield e
            continue
        for p in sorted(root.iterdir()):
            if not p.is_dir():
                continue
            if (p / "config.json").exists():  # flat: dir/name
                e = _entry(p.name, p, "folder", store)
                if e:
                    yield e
                continue
            for q in sorted(p.iterdir()):  # dir/org/name
                if q.is_dir() and (q / "config.json").exists():
                    e = _entry(f"{p.name}/{q.name}", q, "folder", store)
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
        _notice(f"cannot scan the Hugging Face cache {cache} ({type(e).__name__})")
        return []
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def _hf(store):
    for repo in _hf_repos():
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        if revs:
            e = _entry(repo.repo_id, revs[0].snapshot_path, "hf-cache", store, size=revs[0].size_on_disk)
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
            t.compatible_drafters = _compatible(t, out)
    return out


def _compatible(target: ModelEntry, entries: list) -> list:
    """Ids of the drafters that fit `target`: DFlash 2 first, else in discovery order."""
    drafters = sorted((d for d in entries if d.kind in DRAFTER_KINDS), key=lambda d: DRAFTER_KINDS.index(d.kind))
    return [d.id for d in drafters if pair_problem(target.config, d.config) is None]


def list_targets(store: Optional[SettingsStore] = None) -> list:
    """Models a user can chat with or serve (drafters and draft models hidden)."""
    return [e for e in discover(store) if e.kind == "target"]


def _lookup(model_id: str, entries: list, store) -> Optional[ModelEntry]:
    for e in entries:
        if e.id == model_id:
            return e
    p = Path(model_id).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        rp = p.resolve()
        for e in entries:
            if Path(e.path).resolve() == rp:
                return e
        e = _entry(str(p), p, "folder", store)
        if e and e.kind == "target":
            e.compatible_drafters = _compatible(e, entries)
        return e
    return None


def resolve(model_id: Optional[str], store: Optional[SettingsStore] = None,
            entries: Optional[list] = None) -> ModelEntry:
    """A model id (as listed), or a model folder path. None -> the default model
    (settings `default_model`, else the embedded target)."""
    store = store or SettingsStore()
    if model_id is None:
        model_id = store.globals().default_model or "embedded/target"
    entries = discover(store) if entries is None else entries
    e = _lookup(model_id, entries, store)
    if e is not None:
        return e
    if model_id == "embedded/target":
        from .loader import default_pair

        raise HubError(f"the embedded default model is missing from {default_pair()[0]}; "
                       "reinstall mlx-dflash or pass a model id (mlx-dflash models list)")
    hint = (f"download it with `mlx-dflash models pull {model_id}`"
            if model_id.count("/") == 1 and not model_id.startswith((".", "/", "~"))
            else "see `mlx-dflash models list`")
    raise SettingsError(f"unknown model '{model_id}'; {hint}")


def _drafter_cfg(ref: str, entries: list) -> tuple:
    """(id, path, config) of a drafter named by id or path; config None if it is
    neither found here nor a local folder (a repo id still to download)."""
    for e in entries:
        if e.id == ref:
            return e.id, e.path, e.config
    p = Path(ref).expanduser()
    if p.is_dir():
        cfg = read_config(p)
        if cfg is None:
            raise SettingsError(f"drafter folder {p} has no readable config.json")
        return ref, p, cfg
    return ref, None, None


def check_settings(model_id: str, s: ModelSettings, store: SettingsStore, explicit_block: bool = True) -> None:
    """Checks that need the model files: the drafter is a DFlash drafter that fits
    the target, and the block size does not exceed the drafter's trained one.
    Unknown models pass (settings may precede a download); load_model re-checks."""
    entries = discover(store)
    target = _lookup(model_id, entries, store)
    if target is not None and target.kind != "target":
        raise SettingsError(f"'{model_id}' is a {target.kind_label}; settings apply to target models")
    if s.drafter:
        did, _, cfg = _drafter_cfg(s.drafter, entries)
        if cfg is None:
            return
        try:
            dc = DrafterConfig.from_dict(cfg)
        except DrafterError as e:
            raise SettingsError(f"drafter '{did}' is incompatible: {e}") from None
        if target is not None:
            why = pair_problem(target.config, cfg)
            if why:
                raise SettingsError(f"drafter '{did}' is incompatible with '{model_id}': {why}")
        block = dc.block_size
    elif target is not None and target.compatible_drafters:
        did = target.compatible_drafters[0]
        block = next(e.block_size for e in entries if e.id == did)
    else:
        return
    if explicit_block and s.block_size > block:
        raise SettingsError(f"block_size {s.block_size} is above the trained block size {block} of drafter "
                            f"'{did}'; use 1..{block}")


# -- loading ---------------------------------------------------------------------------


def param_bytes(module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def safe_activation_dtype(requested: str, target_dtype) -> tuple:
    """The drafter's activation dtype and a notice if the request was overridden.

    Half precision with a 5-bit exponent (float16) overflows on the large hidden
    states of bf16/fp32-trained targets: inf -> NaN drafts -> acceptance silently
    zero. So float16 is only kept for a float16 target on a GPU; otherwise the
    target's own dtype is used."""
    if requested == "auto":
        return target_dtype, None
    want = getattr(mx, requested)
    if want == mx.float16 and (target_dtype != mx.float16 or _cpu()):
        why = "on the CPU backend" if _cpu() else f"with a {_dtype_name(target_dtype)} target"
        return target_dtype, (f"drafter activations in float16 {why} can overflow and zero acceptance; "
                              f"using {_dtype_name(target_dtype)}")
    return want, None


def _dtype_name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def set_activation_dtype(drafter, dtype) -> None:
    """Run the drafter in `dtype`: its float parameters, and its inputs (the target's
    embeddings and features arrive in the target's dtype). No safety check: see
    safe_activation_dtype."""
    from .loader import _cast

    _cast(drafter, dtype)
    base = type(drafter)
    while getattr(base, "_casts_inputs", False):
        base = base.__mro__[1]

    class Cast(base):  # per instance: other drafters keep their own dtype
        _casts_inputs = True

        def __call__(self, block_emb, new_feats, cache, offset=None):
            if new_feats is not None:
                new_feats = new_feats.astype(dtype)
            return super().__call__(block_emb.astype(dtype), new_feats, cache, offset)

    Cast.__name__ = Cast.__qualname__ = base.__name__
    drafter.__class__ = Cast


def quantize_drafter(drafter, bits: int, group_size: int = 64, scale_dtype=None) -> int:
    """Quantize the drafter's Linear layers in place (those whose input dim is a
    multiple of group_size); returns how many were quantized.

    Scales and biases take the weights' dtype, or `scale_dtype`: bfloat16 keeps
    4-bit weights at 4.5 bits each (group 64) even where activations run in
    float32 (the CPU backend), with a rounding error far below the 4-bit step."""
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        raise SettingsError(f"drafter quantization must be 4 or 8 bits, group size 32/64/128 (got {bits}, {group_size})")
    n = [0]

    def pred(path, m):
        if not (isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0):
            return False
        if scale_dtype is not None:
            m.weight = m.weight.astype(scale_dtype)
        n[0] += 1
        return True

    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=pred)
    mx.eval(drafter.parameters())
    return n[0]


def _pick_drafter(entry: ModelEntry, s: ModelSettings, entries: list) -> tuple:
    if s.drafter:
        did, path, _ = _drafter_cfg(s.drafter, entries)
        return did, str(path) if path is not None else s.drafter
    if entry.compatible_drafters:
        did = entry.compatible_drafters[0]
        return did, str(next(e.path for e in entries if e.id == did))
    return None, None


def load_model(model_id: Optional[str] = None, store: Optional[SettingsStore] = None) -> LoadedModel:
    """Load a target and, when DFlash is on, its drafter (the chosen one, else the
    best compatible one found), quantized and typed as the settings say."""
    from .loader import _param_dtype, load

    store = store or SettingsStore()
    entries = discover(store)
    entry = resolve(model_id, store, entries)
    if entry.kind != "target":
        raise SettingsError(f"'{entry.id}' is a {entry.kind_label}, not a chat model; "
                            "pick a target from `mlx-dflash models list`")
    s = store.model(entry.id)
    notices = []
    did = dpath = None
    if s.dflash_enabled and s.verify_mode != "off":
        did, dpath = _pick_drafter(entry, s, entries)
        if dpath is None:
            notices.append(f"no compatible DFlash drafter found for '{entry.id}'; using plain decoding")
    model, tok, drafter = load(str(entry.path), dpath)
    if drafter is not None:
        tdt = _param_dtype(model)
        act, why = safe_activation_dtype(s.drafter_activation_dtype, tdt)
        if why:
            notices.append(why)
        if act != tdt:
            set_activation_dtype(drafter, act)
        if s.drafter_quant_bits:
            quantize_drafter(drafter, s.drafter_quant_bits, s.drafter_quant_group_size,
                             scale_dtype=mx.float16 if act == mx.float16 else mx.bfloat16)
        if s.block_size > drafter.block_size:
            notices.append(f"block_size {s.block_size} is above the drafter's trained block size "
                           f"{drafter.block_size}; using {drafter.block_size}")
            s = replace(s, block_size=drafter.block_size)
    for n in notices:
        _notice(n)
    return LoadedModel(entry.id, model, tok, drafter, s, entry, did, notices)


# -- download and removal ----------------------------------------------------------------

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.md"]


def pull(repo_id: str, progress: bool = True) -> Path:
    """Download a model repo into the Hugging Face cache (tqdm progress bars)."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")) or Path(repo_id).exists():
        raise HubError(f"'{repo_id}' is not a Hugging Face repo id (org/name)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubError(f"cannot download '{repo_id}': HF_HUB_OFFLINE is set; unset it to download")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=hf_cache_dir()))
    except Exception as e:
        name = type(e).__name__
        if name in ("RepositoryNotFoundError", "RevisionNotFoundError"):
            msg = f"'{repo_id}' was not found on Hugging Face; check the id"
        elif name == "GatedRepoError":
            msg = f"'{repo_id}' is gated; accept its terms on huggingface.co and log in (hf auth login)"
        else:
            msg = f"cannot download '{repo_id}': no network or Hugging Face unreachable ({name})"
        raise HubError(msg) from None
    finally:
        if not progress:
            enable_progress_bars()


def remove(model_id: str, store: Optional[SettingsStore] = None) -> int:
    """Delete a downloaded model (Hugging Face cache or a user model folder);
    embedded models are part of the install. Returns the bytes freed."""
    store = store or SettingsStore()
    e = resolve(model_id, store)
    if e.source == "embedded":
        raise SettingsError(f"'{e.id}' is an embedded model (part of mlx-dflash); it cannot be removed")
    if e.source == "hf-cache":
        from dataclasses import replace as dc_replace

        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hf_cache_dir())
        for repo in info.repos:
            if repo.repo_type == "model" and repo.repo_id == e.id:
                # delete_revisions matches commit hashes cache-wide; scope it to this repo
                only = dc_replace(info, repos=frozenset([repo]))
                strategy = only.delete_revisions(*[r.commit_hash for r in repo.revisions])
                strategy.execute()
                return strategy.expected_freed_size
        raise SettingsError(f"'{e.id}' is no longer in the Hugging Face cache")
    path = Path(e.path).resolve()
    roots = [Path(d).expanduser().resolve() for d in store.globals().model_dirs]
    if not any(r == path or r in path.parents for r in roots):
        raise SettingsError(f"{path} is not inside a configured model folder; delete it yourself if you mean to")
    size = _dir_size(path)
    shutil.rmtree(path)
    parent = path.parent
    if parent not in roots and any(r in parent.parents for r in roots) and not any(parent.iterdir()):
        parent.rmdir()  # the now-empty org folder
    return size
