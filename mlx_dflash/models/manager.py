"""The model manager: load a model with its settings (drafter choice, drafter
quantization), download and remove models.

    load_model(model_id, store) -> LoadedModel
    pull(repo_id) -> Path;  remove(model_id, store) -> bytes freed

What it builds on, one way (names -> discovery -> registry -> loader -> manager),
each imported from where it lives:

    discovery.discover(store) -> [ModelEntry]       every model found, drafters included
    discovery.list_targets(store) -> [ModelEntry]   what a user can chat with
    model_names.resolve(name, store) -> ModelEntry  one name everywhere: folder, listed id, repo id
    model_names.model_path(name, store) -> str      the same for mlx_dflash.load (load(name, drafter))
    settings_checks.settings_store() -> SettingsStore  settings with the checks that need model files
    drafter_precision: the drafter's precision; settings.py: the settings file.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..platform.hub import HubError
from ..settings.schema import ModelSettings, SettingsError
from ..settings.store import SettingsStore
from . import loader

# what the API above names, and what callers import from here, whichever file it lives in
from .discovery import DRAFTER_KINDS, ModelEntry, dir_size, discover, hf_cache_dir, notice, pair_problem
from .drafter_precision import quantize_drafter, resolve_quant_bits, safe_activation_dtype, set_activation_dtype
from .dtype_choice import DtypeChoice, param_dtype
from .model_names import check_files, drafter_ref, model_path, resolve
from .registry import known_drafters
from ..policy.registry import fit_block_size


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
    dtype: Optional[DtypeChoice] = None  # the compute dtype and why (dtype_notice: the line to show once)
    quant_bits: Optional[int] = None  # the drafter's weight bits as loaded (None: full precision)
    quant_why: str = ""  # why (drafter.quant_bits auto: per backend)

    def generation_kwargs(self) -> dict:
        return self.settings.generation_kwargs()

    def dtype_notice(self) -> Optional[str]:
        """One line when `dtype auto` was chosen by a measurement made at this load
        (the first on this machine): generate prints it, the chat shows it."""
        c = self.dtype
        if c is None or not c.fresh or c.cast is None:
            return None
        return f"{c.line()}; `mlx-dflash settings set {self.id} dtype checkpoint` keeps {c.checkpoint}"


def load(model: Optional[str] = None, drafter: Optional[str] = None, *, store: Optional[SettingsStore] = None,
         **kw):
    """`mlx_dflash.load`: loader.load with names. `model` and `drafter` may be
    folders, Hugging Face repo ids or any id `models list` prints; other keyword
    arguments (dtype, ...) are loader.load's. Returns (model, tokenizer, drafter or None)."""
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


# -- loading ---------------------------------------------------------------------------


def pick_drafter(entry: ModelEntry, s: ModelSettings, entries: list, store=None) -> tuple:
    if s.drafter:
        did, path, _ = drafter_ref(s.drafter, entries, store)
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
        did, dpath = pick_drafter(entry, s, entries, store)
        if dpath is None:
            notices.append(f"no compatible DFlash drafter found for '{entry.id}'; using plain decoding")
    # DFlash off: no drafter at all (the loader would otherwise look one up);
    # on with none found here: the loader may still find a published one (registry)
    if dtype is not None:
        s = replace(s, dtype=dtype)
    model, tok, drafter, choice = _load_files(loader.load_with_choice, str(entry.path), dpath, auto_drafter=on,
                                              dtype=s.dtype)
    bits, bits_why = resolve_quant_bits(s.drafter_quant_bits)
    if drafter is not None:
        tdt = param_dtype(model)
        act, why = safe_activation_dtype(s.drafter_activation_dtype, tdt)
        if why:
            notices.append(why)
        if act != tdt:
            set_activation_dtype(drafter, act)
        if bits:
            quantize_drafter(drafter, bits, s.drafter_quant_group_size,
                             scale_dtype=mx.float16 if act == mx.float16 else mx.bfloat16)
        fitted = fit_block_size(s.block_size, drafter.block_size, explicit=False)
        if fitted != s.block_size:
            notices.append(f"block_size {s.block_size} is above the drafter's trained block size "
                           f"{drafter.block_size}; using {fitted}")
            s = replace(s, block_size=fitted)
    loader.materialize(model, drafter)  # again: the drafter was typed and quantized after the loader
    for n in notices:
        notice(n)
    return LoadedModel(entry.id, model, tok, drafter, s, entry, did, notices, choice,
                       bits if drafter is not None else None, bits_why)


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
    size = dir_size(path)
    shutil.rmtree(path)
    parent = path.parent
    if parent not in roots and any(r in parent.parents for r in roots) and not any(parent.iterdir()):
        parent.rmdir()  # the now-empty org folder
    return size
