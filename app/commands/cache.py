"""`mlx-dflash cache list|du|clear`: the prompt cache on disk (mlx_dflash.cache.disk),
which serve, chat and generate share: what it holds, how much room it takes, and
emptying it (the prompts it held are prefilled again, nothing else is lost)."""

from __future__ import annotations

import json
import time

from app.commands.models import human
from app.errors import UserError
from mlx_dflash.cache.disk import root_dir
from mlx_dflash.cache.disk_folder import clear, folders
from mlx_dflash.models.settings_checks import settings_store
from mlx_dflash.platform.paths import cache_dir
from mlx_dflash.settings.schema import GlobalSettings


def add_parser(sub):
    p = sub.add_parser("cache", help="the prompt cache on disk: list, du, clear",
                       description="Cached prompt prefixes on disk (serve, chat and generate share them). "
                                   "Its budget is the setting prompt_cache_disk_gb (0: memory only).")
    s = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    ls = s.add_parser("list", help="one line per model (and drafter, dtype, versions) with cached prompts")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    du = s.add_parser("du", help="the room the prompt cache takes, against its budget")
    du.add_argument("--json", action="store_true", help="print one JSON object")
    cl = s.add_parser("clear", help="delete cached prompts (all, or one model's)")
    cl.add_argument("--model", default=None, help="only the prompts cached for models whose name contains this")


def _name(row: dict) -> str:
    ident = row["identity"]
    name = ident.get("name") or "(unnamed)"
    d = ident.get("drafter")
    return name + (" + drafter" if d else "")


def _ago(t: float) -> str:
    if not t:
        return "never"
    s = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return "just now"


def _budget() -> int:
    try:
        return settings_store().globals().prompt_store_bytes()[1]
    except ValueError:  # an unreadable settings file: the default
        return GlobalSettings().prompt_store_bytes()[1]


def run(args) -> int:
    root = root_dir(cache_dir())
    rows = folders(root)
    if args.cache_command == "list":
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        if not rows:
            print(f"no cached prompts in {root}")
            return 0
        table = [("MODEL", "ENTRIES", "LONGEST", "SIZE", "LAST USED", "FOLDER")]
        for r in rows:
            stale = "" if r["current"] else " (another mlx-dflash version: unused)"
            table.append((_name(r) + stale, str(r["entries"]), f"{max(r['tokens'], default=0):,} tokens",
                          human(r["bytes"]), _ago(r["last_used"]), r["folder"]))
        widths = [max(len(t[i]) for t in table) for i in range(5)]
        for t in table:
            print("  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[5])
        return 0
    if args.cache_command == "du":
        total, budget = sum(r["bytes"] for r in rows), _budget()
        if args.json:
            print(json.dumps({"folder": str(root), "bytes": total, "budget": budget,
                              "entries": sum(r["entries"] for r in rows), "blocks": sum(r["blocks"] for r in rows)}))
            return 0
        share = f" ({total / budget:.0%})" if budget else ""
        print(f"{human(total)} of {human(budget)}{share} in {root} "
              f"({sum(r['entries'] for r in rows)} prompts, {sum(r['blocks'] for r in rows)} shared blocks)")
        return 0
    # clear
    want = [r for r in rows if args.model is None or args.model.lower() in _name(r).lower()]
    if args.model is not None and not want:
        raise UserError(f"no cached prompts for a model named like '{args.model}'; `mlx-dflash cache list` "
                        "shows them")
    files = size = 0
    try:
        for r in want:
            f, b = clear(root, r["folder"])
            files, size = files + f, size + b
    except OSError as e:
        raise UserError(f"cannot delete cached prompts in {root}: {e.strerror or e}") from None
    print(f"removed {files} files ({human(size)}) from {root}")
    return 0
