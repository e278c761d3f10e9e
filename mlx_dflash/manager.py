"""The model manager: resolve a model's name, load a model with its settings
(drafter choice, drafter quantization), check settings against model files,
download and remove models.

One API for the CLI, the chat UI and the server:

    discover(store) -> [ModelEntry]       every model found, drafters included
    list_targets(store) -> [ModelEntry]   what a user can chat with
    resolve(name, store) -> ModelEntry    one name everywhere: folder, listed id, repo id
    model_path(name, store) -> str        the same for mlx_dflash.load (load(name, drafter))
    settings_store() -> SettingsStore     settings with the checks that need model files
    load_model(model_id, store) -> LoadedModel
    pull(repo_id) -> Path;  remove(model_id, store) -> bytes freed

Discovery (reading folders, pairing by config) is in discovery.py, the drafter's
precision in drafter_precision.py, the settings file and its checks in settings.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .discovery import (DRAFTER_KINDS, KINDS, ModelEntry, _compatible, _dir_size, _entry, _notice,  # noqa: F401
                        discover, hf_cache_dir, list_targets, pair_problem, read_config, weights_problem)
from .drafter import DrafterConfig, DrafterError
from .drafter_precision import param_bytes, quantize_drafter, safe_activation_dtype, set_activation_dtype  # noqa: F401
from .hub import HubError
from .settings import ModelSettings, SettingsError, SettingsStore


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


# -- names ------------------------------------------------------------------------------
# One model name everywhere (every command, the chat, the server, mlx_dflash.load):
# a folder path, an id as `models list` prints it (case aside), a Hugging Face repo
# id, or the folder name of a model kept as ORG/NAME elsewhere.


def _is_repo_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and "\\" not in name


def _spelled(name: str) -> str:
    """The hub cache's own folder name (models--org--name) as a repo id."""
    if name.startswith("models--") and name.count("--") == 2:
        return "/".join(name.split("--")[1:])
    return name


def _folder(p: Path) -> None:
    if not p.is_dir():
        raise HubError(f"model path {p} is a file; pass the folder that holds config.json")
    if not (p / "config.json").exists():
        raise HubError(f"{p} has no config.json; not a model folder")


def find(name: str, entries: list, store) -> Optional[ModelEntry]:
    """The model `name` refers to among `entries` (or a model folder at that path),
    None if none. Never downloads. Two models that both fit a loose spelling: an
    error listing them."""
    p = Path(name).expanduser()
    if p.exists():
        _folder(p)
        rp = p.resolve()
        for e in entries:
            if Path(e.path).resolve() == rp:
                return e
        check_files(p)  # not listed: maybe unreadable; say which file
        e = _entry(str(p), p, "folder", store)
        if e is None:
            raise HubError(f"{p} holds no model mlx-dflash can use (not a language model config)")
        if e.kind == "target":
            e.compatible_drafters = _compatible(e, entries)
        return e
    for e in entries:
        if e.id == name:
            return e
    want = _spelled(name.strip()).lower()
    hits = [e for e in entries if e.id.lower() == want]
    if not hits:  # ORG/NAME for a folder listed as NAME, or NAME for one listed as ORG/NAME
        tail = want.rsplit("/", 1)[-1]
        hits = [e for e in entries if e.id.lower().rsplit("/", 1)[-1] == tail and ("/" not in e.id or "/" not in want)]
    if len(hits) > 1:
        raise SettingsError(f"'{name}' could be {' or '.join(e.id for e in hits)}; use one of these ids")
    return hits[0] if hits else None


def resolve(model_id: Optional[str], store: Optional[SettingsStore] = None,
            entries: Optional[list] = None, download: bool = False) -> ModelEntry:
    """The model a name refers to (see `find`). None -> the default model (settings
    `default_model`, else the embedded target). A Hugging Face repo id not on this
    machine is downloaded when `download` is set, else refused with the command that
    downloads it."""
    store = store or SettingsStore()
    if model_id is None:
        model_id = store.globals().default_model or "embedded/target"
    entries = discover(store) if entries is None else entries
    e = find(model_id, entries, store)
    if e is not None:
        return e
    if model_id == "embedded/target":
        from .loader import default_pair

        raise HubError(f"the embedded default model is missing from {default_pair()[0]}; "
                       "reinstall mlx-dflash or pass a model id (mlx-dflash models list)")
    if _is_repo_id(model_id) and download:
        from .hub import resolve_path

        path = resolve_path(model_id, "model")  # the hub's cache; one-line error when offline
        e = _entry(model_id, path, "hf-cache", store)
        if e is None:
            raise HubError(f"'{model_id}' holds no model mlx-dflash can use (needs config.json and "
                           ".safetensors weights)")
        if e.kind == "target":
            e.compatible_drafters = _compatible(e, entries)
        return e
    raise _unknown("model", model_id, entries)


