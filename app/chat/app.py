"""The chat app: layout, key bindings, and what each action does.

All MLX work (loading, generation) runs on one engine thread: MLX streams are
thread-local, and the engine runs one generation at a time per model. The
engine thread posts token batches to the UI as messages, so the UI never
blocks; Esc sets a flag the engine checks after every token (and after every
chunk of a long prompt's prefill, whose progress the status bar shows) and
closes the generator. One prompt store is kept for the loaded model (engine.prompt_store:
memory, then disk): a follow-up turn only prefills what is new since the last one,
switching chats, regenerating or clearing is handled by the engine trimming the
cache to the common prefix, and a new start of the app finds its prompts on disk."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import Footer, Static

from .engine import (RELOAD_KEYS, Finished, Loaded, ManagerBackend, Prefill, Tokens, Turn, costs_at_load, generate_job,
                     one_line, prompt_store)
from .history import Chat, HistoryStore
from .history import Message as ChatMessage
from .screens import ConfirmScreen, HelpScreen, ListScreen
from .settings_panel import SettingsScreen
from .widgets import AnswerBubble, ChatInput, UserBubble, details_rows, resolved_auto, status_markup


class ChatApp(App):
    TITLE = "mlx-dflash chat"
    CSS_PATH = "chat.tcss"
    ENABLE_COMMAND_PALETTE = False
    # the footer shows the keys that fit 80 columns; F1 lists them all
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),  # only when the input does not take it
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "switch_model", "Model"),
        Binding("ctrl+b", "chats", "Chats"),  # ctrl+h is backspace in most terminals
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+l", "clear", "Clear", show=False),
        Binding("ctrl+r", "regenerate", "Regen", show=False),
        Binding("ctrl+y", "copy_last", "Copy", priority=True, show=False),  # TextArea uses ctrl+y for redo
        Binding("ctrl+t", "toggle_colours", "Colours", show=False),
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
        self.prompt_store = None  # the loaded model's (engine.prompt_store)
        self.reopen_last = reopen_last
        self.chat = Chat()
        self.warned_acceptance = False  # the low-acceptance warning, once per loaded model
        self.opened = False  # a chat was just opened: keep it at its end while it is laid out
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="mlx-dflash-engine")

    # -- layout --
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="messages")
        yield ChatInput(id="input", compact=True, placeholder="Message (Enter sends, ctrl+j newline, ? or F1 help)")
        yield Static(id="status")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        chats, notices = self.history.list()
        for n in notices:
            self.notify(n, severity="warning", timeout=8)
        if self.reopen_last and chats:
            self.call_after_refresh(self.open_chat, chats[0])
        self.query_one("#input").focus()
        self.watch(self.query_one("#messages"), "virtual_size", self._opened_layout, init=False)
        self.load(self.model_id)

    def _opened_layout(self, size) -> None:
        """A chat just opened grows as its answers' Markdown is laid out: stay at its end."""
        if self.opened:
            self.query_one("#messages").scroll_end(animate=False)

    def on_unmount(self) -> None:
        turn = self.turn
        if turn is not None:  # quitting mid-answer: keep what was written so far
            turn.cancel.set()
            self.record(turn, dict(turn.stats, finish="stopped"))
        self._engine.shutdown(wait=False, cancel_futures=True)
        if self.prompt_store is not None:  # the last turn's prefix, still being written to disk
            self.prompt_store.close(timeout=10)

    def submit(self, fn, *args) -> None:
        """Run `fn` on the engine thread (in this app's context, so it can post messages)."""
        self._engine.submit(contextvars.copy_context().run, fn, *args)

    def render_status(self) -> None:
        try:
            bar = self.query_one("#status", Static)
        except NoMatches:  # the app is shutting down mid-answer: no screen to update
            return
        width = max(0, (bar.size.width or self.size.width) - 2)  # its padding: one column each side
        bar.update(status_markup(self.loaded, self.settings, self.last_stats, self.status, self.colours,
                                 self.mask_timings, width))

    def on_resize(self, event) -> None:
        self.call_after_refresh(self.render_status)

    def set_status(self, text: str) -> None:
        self.status = text
        self.render_status()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(details_rows(self.loaded, self.settings, self.last_stats)))

    # -- loading --
    def load(self, model_id) -> None:
        self.loaded, self.settings, self.prompt_store = None, None, None
        self.set_status(f"loading {model_id or 'the default model'}…")

        def job():
            try:
                lm = self.backend.load(model_id)
                store = prompt_store(self.backend, lm)  # (on this thread: it reads the weights)
                costs_at_load(lm)
            except Exception as e:  # every load error is shown as one line
                self.post_message(Loaded(model_id, error=one_line(e)))
            else:
                self.post_message(Loaded(model_id, lm, store=store))

        self.submit(job)

    def on_loaded(self, m: Loaded) -> None:
        if m.error:
            self.set_status(f"error: {m.error}")
            self.notify(m.error, severity="error", timeout=10)
            return
        self.loaded, self.model_id = m.loaded, m.loaded.id
        self.settings = m.loaded.settings
        self.prompt_store = m.store  # a new model: nothing cached for another is valid
        self.last_stats = {}
        self.warned_acceptance = False
        self.set_status("ready")
        for n in getattr(m.loaded, "notices", None) or []:
            self.notify(n, severity="warning", timeout=8)
        said = getattr(m.loaded, "dtype_notice", None)
        if said and said():  # `dtype auto` measured at this load: once, as a note
            self.notify(said(), timeout=8)

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
        for w in widgets:  # laid out now: Markdown renders after its mount, and a scroll before it stops at the top
            if isinstance(w, AnswerBubble):
                await w.rendered()
        self.opened = True  # kept at the end while the layout settles (_opened_layout), until the next message
        box.scroll_end(animate=False)
        self.sub_title = chat.title

    def _stop_turn(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()

    async def action_new_chat(self) -> None:
        self._stop_turn()
        await self.open_chat(Chat())
        self.last_stats = {}  # the previous chat's speed and policy say nothing of this one
        self.set_status("ready" if self.loaded is not None else self.status)

    def action_clear(self) -> None:
        if not self.chat.messages:
            return

        async def answered(yes) -> None:
            if yes:
                await self.clear_chat()

        n = len(self.chat.messages)
        self.push_screen(ConfirmScreen(f"Erase the {n} message{'s' if n != 1 else ''} of this chat? "
                                       "The saved chat is erased too.", "Erase"), answered)

    async def clear_chat(self) -> None:
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

    @staticmethod
    def chat_label(c: Chat) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
        return f"{when}  {c.title or '(empty)'}  [{len(c.messages)} msgs]"

    def action_chats(self) -> None:
        chats, notices = self.history.list()
        for n in notices:
            self.notify(n, severity="warning")
        by_id = {c.id: c for c in chats}

        async def picked(chat_id) -> None:
            if chat_id and chat_id in by_id and chat_id != self.chat.id:
                self._stop_turn()
                await self.open_chat(by_id[chat_id])

        def delete(chat_id) -> None:
            try:
                self.history.delete(chat_id)
            except OSError as e:
                self.notify(f"could not delete the chat: {e.strerror}", severity="error")
                return
            if chat_id == self.chat.id:  # the open chat is gone: continue in a new one
                self._stop_turn()
                self.call_later(self.open_chat, Chat())

        def rename(chat_id, title) -> str:
            c = self.chat if chat_id == self.chat.id else by_id[chat_id]
            c.title = title
            try:
                self.history.save(c, touch=False)
            except OSError as e:
                self.notify(f"could not rename the chat: {e.strerror}", severity="error")
            if c is self.chat:
                self.sub_title = title
            return self.chat_label(c)

        self.push_screen(ListScreen("Chats", [(c.id, self.chat_label(c)) for c in chats], self.chat.id,
                                    empty="no saved chats yet", delete=delete, rename=rename,
                                    titles={c.id: c.title for c in chats}), picked)

    # -- models and settings --
    def action_switch_model(self) -> None:
        try:
            entries = self.backend.targets()
        except Exception as e:
            self.notify(one_line(e), severity="error")
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
                                        d.block_size if d is not None else None, resolved_auto(self.loaded)), done)

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
        self.opened = False
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
        self.submit(generate_job, self.post_message, self.flush_s, turn, history, self.prompt_store)

    def _check_acceptance(self, turn: Turn, stats: dict) -> None:
        """At the end of a turn: a drafter is judged on a whole answer, not its start
        (the first drafts of an answer are often rejected by a drafter that works)."""
        from mlx_dflash.models.manager import acceptance_warning

        if self.warned_acceptance or turn.loaded is not self.loaded:
            return
        why = acceptance_warning(stats, getattr(turn.loaded, "drafter_id", None))
        if why:
            self.warned_acceptance = True
            self.notify(why, severity="warning", timeout=12)

    def on_prefill(self, m: Prefill) -> None:
        if m.turn is self.turn and not m.turn.cancel.is_set():
            self.set_status(f"prefill {m.done}/{m.total} tokens… (Esc stops)" if m.done < m.total else "generating…")

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

    async def on_finished(self, m: Finished) -> None:
        turn = m.turn
        stats = dict(m.stats, finish=m.reason)
        turn.stats = stats
        self.record(turn, stats)
        if turn.widget is not None and turn.widget.is_attached:
            if turn.text:
                await turn.widget.finish(stats)
            else:  # nothing was written (stopped before the first token, or an error)
                turn.widget.remove()
        if turn is self.turn:
            self.turn = None
            if m.error:
                self.set_status(f"error: {m.error}")
                self.notify(m.error, severity="error", timeout=10)
            else:
                self.last_stats = stats if "mode" in stats else self.last_stats
                self._check_acceptance(turn, stats)
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
