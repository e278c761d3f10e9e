"""One model name everywhere (every command, the chat, the server, mlx_dflash.load):
a folder path, an id as `models list` prints it (case aside), a Hugging Face repo
id, or the folder name of a model kept as ORG/NAME elsewhere. Never downloads
(except `resolve(..., download=True)`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..platform.hub import HubError, resolve_path
from ..settings.schema import SettingsError, did_you_mean
from ..settings.store import SettingsStore
from .discovery import ModelEntry, compatible_drafters, default_pair, discover, make_entry, weights_problem


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
        e = make_entry(str(p), p, "folder", store)
        if e is None:
            raise HubError(f"{p} holds no model mlx-dflash can use (not a language model config)")
        if e.kind == "target":
            e.compatible_drafters = compatible_drafters(e, entries)
        return e
    return find_listed(name, entries)


def find_listed(name: str, entries: list) -> Optional[ModelEntry]:
    """The model among `entries` whose id `name` spells (exactly, any case, ORG/NAME
    for NAME or NAME for ORG/NAME), None if none; never touches the filesystem (the
    server matches clients' names with it: a client must not make it stat paths)."""
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


def same_path(a: str, b: str) -> bool:
    """Whether two spellings of a path name the same place, by their text alone
    (`~` expanded, made absolute, `..` folded): no filesystem access."""
    def norm(p: str) -> str:
        return os.path.normpath(os.path.abspath(os.path.expanduser(p)))

    return norm(a) == norm(b)


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
        raise HubError(f"the embedded default model is missing from {default_pair()[0]}; "
                       "reinstall mlx-dflash or pass a model id (mlx-dflash models list)")
    if _is_repo_id(model_id) and download and not _near(model_id, entries):  # (a near miss: a typo, not a repo)
        try:
            path = resolve_path(model_id, "model")  # the hub's cache, or a download
        except HubError as err:  # the same message as without download, and what the fetch said
            raise SettingsError(f"{unknown_model(model_id, entries)} (fetching it now failed: {err})") from None
        e = make_entry(model_id, path, "hf-cache", store)
        if e is None:
            raise HubError(f"'{model_id}' holds no model mlx-dflash can use (needs config.json and "
                           ".safetensors weights)")
        if e.kind == "target":
            e.compatible_drafters = compatible_drafters(e, entries)
        return e
    raise SettingsError(unknown_model(model_id, entries))


def unknown_model(name: str, entries: list, what: str = "model") -> str:
    """The one message for a model (or drafter) name that matches nothing here:
    generate, chat, serve and settings all say this (resolve raises it)."""
    return str(_unknown(what, name, entries))


def _unknown(what: str, name: str, entries: list) -> SettingsError:
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # meant as a path
        return SettingsError(f"{what} folder {name} does not exist; pass a folder that holds config.json, "
                             "or an id from `mlx-dflash models list`")
    near = _near(name, entries)
    if near:  # a near miss of a name here: a typo, not a model to download
        return SettingsError(f"unknown {what} '{name}'{near}")
    hint = (f"download it with `mlx-dflash models pull {name}`" if _is_repo_id(name)
            else "see `mlx-dflash models list`")
    return SettingsError(f"unknown {what} '{name}'; {hint}")


def _near(name: str, entries: list) -> str:
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


def drafter_ref(ref: str, entries: list, store=None) -> tuple:
    """(id, path, config) of a drafter named as `find` takes names; an unknown
    drafter is refused (pull it first)."""
    e = find(ref, entries, store)
    if e is not None:
        return e.id, e.path, e.config
    raise _unknown("drafter", ref, entries)
