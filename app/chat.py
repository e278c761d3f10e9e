"""`mlx-dflash chat`: a terminal chat (Textual) with live DFlash statistics.

All MLX work (loading, generation) runs on one engine thread: MLX streams are
thread-local, and the engine runs one generation at a time per model. The
engine thread posts token batches to the UI as messages, so the UI never
blocks; Esc sets a flag the engine checks after every token and closes the
generator. One PromptCache is kept for the loaded model: a follow-up turn only
prefills what is new since the last one, and switching chats, regenerating or
clearing is handled by the engine trimming the cache to the common prefix.

Keys: Enter sends, ctrl+j (or shift+enter where the terminal reports it) adds
a newline; the footer lists the rest."""

from __future__ import annotations

import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.markup import escape
from rich.text import Text
from textual.css.query import NoMatches
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Footer, Input, Label, Markdown, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from .chat_history import Chat, HistoryStore
from .chat_history import Message as ChatMessage

DRAFT_STYLE = "#7ee787"  # accepted draft tokens
TARGET_STYLE = "#79c0ff"  # the target's own tokens (first token, bonus tokens, plain decoding)


def add_parser(sub):
    p = sub.add_parser("chat", help="chat in the terminal (Textual), with live DFlash stats")
    p.add_argument("--model", default=None, help="model id, folder or HF repo id (default: the default model)")
    p.add_argument("--new", action="store_true", help="start a new chat instead of reopening the last one")


def run(args) -> int:
    from .cli import UserError

    try:
        backend = ManagerBackend()
        entry = backend.resolve(args.model)  # unknown model / missing embedded pair: one line, before the UI
    except ImportError as e:
        raise UserError(f"the model manager is unavailable ({e}); reinstall mlx-dflash") from None
    ChatApp(entry.id, backend=backend, reopen_last=not args.new).run()
    return 0


# -- model manager --------------------------------------------------------------------


class ManagerBackend:
    """What the chat needs from the model manager; tests may pass another object
    with these methods."""

    def __init__(self, store=None):
        from mlx_dflash.settings import SettingsStore

        self.store = store if store is not None else SettingsStore()

    def resolve(self, model_id):
        from mlx_dflash.manager import resolve

        return resolve(model_id, self.store)

    def targets(self) -> list:
        from mlx_dflash.manager import list_targets

        return list_targets(self.store)

    def load(self, model_id):
        from mlx_dflash.manager import load_model

        return load_model(model_id, self.store)

    def save_settings(self, model_id, **changes):
        return self.store.set_model(model_id, **changes)


# settings whose change needs the drafter (or model) loaded again
RELOAD_KEYS = ("drafter", "drafter_quant_bits", "drafter_quant_group_size", "drafter_activation_dtype")


