"""`mlx-dflash chat`: a terminal chat (Textual) with live DFlash statistics.

    app.py             the app: layout, keys, actions
    engine.py          the model manager it uses, the generation job (engine thread)
    widgets.py         input, message bubbles, the status bar's text
    screens.py         pick-from-a-list, yes/no, rename, help
    settings_panel.py  the settings form

Keys: Enter sends, ctrl+j (or shift+enter where the terminal reports it) adds
a newline; F1 lists the rest."""

from __future__ import annotations

from app.errors import UserError

from .app import ChatApp
from .engine import ManagerBackend, build_prompt
from .settings_panel import SettingsScreen
from .widgets import DRAFT_STYLE, TARGET_STYLE, AnswerBubble, UserBubble

__all__ = ["ChatApp", "ManagerBackend", "build_prompt", "SettingsScreen", "AnswerBubble", "UserBubble",
           "DRAFT_STYLE", "TARGET_STYLE", "add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser("chat", help="chat in the terminal (Textual), with live DFlash stats")
    p.add_argument("--model", default=None, help="an id from `mlx-dflash models list`, a folder or a Hugging Face "
                                                 "repo id (default: the default model)")
    p.add_argument("--new", action="store_true", help="start a new chat instead of reopening the last one")


def run(args) -> int:
    try:
        backend = ManagerBackend()
        entry = backend.resolve(args.model)  # unknown model / missing embedded pair: one line, before the UI
    except ImportError as e:
        raise UserError(f"the model manager is unavailable ({e}); reinstall mlx-dflash") from None
    if entry.kind != "target":
        raise UserError(f"'{entry.id}' is a {entry.kind_label}, not a chat model; pick a target from "
                        "`mlx-dflash models list --targets`")
    from mlx_dflash.models.model_names import check_files

    check_files(entry.path)  # a damaged folder: one line naming the file, before the UI
    ChatApp(entry.id, backend=backend, reopen_last=not args.new).run()
    return 0