def _unknown(what: str, name: str, entries: list) -> SettingsError:
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # meant as a path
        return SettingsError(f"{what} folder {name} does not exist; pass a folder that holds config.json, "
                             "or an id from `mlx-dflash models list`")
    hint = (f"download it with `mlx-dflash models pull {name}`" if _is_repo_id(name)
            else "see `mlx-dflash models list`")
    return SettingsError(f"unknown {what} '{name}'{_near(name, entries)}; {hint}")


def _near(name: str, entries: list) -> str:
    from .settings import did_you_mean

    return did_you_mean(name, [e.id for e in entries], cutoff=0.8)


def model_path(name: str, store: Optional[SettingsStore] = None) -> str:
    """A name as `resolve` takes it -> the folder to load (a repo id not on this
    machine is returned as is: the loader fetches it)."""
    if Path(name).expanduser().exists():
        _folder(Path(name).expanduser())  # a file, a folder without config.json: one line
        return name
    store = store or SettingsStore()
    entries = discover(store)
    e = find(name, entries, store)
    if e is not None:
        return str(e.path)
    if _is_repo_id(name):
        return name
    raise _unknown("model", name, entries)


def check_files(path) -> None:
    """A model folder's config.json and weights are readable (headers only), or one
    line naming the bad file."""
    path = Path(path)
    cfg = path / "config.json"
    try:
        obj = json.loads(cfg.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HubError(f"{path} has no config.json; not a model folder") from None
    except json.JSONDecodeError as e:
        raise HubError(f"{cfg} is not valid JSON (line {e.lineno}); restore it or download the model again") from None
    except (OSError, ValueError, RecursionError) as e:
        raise HubError(f"{cfg} cannot be read ({type(e).__name__}); restore it or download the model again") from None
    if not isinstance(obj, dict):
        raise HubError(f"{cfg} is not a JSON object; restore it or download the model again")
    why = weights_problem(path)
    if why:
        raise HubError(why)


def load(model: Optional[str] = None, drafter: Optional[str] = None, *, store: Optional[SettingsStore] = None,
         **kw):
    """`mlx_dflash.load`: loader.load with names. `model` and `drafter` may be
    folders, Hugging Face repo ids or any id `models list` prints; other keyword
    arguments (dtype, ...) are loader.load's. Returns (model, tokenizer, drafter or None)."""
    from . import loader

    if model is not None:
        model = model_path(model, store)
    if drafter is not None:
        drafter = model_path(drafter, store)
    return _load_files(loader.load, model, drafter, **kw)


def _load_files(load_fn, model, drafter, **kw):
    """Check the local folders first, then load; an error mlx-lm raises on a config it
    cannot use becomes one line naming the folder."""
    for p in (model, drafter):
        if p is not None and Path(p).expanduser().is_dir():
            check_files(Path(p).expanduser())
    try:
        return load_fn(model, drafter, **kw)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a config.json that lacks or mistypes a field
        where = next((p for p in (model, drafter) if p is not None), "the model")
        raise HubError(f"cannot load {where}: its config.json does not fit its model type "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except RuntimeError as e:  # mlx's own file errors
        raise HubError(f"cannot load {model}: {str(e).splitlines()[0]}") from None


def _drafter_cfg(ref: str, entries: list, store=None) -> tuple:
    """(id, path, config) of a drafter named as `find` takes names; an unknown
    drafter is refused (pull it first)."""
    e = find(ref, entries, store)
    if e is not None:
        return e.id, e.path, e.config
    raise _unknown("drafter", ref, entries)


def check_settings(model_id: str, s: ModelSettings, store: SettingsStore, explicit_block: bool = True) -> None:
    """Checks that need the model files: the drafter is a DFlash drafter found here
    that fits the target, and the block size does not exceed the drafter's trained
    one. An unknown target passes (settings may precede a download); load_model re-checks."""
    entries = discover(store)
    try:
        target = find(model_id, entries, store)
    except HubError:
        target = None
    if target is not None and target.kind != "target":
        raise SettingsError(f"'{model_id}' is a {target.kind_label}; settings apply to target models")
    if s.drafter:
        did, _, cfg = _drafter_cfg(s.drafter, entries, store)
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


class FileChecks:
    """The settings checks that need model files, for SettingsStore(checker=...)."""

    def model(self, store, model_id: str, new: ModelSettings, explicit_block: bool) -> None:
        check_settings(model_id, new, store, explicit_block)

    def globals(self, store, new, changed: set) -> None:
        if "default_model" in changed and new.default_model is not None:
            e = resolve(new.default_model, store)  # unknown: one line with the command that downloads it
            if e.kind != "target":
                raise SettingsError(f"default_model: '{e.id}' is a {e.kind_label}; pick a target "
                                    "from `mlx-dflash models list --targets`")


def settings_store(path=None, **kw) -> SettingsStore:
    """The settings file with every check, model files included (what the CLI, the
    chat and the server write through)."""
    return SettingsStore(path, checker=FileChecks(), **kw)


# -- loading ---------------------------------------------------------------------------


def _pick_drafter(entry: ModelEntry, s: ModelSettings, entries: list, store=None) -> tuple:
    if s.drafter:
        did, path, _ = _drafter_cfg(s.drafter, entries, store)
        return did, str(path)
    if entry.compatible_drafters:
        did = entry.compatible_drafters[0]
        return did, str(next(e.path for e in entries if e.id == did))
    return None, None


def load_model(model_id: Optional[str] = None, store: Optional[SettingsStore] = None, *,
               drafter: Optional[str] = None, dflash: Optional[bool] = None,
               download: bool = False, dtype: Optional[str] = None) -> LoadedModel:
    """Load a target and, when DFlash is on, its drafter (the chosen one, else the
    best compatible one found), quantized and typed as the settings say.
    `drafter` (a name) overrides the settings' choice; `dflash` forces DFlash on or
    off; `download` fetches a Hugging Face repo id not on this machine; `dtype`
    overrides the `dtype` setting (the target's compute dtype)."""
    from .loader import _param_dtype
    from .loader import load as load_files

    store = store or SettingsStore()
    entries = discover(store)
    entry = resolve(model_id, store, entries, download=download)
    if entry.kind != "target":
        raise SettingsError(f"'{entry.id}' is a {entry.kind_label}, not a chat model; "
                            "pick a target from `mlx-dflash models list`")
    s = store.model(entry.id)
    notices = []
    did = dpath = None
    on = (s.dflash_enabled and s.verify_mode != "off") if dflash is None else dflash
    if dflash is not None:  # a flag overrides the saved choice for this load
        s = replace(s, dflash_enabled=dflash, verify_mode="dflash" if dflash and s.verify_mode == "off"
                    else s.verify_mode)
    if drafter is not None and on:
        try:
            d = resolve(drafter, store, entries, download=download)
        except SettingsError as e:
            raise SettingsError(str(e).replace("unknown model", "unknown drafter", 1)
                                .replace("model folder", "drafter folder", 1)) from None
        if d.kind not in DRAFTER_KINDS:
            raise SettingsError(f"'{d.id}' is a {d.kind_label}, not a DFlash drafter; see `mlx-dflash models list`")
        why = pair_problem(entry.config, d.config)
        if why:
            raise SettingsError(f"drafter '{d.id}' does not fit '{entry.id}': {why}")
        did, dpath = d.id, str(d.path)
    elif on:
        did, dpath = _pick_drafter(entry, s, entries, store)
        if dpath is None:
            notices.append(f"no compatible DFlash drafter found for '{entry.id}'; using plain decoding")
    # DFlash off: no drafter at all (the loader would otherwise look one up);
    # on with none found here: the loader may still find a published one (registry)
    if dtype is not None:
        s = replace(s, dtype=dtype)
    model, tok, drafter = _load_files(load_files, str(entry.path), dpath, auto_drafter=on,
                                      dtype=None if s.dtype == "auto" else s.dtype)
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


# -- after loading -----------------------------------------------------------------------

LOW_ACCEPT_DRAFTED = 32  # drafted tokens before judging a drafter (about 8 cycles at the default width)
LOW_ACCEPT_RATE = 0.03


def acceptance_warning(stats, drafter_id: Optional[str] = None) -> Optional[str]:
    """One line when a drafter that fits the target's shapes accepts almost nothing
    (a drafter trained for another target, or broken weights): it then only costs
    time. None otherwise, and before enough drafts to judge."""
    if stats is None:
        return None
    get = stats.get if isinstance(stats, dict) else lambda k: getattr(stats, k, None)  # GenerationStats or to_dict()
    drafted, accepted = get("drafted") or 0, get("accepted") or 0
    if get("mode") == "off" or drafted < LOW_ACCEPT_DRAFTED or accepted / drafted >= LOW_ACCEPT_RATE:
        return None
    name = f"drafter '{drafter_id}'" if drafter_id else "the drafter"
    return (f"{name} accepted {accepted} of {drafted} drafted tokens; it may be trained for "
            "another target (plain decoding would be faster: verify mode off, or pick another drafter)")


# -- download and removal ----------------------------------------------------------------

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.md"]


def pull_with_drafter(repo_id: str, progress: bool = True) -> tuple:
    """`models pull TARGET`: the target, then its registry drafter (registry.py), each
    with progress. Returns (target path, drafter repo or None, drafter path or None,
    a one-line problem with the drafter or None)."""
    from .registry import known_drafters

    path = pull(repo_id, progress)
    cfg_file = path / "config.json"
    if cfg_file.is_file() and "dflash_config" in cfg_file.read_text(errors="ignore"):
        return path, None, None, None  # a drafter itself
    repos = known_drafters(repo_id, path)
    if not repos:
        return path, None, None, None
    try:
        return path, repos[0], pull(repos[0], progress), None
    except HubError as e:
        return path, repos[0], None, str(e)


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
