"""The chat's widgets: the input, the message bubbles, the status bar's text."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from mlx_dflash.engine.stats import width_text
from mlx_dflash.models.drafter_precision import quant_label

DRAFT_STYLE = "#7ee787"  # accepted draft tokens
TARGET_STYLE = "#79c0ff"  # the target's own tokens (first token, bonus tokens, plain decoding)


def spans_text(spans) -> Text:
    t = Text()
    for s, draft in spans:
        t.append(s, style=DRAFT_STYLE if draft else TARGET_STYLE)
    return t


def cached_label(stats: dict, mask_timings: bool = False) -> str:
    """"cached N/M", and where from when it was the disk (with its load time)."""
    c = f"cached {stats.get('reused_tokens', 0)}/{stats['prompt_tokens']}"
    src = stats.get("prompt_cache") or {}
    if src.get("tier") == "disk":
        c += " from disk" + ("" if mask_timings else f" in {src.get('load_ms', 0) / 1000:.2f} s")
    return c


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
        parts.append(cached_label(stats, mask_timings))
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
    qb = getattr(loaded, "quant_bits", None)
    bits = f", {qb}-bit" if qb else ""
    return f"{name or 'drafter'} (v{d.version}, b{d.block_size}{bits})"


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:max(0, n - 1)] + "…"


def width_label(settings, drafter, s: dict) -> str:
    """stats.width_text for the last answer (`s`), or before one from the settings."""
    if s.get("max_width"):
        return width_text(bool(s.get("guard")), s["max_width"], s.get("width") or 0)
    return width_text(settings.guard, drafter.block_size if settings.guard else settings.block_size)


def status_parts(loaded, settings, stats: dict, status: str, colours: bool, mask_timings: bool) -> list:
    """The status bar's fields in order: (priority, markup, plain text). Lower
    priorities are dropped first when the line does not fit."""
    parts = []
    s = stats or {}
    if loaded is not None:
        parts.append((5, f"[b]{escape(loaded.id)}[/b]", loaded.id))
        if loaded.drafter is None or not settings.dflash_enabled or settings.verify_mode == "off":
            parts.append((0, "DFlash [b]off[/b]", "DFlash off"))
        elif s.get("fallback"):
            parts.append((0, "DFlash [b yellow]fallback[/]", "DFlash fallback"))
        else:
            w = width_label(settings, loaded.drafter, s)
            parts.append((0, f"DFlash [b green]on[/] {w}", f"DFlash on {w}"))
        if s:
            if s.get("mode") == "dflash":
                t = f"tau {s.get('tau', 0.0):.2f}"
                parts.append((1, t, t))
            tps = "–" if mask_timings else f"{s.get('generation_tps', 0.0):.1f}"
            parts.append((1, f"{tps} tok/s", f"{tps} tok/s"))
            if s.get("prompt_tokens"):
                c = cached_label(s, mask_timings)
                parts.append((3, c, c))
        dt = getattr(loaded, "dtype", None)
        if dt is not None:
            parts.append((4, dt.short(), dt.short()))
    if status:
        parts.append((0, f"[b red]{escape(status)}[/]" if status.startswith("error:") else escape(status), status))
    if colours:
        parts.append((2, f"[{DRAFT_STYLE}]■ draft[/] [{TARGET_STYLE}]■ target[/]", "■ draft ■ target"))
    return parts


SEP = " · "


def status_markup(loaded, settings, stats: dict, status: str, colours: bool, mask_timings: bool,
                  width: int = 0) -> str:
    """The status bar, one line of short fields: DFlash state and verify width,
    tau, speed, cached prompt tokens, compute dtype, what is happening. Fields are
    dropped, least useful first, until it fits `width` columns (0: no limit); the
    policy's reason and the rest are in the help screen (details_rows)."""
    parts = status_parts(loaded, settings, stats, status, colours, mask_timings)
    if width > 0:
        while len(parts) > 1 and len(SEP.join(p[2] for p in parts)) > width:
            drop = max(range(len(parts)), key=lambda i: (parts[i][0], i))
            if parts[drop][0] == 0:
                break
            parts.pop(drop)
        over = len(SEP.join(p[2] for p in parts)) - width
        if over > 0:  # a long error or loading message: cut the text, the toast shows it whole
            pr, _, plain = parts[-1]
            short = _cut(plain, max(4, len(plain) - over))
            parts[-1] = (pr, f"[b red]{escape(short)}[/]" if plain.startswith("error:") else escape(short), short)
    return SEP.join(p[1] for p in parts)


def details_rows(loaded, settings, stats: dict) -> list:
    """(label, text) rows for the help screen's "Now" section: what the status bar
    abbreviates, and the speculation policy's full reason."""
    if loaded is None:
        return [("model", "none loaded yet")]
    rows = [("model", loaded.id), ("drafter", drafter_label(loaded, settings))]
    dt = getattr(loaded, "dtype", None)
    if dt is not None:
        rows.append(("compute dtype", f"{dt.name} ({dt.why})"))
    if loaded.drafter is not None:
        why = getattr(loaded, "quant_why", "")
        rows.append(("drafter weights", quant_label(getattr(loaded, "quant_bits", None)) + (f" ({why})" if why else "")))
    s = stats or {}
    if s.get("policy"):
        rows.append(("policy", str(s["policy"])))
    if s.get("fallback"):
        rows.append(("fallback", str(s["fallback"])))
    if s:
        rows.append(("last answer", summary_line(s)))
    return rows


def resolved_auto(loaded) -> dict:
    """Settings field -> what its `auto` resolved to for the loaded model."""
    if loaded is None:
        return {}
    out = {}
    dt = getattr(loaded, "dtype", None)
    if dt is not None:
        out["dtype"] = dt.name
    if getattr(loaded, "drafter", None) is not None:
        out["drafter_quant_bits"] = quant_label(getattr(loaded, "quant_bits", None))
    return out


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
        if event.key == "question_mark" and not self.text:  # an empty box: `?` asks for help
            event.stop()
            event.prevent_default()
            await self.run_action("app.help")
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

    async def rendered(self) -> None:
        """Once mounted: the answer's Markdown rendered now (Markdown renders its text
        after its first refresh), so its height is known."""
        if not self.colours:
            await self.query_one(".md", Markdown).update(self.text)

    async def add(self, text: str, spans: list) -> None:
        self.spans = spans
        self.updates += 1
        self.text += text
        if not self._parts():  # being removed (the chat was cleared mid-answer)
            return
        if self.colours:
            self.query_one(".spans", Static).update(spans_text(spans))
        elif text:
            await self.query_one(".md", Markdown).append(text)

    def _parts(self) -> bool:
        return bool(self.query(".md")) and bool(self.query(".summary"))

    async def finish(self, stats: dict) -> None:
        self.stats = stats
        if not self._parts():
            return
        self.query_one(".summary", Static).update(summary_line(stats, self.mask_timings))
        if not self.colours:  # the whole answer parsed once, as a reopened chat draws it (append parses in pieces)
            await self.query_one(".md", Markdown).update(self.text)

    async def set_colours(self, on: bool) -> None:
        self.colours = on
        self.set_class(on, "-colours")
        if on:
            self.query_one(".spans", Static).update(spans_text(self.spans))
        else:
            await self.query_one(".md", Markdown).update(self.text)