def build_prompt(tokenizer, system: str, messages: list) -> list:
    """Token ids of the conversation with the model's chat template (plain
    "role: text" lines for a tokenizer without one)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tokenizer.encode(text)


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# -- engine -> UI messages -------------------------------------------------------------


@dataclass
class Turn:
    """One answer being generated (owned by the engine thread until Finished)."""

    chat: Chat
    loaded: object
    settings: object
    text: str = ""
    spans: list = field(default_factory=list)  # [[text, from_draft], ...] merged runs
    stats: dict = field(default_factory=dict)
    ttft: Optional[float] = None
    batches: int = 0  # token batches the UI received
    cancel: threading.Event = field(default_factory=threading.Event)
    widget: object = None
    question: object = None  # the chat's last message when the answer began
    recorded: bool = False  # added to the chat

    def add(self, text: str, from_draft: bool) -> None:
        if not text:
            return
        self.text += text
        if self.spans and self.spans[-1][1] == from_draft:
            self.spans[-1][0] += text
        else:
            self.spans.append([text, from_draft])


class Tokens(Message):
    def __init__(self, turn: Turn, pieces: list, stats: dict):
        super().__init__()
        self.turn, self.pieces, self.stats = turn, pieces, stats


class Finished(Message):
    def __init__(self, turn: Turn, reason: str, stats: dict, error: Optional[str] = None):
        super().__init__()
        self.turn, self.reason, self.stats, self.error = turn, reason, stats, error


class Loaded(Message):
    def __init__(self, model_id, loaded=None, error: Optional[str] = None):
        super().__init__()
        self.model_id, self.loaded, self.error = model_id, loaded, error


# -- widgets ---------------------------------------------------------------------------


def spans_text(spans) -> Text:
    t = Text()
    for s, draft in spans:
        t.append(s, style=DRAFT_STYLE if draft else TARGET_STYLE)
    return t


def summary_line(stats: dict, mask_timings: bool = False) -> str:
    """tokens, tok/s, tau, acceptance, time to first token (+ how it ended)."""
    if not stats:
        return ""
    t = lambda v, fmt: "–" if mask_timings else format(v, fmt)  # noqa: E731
    parts = [f"{stats.get('generation_tokens', 0)} tokens", f"{t(stats.get('generation_tps', 0.0), '.1f')} tok/s"]
    if stats.get("mode") == "dflash":
        parts += [f"tau {stats.get('tau', 0.0):.2f}", f"accept {stats.get('acceptance_rate', 0.0):.0%}"]
    else:
        parts.append("plain decoding" + (f" ({stats['fallback']})" if stats.get("fallback") else ""))
    if stats.get("ttft") is not None:
        parts.append(f"TTFT {t(stats['ttft'], '.2f')} s")
    if stats.get("prompt_tokens"):
        parts.append(f"cached {stats.get('reused_tokens', 0)}/{stats['prompt_tokens']}")
    end = {"length": "length limit", "stopped": "stopped", "error": "error"}.get(stats.get("finish"))
    if end:
        parts.append(end)
    return " · ".join(parts)


class ChatInput(TextArea):
    """Multi-line input: Enter sends, ctrl+j / shift+enter insert a newline."""

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    async def _on_key(self, event) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))  # the app clears the input once it sends
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class UserBubble(Static):
    def __init__(self, text: str):
        super().__init__(Text(text), classes="user", markup=False)
        self.text = text


def _intraword_star(state, silent: bool) -> bool:
    """`*` between two letters or digits is literal (GFM already does this for `_`):
    `12*5=60` is arithmetic in a model's answer, not the start of emphasis."""
    s, p = state.src, state.pos
    if s[p] != "*" or p == 0 or p + 1 >= state.posMax or not (s[p - 1].isalnum() and s[p + 1].isalnum()):
        return False
    if not silent:
        state.pending += "*"
    state.pos += 1
    return True


def _hard_breaks(state) -> None:
    # a model's line breaks are its own: keep them (Markdown joins the lines of a paragraph)
    for t in state.tokens:
        for c in t.children or ():
            if c.type == "softbreak":
                c.type = "hardbreak"


def answer_parser():
    from markdown_it import MarkdownIt

    md = MarkdownIt("gfm-like")  # what Textual's Markdown uses by default
    md.inline.ruler.before("emphasis", "intraword_star", _intraword_star)
    md.core.ruler.push("hard_breaks", _hard_breaks)
    return md


class AnswerBubble(Vertical):
    """An answer: Markdown (highlighted code) or, with token colours on, each
    token coloured by where it came from; a summary line under it."""

    def __init__(self, text="", spans=None, stats=None, colours=False, mask_timings=False):
        super().__init__(classes="answer")
        self.text, self.spans, self.stats = text, spans or ([[text, False]] if text else []), stats or {}
        self.colours, self.mask_timings = colours, mask_timings
        self.updates = 0  # token batches shown (streaming)

    def compose(self) -> ComposeResult:
        yield Markdown(self.text if not self.colours else "", classes="md", parser_factory=answer_parser)
        yield Static(spans_text(self.spans) if self.colours else "", classes="spans")
        yield Static(summary_line(self.stats, self.mask_timings), classes="summary")

    def on_mount(self) -> None:
        self.set_class(self.colours, "-colours")

    async def add(self, text: str, spans: list) -> None:
        self.spans = spans
        self.updates += 1
        if self.colours:
            self.text += text
            self.query_one(".spans", Static).update(spans_text(spans))
        elif text:
            self.text += text
            await self.query_one(".md", Markdown).append(text)

    def finish(self, stats: dict) -> None:
        self.stats = stats
        self.query_one(".summary", Static).update(summary_line(stats, self.mask_timings))

    async def set_colours(self, on: bool) -> None:
        self.colours = on
        self.set_class(on, "-colours")
        if on:
            self.query_one(".spans", Static).update(spans_text(self.spans))
        else:
            await self.query_one(".md", Markdown).update(self.text)


