"""Driving `mlx-dflash chat` (the Textual app) with Pilot in tests: the app on the
`chat_backend` fixture's model manager (tests/conftest.py: a small random pair
registered as a model folder, so the app loads it as a user would), and the steps
tests repeat."""

import asyncio
import time

from app.chat import ChatApp, ManagerBackend
from app.chat.history import HistoryStore

SIZE = (80, 24)  # the smallest common terminal: everything must fit and work here


class FolderBackend(ManagerBackend):
    """The model manager, listing only the registered folder (the embedded pair,
    if present in this checkout, would make the switcher snapshot vary)."""

    def targets(self):
        return [e for e in super().targets() if e.source == "folder"]


def make_app(backend, tmp_path, **kw):
    kw.setdefault("flush_s", 0.0)  # post every token: streaming is visible even for short answers
    return ChatApp("target", backend=backend, history=HistoryStore(tmp_path / "chats"), **kw)


def drive(backend, tmp_path, body, size=SIZE, notifications=False, **kw):
    """Run `await body(app, pilot)` in a chat app at `size` once its model is loaded
    (toasts drawn with `notifications`); returns what body returns."""
    async def go():
        app = make_app(backend, tmp_path, **kw)
        async with app.run_test(size=size, notifications=notifications) as pilot:
            await ready(pilot)
            return await body(app, pilot)

    return asyncio.run(go())


async def until(pilot, cond, what, limit=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"gave up waiting for {what} (status: {pilot.app.status})"
        await pilot.pause(0.02)


async def ready(pilot):
    app = pilot.app
    await until(pilot, lambda: app.loaded is not None or "error" in app.status, "the model to load")
    assert app.loaded is not None, app.status


async def say(pilot, text):
    app = pilot.app
    n = len(app.chat.messages)
    await pilot.press(*text)
    await pilot.press("enter")
    await until(pilot, lambda: app.turn is None and len(app.chat.messages) >= n + 2, "the answer")
    return app.chat.messages[-1]


async def start(pilot, text, batches, what="the answer to start"):
    """Send `text` and wait until its answer has streamed `batches` batches (still going)."""
    app = pilot.app
    await pilot.press(*text)
    await pilot.press("enter")
    await until(pilot, lambda: app.turn is not None and app.turn.batches >= batches, what)


async def press_until(pilot, key, cond, what):
    await pilot.press(key)
    await until(pilot, cond, what)


async def press_for(pilot, key, screen, what):
    """Press `key` and wait for the screen of class `screen` it opens."""
    await press_until(pilot, key, lambda: isinstance(pilot.app.screen, screen), what)


async def press_to_close(pilot, key, screen):
    """Press `key` (save, ...) and wait for the screen of class `screen` to close."""
    await press_until(pilot, key, lambda: not isinstance(pilot.app.screen, screen), "the panel to close")


def screen_lines(app) -> list:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def status_text(app) -> str:
    r = app.query_one("#status").render()
    return r.plain if hasattr(r, "plain") else str(r)


def squeeze(text: str) -> str:
    return "".join(text.split())
