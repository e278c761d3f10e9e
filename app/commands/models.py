"""`mlx-dflash models list|show|pull|rm`: the model manager on the command line."""

from __future__ import annotations

import json
import sys


def add_parser(sub):
    p = sub.add_parser("models", help="list, inspect, download and remove models")
    s = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    ls = s.add_parser("list", help="models found: embedded, model folders, Hugging Face cache")
    ls.add_argument("--targets", action="store_true", help="only models you can chat with (no drafters)")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    sh = s.add_parser("show", help="one model: kind, size, memory, drafters, settings")
    sh.add_argument("id", nargs="?", default=None, help="model id (default: the default model)")
    sh.add_argument("--json", action="store_true", help="print one JSON object")
    pl = s.add_parser("pull", help="download a model from Hugging Face")
    pl.add_argument("repo", help="Hugging Face repo id, org/name")
    rm = s.add_parser("rm", help="delete a downloaded model (never an embedded one)")
    rm.add_argument("id")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _list(args, store) -> int:
    from mlx_dflash.models.discovery import discover, list_targets

    entries = list_targets(store) if args.targets else discover(store)
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print("no models found; `mlx-dflash models pull ORG/NAME` downloads one, "
              "`mlx-dflash settings set model_dirs DIR` adds a folder")
        return 0
    default = store.globals().default_model or "embedded/target"
    rows = [("ID", "KIND", "SOURCE", "SIZE", "MEMORY", "DRAFTERS")]
    for e in entries:
        drafters = ", ".join(e.compatible_drafters) if e.kind == "target" else f"block size {e.block_size}" \
            if e.block_size else ""
        rows.append((e.id + (" *" if e.id == default else ""), e.kind_label, e.source, human(e.size_bytes),
                     human(e.est_memory_bytes), drafters))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    if any(e.id == default for e in entries):
        print("* default model")
    return 0


def _show(args, store) -> int:
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.models.model_names import resolve
    from mlx_dflash.settings.schema import MODEL_KEYS

    entries = discover(store)
    e = resolve(args.id, store, entries)
    info = e.to_dict()
    info["kind_label"] = e.kind_label
    if e.kind == "target":
        s = store.model(e.id)
        info["settings"] = {k: getattr(s, f) for k, f in MODEL_KEYS.items()}
        info["settings_set"] = sorted(store.explicit(e.id))
        info["drafter_in_use"] = (s.drafter or (e.compatible_drafters[0] if e.compatible_drafters else None)) \
            if s.dflash_enabled and s.verify_mode != "off" else None
    else:
        info["compatible_targets"] = [t.id for t in entries if e.id in t.compatible_drafters]
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"{e.id}  ({e.kind_label}, {e.source})")
    print(f"  path            {e.path}")
    print(f"  size on disk    {human(e.size_bytes)}")
    print(f"  est. memory     {human(e.est_memory_bytes)}" + ("  (weights + KV cache for max_context)"
                                                           if e.kind == "target" else ""))
    if e.kind == "target":
        print(f"  drafters        {', '.join(e.compatible_drafters) or 'none found (plain decoding)'}")
        print(f"  drafter in use  {info['drafter_in_use'] or 'none (plain decoding)'}")
        print("  settings        (* = set by you; change with `mlx-dflash settings set "
              f"{e.id} KEY VALUE`)")
        explicit = set(info["settings_set"])
        for k, v in info["settings"].items():
            print(f"    {'*' if k in explicit else ' '} {k} = {json.dumps(v)}")
    else:
        if e.block_size:
            print(f"  block size      {e.block_size} (trained)")
        print(f"  fits targets    {', '.join(info['compatible_targets']) or 'none found'}")
    return 0


def _pull(args, store) -> int:
    from mlx_dflash.models.manager import pull_with_drafter
    from mlx_dflash.models.model_names import resolve
    from mlx_dflash.settings.schema import SettingsError

    path, drepo, dpath, dproblem = pull_with_drafter(args.repo)  # the target's drafter too (registry.py)
    try:
        e = resolve(args.repo, store)
    except SettingsError:
        raise SettingsError(f"downloaded {args.repo} to {path}, but it holds no model mlx-dflash can use "
                            "(needs config.json and .safetensors weights)") from None
    print(f"downloaded {e.id} ({e.kind_label}, {human(e.size_bytes)}) to {path}")
    if dpath is not None:
        print(f"downloaded its DFlash drafter {drepo} to {dpath}")
    elif dproblem:
        print(f"its DFlash drafter {drepo} was not downloaded: {dproblem}")
    return 0


def _rm(args, store) -> int:
    from mlx_dflash.models.manager import remove
    from mlx_dflash.models.model_names import resolve
    from mlx_dflash.settings.schema import SettingsError  # a ValueError: the CLI prints one line, exits 2

    e = resolve(args.id, store)
    if e.source == "embedded":
        raise SettingsError(f"'{e.id}' is an embedded model (part of mlx-dflash); it cannot be removed")
    if not args.yes:
        if not sys.stdin.isatty():
            raise SettingsError(f"add --yes to delete '{e.id}' ({human(e.size_bytes)} at {e.path})")
        ans = input(f"delete '{e.id}' ({human(e.size_bytes)} at {e.path})? [y/N] ")
        if ans.strip().lower() not in ("y", "yes"):
            print("kept")
            return 1
    freed = remove(e.id, store)
    print(f"removed {e.id} ({human(freed)} freed)")
    return 0


def run(args) -> int:
    from mlx_dflash.models.settings_checks import settings_store

    store = settings_store()
    return {"list": _list, "show": _show, "pull": _pull, "rm": _rm}[args.models_command](args, store)