# -- modal screens ---------------------------------------------------------------------


class ListScreen(ModalScreen):
    """Pick one of `options` [(id, label)]; dismisses with the id or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, title: str, options: list, current=None, empty: str = "nothing here"):
        super().__init__(classes="picker")
        self.title_text, self.options, self.current, self.empty = title, options, current, empty

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="title")
            if self.options:
                ol = OptionList(*[Option(lbl, id=i) for i, lbl in self.options])
                yield ol
            else:
                yield Label(self.empty, classes="empty")
            yield Label("Enter: open · Esc: close", classes="hint")

    def on_mount(self) -> None:
        if self.options:
            ol = self.query_one(OptionList)
            ids = [i for i, _ in self.options]
            ol.highlighted = ids.index(self.current) if self.current in ids else 0
            ol.focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event) -> None:
        self.dismiss(event.option.id)


# field, label, kind
SETTINGS_FIELDS = [
    ("dflash_enabled", "DFlash", "switch"),
    ("block_size", "Verify width (block size)", "int"),
    ("verify_mode", "Verify mode", "mode"),
    ("drafter_quant_bits", "Quantized drafter", "quant"),
    ("temperature", "Temperature", "float"),
    ("top_p", "Top p", "float"),
    ("top_k", "Top k (0 = off)", "int"),
    ("min_p", "Min p", "float"),
    ("max_tokens", "Max tokens", "int"),
    ("system_prompt", "System prompt", "text"),
]
QUANT_OPTIONS = [("full precision", "none"), ("8-bit", "8"), ("4-bit", "4")]


class SettingsScreen(ModalScreen):
    """Edits the model's settings; Save stores them through the model manager
    (validation messages inline) and dismisses with the new ModelSettings."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, model_id: str, settings, save, max_block: Optional[int] = None):
        super().__init__(classes="settings")
        self.model_id, self.settings, self._save, self.max_block = model_id, settings, save, max_block

    def compose(self) -> ComposeResult:
        from mlx_dflash.settings import verify_modes

        s = self.settings
        with Vertical(classes="dialog"):
            yield Label(f"Settings · {self.model_id}", classes="title")
            with VerticalScroll(classes="form"):
                for name, label, kind in SETTINGS_FIELDS:
                    with Horizontal(classes="row", id=f"row-{name}"):
                        yield Label(label, classes="label")
                        v = getattr(s, name)
                        if kind == "switch":
                            yield Checkbox("enabled", value=bool(v), id=f"f-{name}")
                        elif kind == "mode":
                            yield Select([(m, m) for m in verify_modes()], value=v, allow_blank=False,
                                         compact=True, id=f"f-{name}")
                        elif kind == "quant":
                            yield Select(QUANT_OPTIONS, value="none" if v is None else str(v), allow_blank=False,
                                         compact=True, id=f"f-{name}")
                        elif kind == "text":
                            yield TextArea(v, compact=True, id=f"f-{name}")
                        else:
                            yield Input(str(v), compact=True, id=f"f-{name}")
                    yield Static("", classes="error", id=f"err-{name}")
            yield Static("", classes="error", id="err-form")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
                yield Label("Tab next · ctrl+s save · Esc cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one(f"#f-{SETTINGS_FIELDS[0][0]}").focus()

    @on(Input.Changed)
    def _edited(self, event) -> None:  # an edited field's old message no longer applies
        name = (event.input.id or "").removeprefix("f-")
        if name:
            self.query_one(f"#err-{name}", Static).display = False
            self.query_one(f"#row-{name}").remove_class("-invalid")

    def values(self) -> tuple:
        """(changes, errors) from the form: only fields that differ from the settings."""
        changes, errors = {}, {}
        for name, _, kind in SETTINGS_FIELDS:
            w = self.query_one(f"#f-{name}")
            if kind == "switch":
                v = w.value
            elif kind == "mode":
                v = w.value
            elif kind == "quant":
                v = None if w.value == "none" else int(w.value)
            elif kind == "text":
                v = w.text
            else:
                raw = w.value.strip()
                try:
                    v = int(raw) if kind == "int" else float(raw)
                except ValueError:
                    errors[name] = f"must be {'an integer' if kind == 'int' else 'a number'}, got '{raw}'"
                    continue
            if name == "block_size" and self.max_block is not None and v > self.max_block:
                errors[name] = f"at most {self.max_block}, this drafter's trained block size"
                continue
            if v != getattr(self.settings, name):
                changes[name] = v
        return changes, errors

    def show_errors(self, errors: dict, form: str = "") -> None:
        for name, _, _ in SETTINGS_FIELDS:
            w = self.query_one(f"#err-{name}", Static)
            w.update(Text(errors.get(name, ""), style="bold red"))
            w.display = name in errors
            self.query_one(f"#row-{name}").set_class(name in errors, "-invalid")
        w = self.query_one("#err-form", Static)
        w.update(Text(form, style="bold red"))
        w.display = bool(form)

    def action_save(self) -> None:
        from mlx_dflash.settings import MODEL_KEYS, SettingsError

        changes, errors = self.values()
        if errors:
            self.show_errors(errors)
            return
        if not changes:
            self.dismiss(None)
            return
        try:
            new = self._save(**changes)
        except (SettingsError, ValueError) as e:
            msg = _one_line(e)
            # put the message under the field it names (keys as the user writes them)
            keys = sorted(MODEL_KEYS.items(), key=lambda kv: -len(kv[0]))
            name = next((f for k, f in keys if msg.startswith(k) or f" {k} " in f" {msg} "), None)
            if name in dict((n, 1) for n, _, _ in SETTINGS_FIELDS):
                self.show_errors({name: msg})
            else:
                self.show_errors({}, msg)
            return
        self.dismiss((new, changes))

    @on(Button.Pressed, "#save")
    def _save_pressed(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(None)


# -- the app ---------------------------------------------------------------------------


class ChatApp(App):
    TITLE = "mlx-dflash chat"
    CSS_PATH = "chat.tcss"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+y", "copy_last", "Copy", priority=True),  # TextArea uses ctrl+y for redo
        Binding("ctrl+t", "toggle_colours", "Colours"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "switch_model", "Model"),
        Binding("ctrl+b", "chats", "Chats"),  # ctrl+h is backspace in most terminals
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, model_id: Optional[str] = None, backend=None, history: Optional[HistoryStore] = None,
                 reopen_last: bool = True, mask_timings: bool = False, flush_s: float = 0.05):
        super().__init__()
        self.backend = backend if backend is not None else ManagerBackend()
        self.history = history if history is not None else HistoryStore()
        self.model_id = model_id
        self.loaded = None  # LoadedModel
        self.settings = None  # ModelSettings of the loaded model
        self.status = "starting…"
        self.last_stats: dict = {}
        self.colours = False
        self.mask_timings = mask_timings  # snapshot tests: no wall-clock numbers on screen
        self.flush_s = flush_s  # how often the engine posts a token batch
        self.turn: Optional[Turn] = None  # the answer being generated
        self.prompt_cache = None
        self.reopen_last = reopen_last
        self.chat = Chat()
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="mlx-dflash-engine")

    # -- layout --
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="messages")
        yield ChatInput(id="input", compact=True, placeholder="Message (Enter sends, ctrl+j newline)")
        yield Static(id="status")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        chats, notices = self.history.list()
        for n in notices:
            self.notify(n, severity="warning", timeout=8)
        if self.reopen_last and chats:
            self.call_after_refresh(self.open_chat, chats[0])
        self.query_one("#input").focus()
        self.load(self.model_id)

    def on_unmount(self) -> None:
        turn = self.turn
        if turn is not None:  # quitting mid-answer: keep what was written so far
            turn.cancel.set()
            self.record(turn, dict(turn.stats, finish="stopped"))
        self._engine.shutdown(wait=False, cancel_futures=True)

    def submit(self, fn, *args) -> None:
        """Run `fn` on the engine thread (in this app's context, so it can post messages)."""
        self._engine.submit(contextvars.copy_context().run, fn, *args)

    # -- status bar --
    def render_status(self) -> None:
        parts = []
        if self.loaded is not None:
            parts.append(f"[b]{escape(self.loaded.id)}[/b] + {escape(self.drafter_label())}")
            s = self.last_stats
            if self.loaded.drafter is None or not self.settings.dflash_enabled or self.settings.verify_mode == "off":
                parts.append("DFlash [b]off[/b]")
            elif s.get("fallback"):
                parts.append(f"DFlash [b yellow]fallback[/]: {escape(s['fallback'])}")
            else:
                mode = "" if self.settings.verify_mode == "dflash" else f"{self.settings.verify_mode}, "
                parts.append(f"DFlash [b green]on[/] ({mode}w {self.settings.block_size})")
            if s:
                tps = "–" if self.mask_timings else f"{s.get('generation_tps', 0.0):.1f}"
                parts.append(f"{tps} tok/s")
                if s.get("mode") == "dflash":
                    parts.append(f"tau {s.get('tau', 0.0):.2f} · accept {s.get('acceptance_rate', 0.0):.0%}")
        if self.status:
            parts.append(f"[b red]{escape(self.status)}[/]" if self.status.startswith("error:") else escape(self.status))
        if self.colours:
            parts.append(f"[{DRAFT_STYLE}]■ draft[/] [{TARGET_STYLE}]■ target[/]")
        try:
            bar = self.query_one("#status", Static)
        except NoMatches:  # the app is shutting down mid-answer: no screen to update
            return
        bar.update(" · ".join(parts))

    def drafter_label(self) -> str:
        d = self.loaded.drafter if self.loaded is not None else None
        if d is None:
            return "no drafter"
        name = getattr(self.loaded, "drafter_id", None) or self.settings.drafter or ""
        if Path(str(name)).is_dir():  # a folder path: its name is enough
            name = Path(str(name)).name
        bits = f", {self.settings.drafter_quant_bits}-bit" if self.settings.drafter_quant_bits else ""
        return f"{name or 'drafter'} (v{d.version}, b{d.block_size}{bits})"

    def set_status(self, text: str) -> None:
        self.status = text
        self.render_status()

    # -- loading --
    def load(self, model_id) -> None:
        self.loaded, self.settings, self.prompt_cache = None, None, None
        self.set_status(f"loading {model_id or 'the default model'}…")

        def job():
            try:
                lm = self.backend.load(model_id)
            except Exception as e:  # every load error is shown as one line
                self.post_message(Loaded(model_id, error=_one_line(e)))
            else:
                self.post_message(Loaded(model_id, lm))

        self.submit(job)

    def on_loaded(self, m: Loaded) -> None:
        if m.error:
            self.set_status(f"error: {m.error}")
            self.notify(m.error, severity="error", timeout=10)
            return
        from mlx_dflash import PromptCache

        self.loaded, self.model_id = m.loaded, m.loaded.id
        self.settings = m.loaded.settings
        self.prompt_cache = PromptCache()  # a new model: nothing cached is valid
        self.last_stats = {}
        self.set_status("ready")
        for n in getattr(m.loaded, "notices", None) or []:
            self.notify(n, severity="warning", timeout=8)

    # -- chats --
    async def open_chat(self, chat: Chat) -> None:
        self.chat = chat
        box = self.query_one("#messages")
        await box.remove_children()
        widgets = []
        for m in chat.messages:
            if m.role == "user":
                widgets.append(UserBubble(m.content))
            else:
                widgets.append(AnswerBubble(m.content, m.spans, m.stats, self.colours, self.mask_timings))
        await box.mount_all(widgets)
        box.scroll_end(animate=False)
        self.sub_title = chat.title

    def _stop_turn(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()

    async def action_new_chat(self) -> None:
        self._stop_turn()
        await self.open_chat(Chat())

    async def action_clear(self) -> None:
        self._stop_turn()
        self.chat.messages = []
        self.chat.title = ""
        self.save_chat(self.chat)
        await self.open_chat(self.chat)

    def save_chat(self, chat: Chat) -> None:
        if not chat.messages and not self.history.path(chat.id).exists():
            return  # an empty new chat leaves no file behind
        try:
            self.history.save(chat)
        except OSError as e:
            self.notify(f"could not save the chat to {self.history.root}: {e.strerror}", severity="error")

    def action_chats(self) -> None:
        chats, notices = self.history.list()
        for n in notices:
            self.notify(n, severity="warning")
        by_id = {c.id: c for c in chats}

        def label(c: Chat) -> str:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            return f"{when}  {c.title or '(empty)'}  [{len(c.messages)} msgs]"

        async def picked(chat_id) -> None:
            if chat_id and chat_id in by_id and chat_id != self.chat.id:
                self._stop_turn()
                await self.open_chat(by_id[chat_id])

        self.push_screen(ListScreen("Chats", [(c.id, label(c)) for c in chats], self.chat.id,
                                    empty="no saved chats yet"), picked)

    # -- models and settings --
    def action_switch_model(self) -> None:
        try:
            entries = self.backend.targets()
        except Exception as e:
            self.notify(_one_line(e), severity="error")
            return

        def label(e) -> str:
            gb = (getattr(e, "size_bytes", 0) or 0) / 1e9
            dr = len(getattr(e, "compatible_drafters", []) or [])
            return f"{e.id}  ({e.source}, {gb:.2f} GB, {dr} drafter{'s' if dr != 1 else ''})"

        def picked(model_id) -> None:
            if model_id and (self.loaded is None or model_id != self.loaded.id):
                self._stop_turn()
                self.load(model_id)

        self.push_screen(ListScreen("Models", [(e.id, label(e)) for e in entries], self.model_id,
                                    empty="no models found; add a folder with `mlx-dflash settings`"), picked)

    def action_settings(self) -> None:
        if self.loaded is None:
            self.notify("no model is loaded yet", severity="warning")
            return
        model_id = self.loaded.id
        d = self.loaded.drafter

        def done(result) -> None:
            if not result:
                return
            new, changes = result
            if self.loaded is None or self.loaded.id != model_id:
                return
            self.settings = new
            self.loaded.settings = new
            wants_drafter = new.dflash_enabled and new.verify_mode != "off" and self.loaded.drafter is None
            if set(changes) & set(RELOAD_KEYS) or wants_drafter:
                self.load(model_id)  # the drafter changes: load it again (queued after any answer)
            else:
                self.render_status()
            self.notify("settings saved; they apply to the next message")

        self.push_screen(SettingsScreen(model_id, self.settings, lambda **ch: self.backend.save_settings(model_id, **ch),
                                        d.block_size if d is not None else None), done)

    # -- chatting --
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        if await self.send(event.text):
            self.query_one("#input", ChatInput).clear()

    async def send(self, text: str) -> bool:
        if self.turn is not None:
            self.notify("an answer is still being written; Esc stops it", severity="warning")
            return False
        if self.loaded is None:
            self.notify(f"no model loaded ({self.status})", severity="warning")
            return False
        self.chat.messages.append(ChatMessage("user", text))
        self.save_chat(self.chat)
        await self.query_one("#messages").mount(UserBubble(text))
        await self.generate()
        return True

    async def generate(self) -> None:
        turn = Turn(self.chat, self.loaded, self.settings, question=self.chat.messages[-1])
        turn.widget = AnswerBubble(colours=self.colours, mask_timings=self.mask_timings)
        box = self.query_one("#messages")
        await box.mount(turn.widget)
        box.scroll_end(animate=False)
        self.turn = turn
        self.chat.system, self.chat.model = self.settings.system_prompt, self.loaded.id
        self.set_status("generating…")
        history = [{"role": m.role, "content": m.content} for m in self.chat.messages]
        self.submit(self._generate_job, turn, history, self.prompt_cache)

    def _generate_job(self, turn: Turn, history: list, prompt_cache) -> None:
        """Runs on the engine thread."""
        from mlx_dflash import stream_generate

        lm, s = turn.loaded, turn.settings
        reason, pieces, r, err = "stopped", [], None, None
        t0 = last = time.perf_counter()
        try:
            prompt = build_prompt(lm.tokenizer, s.system_prompt, history)
            gen = stream_generate(lm.model, lm.tokenizer, prompt, lm.drafter, prompt_cache=prompt_cache,
                                  **s.generation_kwargs())
            try:
                while not turn.cancel.is_set():
                    r = next(gen, None)
                    if r is None:
                        break
                    if turn.ttft is None:
                        turn.ttft = time.perf_counter() - t0
                    if r.text:
                        pieces.append((r.text, r.from_draft))
                    if r.finish_reason:
                        reason = r.finish_reason
                        break
                    now = time.perf_counter()
                    if pieces and now - last >= self.flush_s:
                        self.post_message(Tokens(turn, pieces, self._stats(r.stats, turn)))
                        pieces, last = [], now
            finally:
                gen.close()  # stops the engine at once, leaving the prompt cache consistent
        except Exception as e:  # bad settings for this model and the like: one line in the chat
            reason, err = "error", _one_line(e)
            if prompt_cache is not None:  # a failure mid-prefill may leave it half-written
                prompt_cache.target, prompt_cache.drafter, prompt_cache.tokens = None, None, []
        stats = self._stats(r.stats, turn) if r is not None else {"ttft": turn.ttft}
        if pieces:
            self.post_message(Tokens(turn, pieces, stats))
        self.post_message(Finished(turn, reason, stats, err))

    @staticmethod
    def _stats(st, turn: Turn) -> dict:
        d = st.to_dict()
        keep = ("mode", "fallback", "block_size", "prompt_tokens", "reused_tokens", "generation_tokens",
                "cycles", "drafted", "accepted", "tau", "acceptance_rate", "generation_tps", "prompt_tps",
                "prompt_time", "generation_time", "peak_memory")
        out = {k: d[k] for k in keep if k in d}
        out["ttft"] = turn.ttft
        return out

    async def on_tokens(self, m: Tokens) -> None:
        turn = m.turn
        text = ""
        for t, draft in m.pieces:
            turn.add(t, draft)
            text += t
        turn.batches += 1
        turn.stats = m.stats
        if turn is self.turn:
            self.last_stats = m.stats
            self.render_status()
        if turn.widget is not None and turn.widget.is_attached:
            await turn.widget.add(text, [list(s) for s in turn.spans])
            box = self.query_one("#messages")
            if box.scroll_y >= box.max_scroll_y - 3:  # follow the answer unless the user scrolled up
                box.scroll_end(animate=False)

    def on_finished(self, m: Finished) -> None:
        turn = m.turn
        stats = dict(m.stats, finish=m.reason)
        turn.stats = stats
        self.record(turn, stats)
        if turn.widget is not None and turn.widget.is_attached:
            if turn.text:
                turn.widget.finish(stats)
            else:  # nothing was written (stopped before the first token, or an error)
                turn.widget.remove()
        if turn is self.turn:
            self.turn = None
            if m.error:
                self.set_status(f"error: {m.error}")
                self.notify(m.error, severity="error", timeout=10)
            else:
                self.last_stats = stats if "mode" in stats else self.last_stats
                self.set_status("stopped" if m.reason == "stopped" else "ready")

    def record(self, turn: Turn, stats: dict) -> None:
        """Add the answer to its chat and save it (once; not if the chat was
        cleared meanwhile, as the answer would then follow no question)."""
        if turn.recorded or not turn.text:
            return
        turn.recorded = True
        if turn.chat.messages and turn.chat.messages[-1] is turn.question:
            turn.chat.messages.append(ChatMessage("assistant", turn.text, [list(s) for s in turn.spans], stats))
            self.save_chat(turn.chat)

    def action_stop(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()
            self.set_status("stopping…")

    async def action_regenerate(self) -> None:
        if self.turn is not None:
            self.notify("an answer is still being written; Esc stops it", severity="warning")
            return
        if self.loaded is None:
            self.notify(f"no model loaded ({self.status})", severity="warning")
            return
        msgs = self.chat.messages
        if msgs and msgs[-1].role == "assistant":
            msgs.pop()
            answers = self.query(AnswerBubble)
            if answers:
                await answers.last().remove()
        if not msgs or msgs[-1].role != "user":
            self.notify("nothing to regenerate: send a message first", severity="warning")
            return
        await self.generate()

    def action_copy_last(self) -> None:
        last = next((m.content for m in reversed(self.chat.messages) if m.role == "assistant"), None)
        if last is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(last)
        self.notify(f"copied the last answer ({len(last)} characters)")

    async def action_toggle_colours(self) -> None:
        self.colours = not self.colours
        for w in self.query(AnswerBubble):
            await w.set_colours(self.colours)
        self.render_status()
