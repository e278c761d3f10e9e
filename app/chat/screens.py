"""The chat's modal screens: a list to pick from (chats, models), a yes/no
question, a one-line text prompt, and the help screen."""

from __future__ import annotations

from typing import Callable, Optional

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option


class ListScreen(ModalScreen):
    """Pick one of `options` [(id, label)]; dismisses with the id or None.
    With `delete` (id -> None) and `rename` ((id, text) -> new label) the list can
    also delete (after asking) and rename its entries."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close"),
                Binding("d,delete", "delete", "Delete", show=False),
                Binding("r,f2", "rename", "Rename", show=False)]

    def __init__(self, title: str, options: list, current=None, empty: str = "nothing here",
                 delete: Optional[Callable] = None, rename: Optional[Callable] = None,
                 titles: Optional[dict] = None):
        super().__init__(classes="picker")
        self.title_text, self.options, self.current, self.empty = title, list(options), current, empty
        self._delete, self._rename, self.titles = delete, rename, titles or {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="title")
            yield OptionList(*[Option(lbl, id=i) for i, lbl in self.options])
            yield Label(self.empty, classes="empty")
            hint = "Enter open" + (" · d delete" if self._delete else "") + (" · r rename" if self._rename else "")
            yield Label(hint + " · Esc close", classes="hint")

    def on_mount(self) -> None:
        self._show_empty()
        if self.options:
            ol = self.query_one(OptionList)
            ids = [i for i, _ in self.options]
            ol.highlighted = ids.index(self.current) if self.current in ids else 0
            ol.focus()

    def _show_empty(self) -> None:
        self.query_one(OptionList).display = bool(self.options)
        self.query_one(".empty").display = not self.options

    def _highlighted(self) -> Optional[str]:
        ol = self.query_one(OptionList)
        if not self.options or ol.highlighted is None:
            return None
        return ol.get_option_at_index(ol.highlighted).id

    @on(OptionList.OptionSelected)
    def _picked(self, event) -> None:
        self.dismiss(event.option.id)

    def action_delete(self) -> None:
        oid = self._highlighted()
        if self._delete is None or oid is None:
            return
        label = dict(self.options)[oid]

        def answered(yes) -> None:
            if not yes:
                return
            self._delete(oid)
            self.options = [(i, lbl) for i, lbl in self.options if i != oid]
            self.query_one(OptionList).remove_option(oid)
            self._show_empty()

        self.app.push_screen(ConfirmScreen(f"Delete this chat?\n{label}", "Delete"), answered)

    def action_rename(self) -> None:
        oid = self._highlighted()
        if self._rename is None or oid is None:
            return

        def answered(text) -> None:
            if text is None or not text.strip():
                return
            label = self._rename(oid, text.strip())
            self.titles[oid] = text.strip()
            self.options = [(i, label if i == oid else lbl) for i, lbl in self.options]
            self.query_one(OptionList).replace_option_prompt(oid, label)

        self.app.push_screen(PromptScreen("Rename chat", self.titles.get(oid, "")), answered)


class ConfirmScreen(ModalScreen):
    """A yes/no question; dismisses with True (y, Enter on the button) or False (n, Esc)."""

    BINDINGS = [Binding("escape,n", "dismiss(False)", "No"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str, yes: str = "Yes"):
        super().__init__(classes="confirm")
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="title", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes", compact=True)
                yield Button("Keep (n)", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone does not erase

    @on(Button.Pressed)
    def _pressed(self, event) -> None:
        self.dismiss(event.button.id == "yes")


class PromptScreen(ModalScreen):
    """One line of text; dismisses with it (Enter) or None (Esc)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = ""):
        super().__init__(classes="prompt")
        self.title_text, self.value = title, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="title")
            yield Input(self.value, compact=True, id="text")
            yield Label("Enter save · Esc cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event) -> None:
        self.dismiss(event.value)


KEYS = [
    ("Enter", "send the message"),
    ("ctrl+j", "new line in the message (shift+enter where the terminal reports it)"),
    ("Esc", "stop the answer being written"),
    ("ctrl+r", "write the last answer again"),
    ("ctrl+y", "copy the last answer"),
    ("ctrl+t", "colour each token: green drafted and accepted, blue the target's own"),
    ("ctrl+s", "settings of this model (DFlash, verify width, sampling, system prompt)"),
    ("ctrl+o", "switch model"),
    ("ctrl+b", "saved chats: open, d delete, r rename"),
    ("ctrl+n", "new chat"),
    ("ctrl+l", "erase this chat (asks first)"),
    ("F1 / ?", "this help, with the model's details and the policy's reason (? when the message box is empty)"),
    ("ctrl+q", "quit (the chat is saved); ctrl+c does not quit, it points here"),
]

TERMS = [
    ("DFlash on w5", "speculative decoding on, verify width 5; '(plain now)': the policy runs plain decoding "
                     "for now, as drafting would not pay (its reason is under Now)"),
    ("f32, bf16", "the compute dtype (auto picks the faster here; settings: dtype)"),
    ("tau", "tokens each verify step of the target emits (accepted drafts + 1 of its own); higher is faster"),
    ("accepted", "share of the drafter's proposed tokens the target agreed with; the answer is the same either way"),
    ("verify width", "w: tokens the target checks per step (the anchor + w-1 drafts); set in ctrl+s"),
    ("cached", "prompt tokens reused from the previous turn's KV cache instead of computed again (cached n/total)"),
    ("tok/s", "answer tokens per second after the first; TTFT is the time to the first token"),
]


class HelpScreen(ModalScreen):
    """Keys and what the numbers mean; scrolls in a small terminal."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "dismiss(None)", "Close")]

    def __init__(self, details=None):
        super().__init__(classes="help")
        self.details = list(details or [])  # (label, text): the loaded model, the policy's reason

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Help · mlx-dflash chat", classes="title")
            with VerticalScroll(classes="form", id="help-body"):
                if self.details:
                    yield Label("Now", classes="section")
                    for k, what in self.details:
                        with Horizontal(classes="row"):
                            yield Label(k, classes="key")
                            yield Static(what, classes="what", markup=False)
                yield Label("Keys", classes="section")
                for k, what in KEYS:
                    with Horizontal(classes="row"):
                        yield Label(k, classes="key")
                        yield Static(what, classes="what", markup=False)
                yield Label("The numbers", classes="section")
                for k, what in TERMS:
                    with Horizontal(classes="row"):
                        yield Label(k, classes="key")
                        yield Static(what, classes="what", markup=False)
            yield Label("Esc close · arrows scroll", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#help-body").focus()
