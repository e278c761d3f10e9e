"""The settings panel: the loaded model's settings, validated by the settings
store (messages under the field they concern), saved through the model manager."""

from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static, TextArea

from .engine import one_line

# field, label, kind
SETTINGS_FIELDS = [
    ("dflash_enabled", "DFlash", "switch"),
    ("guard", "Guard (picks width)", "switch"),
    ("block_size", "Fixed width (guard off)", "int"),
    ("verify_mode", "Verify mode", "mode"),
    ("drafter_quant_bits", "Quantized drafter", "quant"),
    ("dtype", "Compute dtype", "dtype"),
    ("temperature", "Temperature", "float"),
    ("top_p", "Top p", "float"),
    ("top_k", "Top k (0 = off)", "int"),
    ("min_p", "Min p", "float"),
    ("max_tokens", "Max tokens", "int"),
    ("system_prompt", "System prompt", "text"),
    ("tool_grammar", "Tool-call grammar (serve)", "switch"),
]
QUANT_OPTIONS = [("auto", "auto"), ("full precision", "none"), ("8-bit", "8"), ("4-bit", "4")]


class SettingsScreen(ModalScreen):
    """Edits the model's settings; Save stores them through the model manager
    (validation messages inline) and dismisses with the new ModelSettings."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, model_id: str, settings, save, max_block: Optional[int] = None,
                 resolved: Optional[dict] = None):
        super().__init__(classes="settings")
        self.model_id, self.settings, self._save, self.max_block = model_id, settings, save, max_block
        self.resolved = resolved or {}  # field -> what its "auto" is on this machine ("float32")

    def _auto_label(self, name: str) -> str:
        r = self.resolved.get(name)
        return f"auto ({r} here)" if r else "auto"

    def compose(self) -> ComposeResult:
        from mlx_dflash.settings.schema import COMPUTE_DTYPES, verify_modes

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
                        elif kind in ("mode", "dtype"):
                            choices = verify_modes() if kind == "mode" else COMPUTE_DTYPES
                            yield Select([(self._auto_label(name) if m == "auto" and kind == "dtype" else m, m)
                                          for m in choices], value=v, allow_blank=False,
                                         compact=True, id=f"f-{name}")
                        elif kind == "quant":
                            opts = [(self._auto_label(name) if val == "auto" else lbl, val) for lbl, val in QUANT_OPTIONS]
                            yield Select(opts, value="none" if v is None else str(v), allow_blank=False,
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
                yield Label("Tab next · ^s save · Esc cancel", classes="hint")

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
            elif kind in ("mode", "dtype"):
                v = w.value
            elif kind == "quant":
                v = None if w.value == "none" else ("auto" if w.value == "auto" else int(w.value))
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
        from mlx_dflash.settings.schema import MODEL_KEYS, SettingsError

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
            msg = one_line(e)
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
