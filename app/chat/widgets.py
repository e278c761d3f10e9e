"""The chat's widgets: the input, the message bubbles, the status bar's text."""

from __future__ import annotations

import re
from pathlib import Path

from rich.markup import escape
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

DRAFT_STYLE = "#7ee787"  # accepted draft tokens
TARGET_STYLE = "#79c0ff"  # the target's own tokens (first token, bonus tokens, plain decoding)


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


def drafter_label(loaded, settings) -> str:
    d = loaded.drafter if loaded is not None else None
    if d is None:
        return "no drafter"
    name = getattr(loaded, "drafter_id", None) or settings.drafter or ""
    if Path(str(name)).is_dir():  # a folder path: its name is enough
        name = Path(str(name)).name
    bits = f", {settings.drafter_quant_bits}-bit" if settings.drafter_quant_bits else ""
    return f"{name or 'drafter'} (v{d.version}, b{d.block_size}{bits})"


def status_markup(loaded, settings, stats: dict, status: str, colours: bool, mask_timings: bool) -> str:
    """The status bar: model + drafter, DFlash state (and the speculation policy's
    reason when the engine gives one), speed, tau, acceptance, what is happening.
    It wraps onto a second line in a narrow terminal rather than being cut."""
    parts = []
    if loaded is not None:
        parts.append(f"[b]{escape(loaded.id)}[/b] + {escape(drafter_label(loaded, settings))}")
        s = stats
        if loaded.drafter is None or not settings.dflash_enabled or settings.verify_mode == "off":
            parts.append("DFlash [b]off[/b]")
        elif s.get("fallback"):
            parts.append(f"DFlash [b yellow]fallback[/]: {escape(s['fallback'])}")
        else:
            mode = "" if settings.verify_mode == "dflash" else f"{settings.verify_mode}, "
            parts.append(f"DFlash [b green]on[/] ({mode}w {settings.block_size})")
        if s.get("policy"):  # why the speculation policy chose what it did (GenerationStats.policy)
            why = str(s["policy"])
            if mask_timings:  # its figures are measured: vary run to run
                why = re.sub(r"\d+(\.\d+)?", "–", why)
            parts.append(f"policy: {escape(why if len(why) <= 48 else why[:47] + '…')}")
        if s:
            tps = "–" if mask_timings else f"{s.get('generation_tps', 0.0):.1f}"
            parts.append(f"{tps} tok/s")
            if s.get("mode") == "dflash":
                parts.append(f"tau {s.get('tau', 0.0):.2f} · accept {s.get('acceptance_rate', 0.0):.0%}")
    if status:
        parts.append(f"[b red]{escape(status)}[/]" if status.startswith("error:") else escape(status))
    if colours:
        parts.append(f"[{DRAFT_STYLE}]■ draft[/] [{TARGET_STYLE}]■ target[/]")
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
