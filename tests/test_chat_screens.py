"""`mlx-dflash chat`'s panels and dialogs, driven with Pilot at 80x24: the settings
panel (validation, saving, applying), the model switcher, the status bar, help,
clearing and the chat list (tests/chat_pilot.py: the pair and the steps)."""

import json
from pathlib import Path

import pytest
from chat_pilot import SIZE, drive, press_for, press_to_close, say, screen_lines, status_text, until

from app.chat import SettingsScreen, build_prompt
from app.chat.screens import ConfirmScreen, HelpScreen, ListScreen, PromptScreen
from app.chat.history import Chat, HistoryStore
from app.chat.history import Message as ChatMessage


async def open_settings(pilot):
    await press_for(pilot, "ctrl+s", SettingsScreen, "the settings panel")


async def save_settings(pilot):
    await press_to_close(pilot, "ctrl+s", SettingsScreen)


@pytest.mark.slow
def test_settings_panel_validates_saves_and_applies(chat_backend, tmp_path):
    async def body(app, pilot):
        await open_settings(pilot)
        scr = app.screen
        # a bad value: inline message, nothing saved, the panel stays open
        scr.query_one("#f-block_size").value = "abc"
        scr.query_one("#f-top_p").value = "2"
        err = lambda k: str(scr.query_one(f"#err-{k}").render())  # noqa: E731
        await pilot.pause()  # the fields' Changed events (which hide old messages) come first
        await pilot.click("#save")
        await until(pilot, lambda: "integer" in err("block_size"), "the inline message")
        assert app.screen is scr
        assert scr.query_one("#err-block_size").display
        scr.query_one("#f-block_size").value = "99"  # above the drafter's trained block size
        await until(pilot, lambda: not scr.query_one("#err-block_size").display, "the edit to hide it")
        # the key, not a click: the shown messages moved the button, and a click under
        # load can land where it was (CI saw that once)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: "at most 16" in err("block_size"), "the inline message")
        scr.query_one("#f-block_size").value = "3"
        await pilot.pause()
        await pilot.press("ctrl+s")  # top_p = 2 is refused by the settings store
        await until(pilot, lambda: "top_p" in err("top_p"), "the store's message")
        assert app.screen is scr
        assert not scr.query_one("#err-block_size").display
        assert chat_backend.store.model("target").block_size == 5
        # good values: saved through the model manager, applied to the next message
        scr.query_one("#f-top_p").value = "1.0"
        scr.query_one("#f-max_tokens").value = "7"
        scr.query_one("#f-dflash_enabled").value = False
        scr.query_one("#f-guard").value = False  # block size 3 is then every cycle's width
        scr.query_one("#f-system_prompt").text = "Be brief."
        await save_settings(pilot)
        s = chat_backend.store.model("target")
        assert (s.max_tokens, s.block_size, s.dflash_enabled, s.guard, s.system_prompt) == (7, 3, False, False,
                                                                                            "Be brief.")
        answer = await say(pilot, "hi")
        assert answer.stats["generation_tokens"] == 7 and answer.stats["finish"] == "length"
        assert answer.stats["mode"] == "off"
        with_system = build_prompt(app.loaded.tokenizer, "Be brief.", [{"role": "user", "content": "hi"}])
        assert answer.stats["prompt_tokens"] == len(with_system) and app.chat.system == "Be brief."
        assert "DFlash off" in str(app.query_one("#status").render())
        # and back on, with the new verify width
        await open_settings(pilot)
        app.screen.query_one("#f-dflash_enabled").value = True
        await save_settings(pilot)
        answer = await say(pilot, "again")
        assert answer.stats["mode"] == "dflash" and answer.stats["max_width"] == 3

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_enabling_dflash_loads_the_drafter(chat_backend, tmp_path):
    chat_backend.store.set_model("target", dflash_enabled=False, max_tokens=5)

    async def body(app, pilot):
        assert app.loaded.drafter is None and "DFlash off" in str(app.query_one("#status").render())
        assert (await say(pilot, "hi")).stats["mode"] == "off"
        await open_settings(pilot)
        app.screen.query_one("#f-dflash_enabled").value = True
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.loaded is not None and app.loaded.drafter is not None, "the drafter")
        assert "DFlash on" in str(app.query_one("#status").render())
        assert (await say(pilot, "hi")).stats["mode"] == "dflash"

    drive(chat_backend, tmp_path, body)


def test_model_switcher_lists_targets_only(chat_backend, tmp_path):
    async def body(app, pilot):
        await pilot.press("ctrl+o")
        await pilot.pause()
        ol = app.screen.query_one("OptionList")
        assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == ["target"]
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]

    drive(chat_backend, tmp_path, body)


# -- 80x24: fits, help, asks before erasing, the chat list -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_status_is_one_line_that_fits_and_toasts_leave_it_alone(chat_backend, tmp_path, size):
    chat_backend.store.set_model("target", max_tokens=8)

    async def body(app, pilot):
        await say(pilot, "hello")
        await pilot.pause()
        bar = app.query_one("#status")
        text = status_text(app)
        assert "ready" in text and "DFlash on guard \u2264" in text and "tok/s" in text and "tau" in text
        assert "policy" not in text and "\n" not in text  # the reason is in the help screen
        # one line, inside the screen, above the footer, and all of its text is on that line
        assert bar.region.height == 1 and bar.region.width == size[0]
        assert len(text) <= size[0] - 2
        row = screen_lines(app)[bar.region.y]
        assert text in row, (text, row)
        assert bar.region.bottom <= size[1] - 1 and "Help" in screen_lines(app)[-1]
        # a toast (saving settings shows one) is drawn clear of the status line and the input
        app.notify("settings saved; they apply to the next message")
        await pilot.pause(0.3)
        toasts = list(app.screen.query("Toast"))  # drawn (run_test draws none unless asked)
        assert toasts
        for t in toasts:
            assert not t.region.overlaps(bar.region), (t.region, bar.region)
            assert not t.region.overlaps(app.query_one("#input").region)
        assert text in screen_lines(app)[bar.region.y]
        # a new chat starts with a status of its own: no speed or tau of the last one
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not app.chat.messages and "tok/s" not in status_text(app), "the reset")
        assert "tau" not in status_text(app) and "ready" in status_text(app)

    drive(chat_backend, tmp_path, body, size=size, notifications=True)


@pytest.mark.slow
def test_question_mark_opens_help_with_the_policy_when_the_box_is_empty(chat_backend, tmp_path):
    chat_backend.store.set_model("target", max_tokens=6)

    async def body(app, pilot):
        await say(pilot, "hi")
        box = app.query_one("#input")
        assert app.focused is box and box.text == ""
        await press_for(pilot, "question_mark", HelpScreen, "the help")
        shown = "\n".join(screen_lines(app))
        assert "Now" in shown and "policy" in shown and "compute dtype" in shown
        # the policy's whole reason is there (wrapped in its row, not cut as a status line would)
        policy = app.last_stats["policy"]
        rows = {str(w.render()) for w in app.screen.query(".what")}
        assert policy in rows and app.loaded.dtype.why in " ".join(rows)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.screen_stack[0], "the help to close")
        # with text in the box, `?` is typed
        await pilot.press("w", "h", "y", "question_mark")
        await pilot.pause()
        assert box.text == "why?" and not isinstance(app.screen, HelpScreen)

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_settings_panel_is_usable_at_80x24(chat_backend, tmp_path):
    async def body(app, pilot):
        from app.chat.settings_panel import SETTINGS_FIELDS

        await open_settings(pilot)
        await pilot.pause()
        scr = app.screen
        dialog = scr.query_one(".dialog")
        assert dialog.region.right <= SIZE[0] and dialog.region.bottom <= SIZE[1]
        lines = "\n".join(screen_lines(app))
        assert "Save" in lines and "Cancel" in lines
        # Tab reaches every field, each scrolled into view inside the panel
        seen = set()
        for _ in range(3 * len(SETTINGS_FIELDS)):
            w = app.focused
            if w is not None and (w.id or "").startswith("f-"):
                seen.add(w.id[2:])
                await pilot.pause()
                form = scr.query_one(".form")
                assert form.region.contains_region(w.region) or form.region.overlaps(w.region), w.id
            await pilot.press("tab")
        assert seen == {name for name, _, _ in SETTINGS_FIELDS}
        # and changes are saved from there; a new compute dtype loads the model again in it
        scr.query_one("#f-max_tokens").value = "9"
        scr.query_one("#f-dtype").value = "bfloat16"
        await save_settings(pilot)
        s = chat_backend.store.model("target")
        assert (s.max_tokens, s.dtype) == (9, "bfloat16")
        await until(pilot, lambda: app.loaded is not None and app.loaded.settings.dtype == "bfloat16", "the reload")
        from mlx_dflash.models.loader import model_dtype

        assert model_dtype(app.loaded.model) == "bfloat16"

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_help_screen_explains_keys_and_numbers(chat_backend, tmp_path):
    async def body(app, pilot):
        from app.chat.screens import KEYS, TERMS

        await press_for(pilot, "f1", HelpScreen, "the help")
        await pilot.pause()
        terms = dict(TERMS)
        for word in ("tau", "accepted", "verify width", "cached"):
            assert word in terms and "\n" not in terms[word]
        bound = {b.key for b in app.BINDINGS}
        for key in ("ctrl+s", "ctrl+o", "ctrl+b", "ctrl+n", "ctrl+l", "ctrl+r", "ctrl+y", "ctrl+t", "ctrl+q"):
            assert key in bound and key in dict(KEYS), key
        shown = "\n".join(screen_lines(app))
        assert "Enter" in shown and "ctrl+s" in shown
        help_body = app.screen.query_one("#help-body")
        await pilot.press("end")
        await pilot.pause()
        assert help_body.scroll_y == help_body.max_scroll_y
        assert "cached" in "\n".join(screen_lines(app))  # the last lines scrolled into view
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        app.query_one("#messages").focus()  # '?' opens it too, where it is not typed into the input
        await press_for(pilot, "question_mark", HelpScreen, "the help")

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_clear_asks_first(chat_backend, tmp_path):
    chat_backend.store.set_model("target", max_tokens=4)

    async def body(app, pilot):
        await say(pilot, "keep me")
        path = tmp_path / "chats" / f"{app.chat.id}.json"
        await press_for(pilot, "ctrl+l", ConfirmScreen, "the question")
        await pilot.press("enter")  # Enter alone keeps (the focused button is Keep)
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen) and len(app.chat.messages) == 2
        await press_for(pilot, "ctrl+l", ConfirmScreen, "the question")
        await pilot.press("n")
        await pilot.pause()
        assert len(json.loads(path.read_text())["messages"]) == 2
        await press_for(pilot, "ctrl+l", ConfirmScreen, "the question")
        await pilot.press("y")
        await until(pilot, lambda: not app.chat.messages, "the chat to clear")
        assert json.loads(path.read_text())["messages"] == []

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_chat_list_deletes_and_renames(chat_backend, tmp_path):
    chats = tmp_path / "chats"
    a = Chat(title="first", messages=[ChatMessage("user", "a")])
    b = Chat(title="second", messages=[ChatMessage("user", "b")])
    HistoryStore(chats).save(a)
    HistoryStore(chats).save(b)

    async def body(app, pilot):
        await press_for(pilot, "ctrl+b", ListScreen, "the chat list")
        await pilot.pause()
        ol = app.screen.query_one("OptionList")
        assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == [b.id, a.id]
        # rename the highlighted (newest) chat; its place in the list stays
        await press_for(pilot, "r", PromptScreen, "the rename prompt")
        app.screen.query_one("#text").value = "renamed chat"
        await press_for(pilot, "enter", ListScreen, "the list again")
        assert "renamed chat" in str(ol.get_option_at_index(0).prompt)
        assert json.loads((chats / f"{b.id}.json").read_text())["title"] == "renamed chat"
        # delete asks; "n" keeps the file
        await press_for(pilot, "d", ConfirmScreen, "the question")
        await press_for(pilot, "n", ListScreen, "the list again")
        assert (chats / f"{b.id}.json").exists()
        await press_for(pilot, "d", ConfirmScreen, "the question")
        await press_for(pilot, "y", ListScreen, "the list again")
        await pilot.pause()
        assert not (chats / f"{b.id}.json").exists() and (chats / f"{a.id}.json").exists()
        assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == [a.id]
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.id == a.id, "the remaining chat to open")

    drive(chat_backend, tmp_path, body, reopen_last=False)


@pytest.mark.slow
def test_an_answer_is_drawn_the_same_streamed_and_reopened():
    """A streamed answer (appended in pieces as the engine posts them) ends drawn
    exactly as the same text drawn at once when a saved chat is reopened: `#### 5`
    is a heading both times, `12*5` stays arithmetic, line breaks stay."""
    import asyncio
    import random

    from textual.app import App

    from app.chat.widgets import AnswerBubble

    text = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 12*5 = 60 more.\n"
            "1. April: 48\n2. May: 24\n\n```\nx = 48 + 24\n```\n#### 72")

    class Two(App):
        CSS_PATH = str(Path(__file__).resolve().parent.parent / "app" / "chat" / "chat.tcss")

        def compose(self):
            yield AnswerBubble()
            yield AnswerBubble(text, stats={"generation_tokens": 3})

    async def go():
        app = Two()
        async with app.run_test(size=(80, 60)) as pilot:
            streamed, reopened = app.query(AnswerBubble)
            rnd, i = random.Random(0), 0
            while i < len(text):
                n = rnd.randint(1, 7)
                await streamed.add(text[i:i + n], [])
                i += n
            await streamed.finish({"generation_tokens": 3})
            await pilot.pause(0.3)
            lines = screen_lines(app)

            def drawn(w):
                r = w.query_one(".md").region
                return [ln[r.x:r.right].rstrip() for ln in lines[r.y:r.bottom]]

            a, b = drawn(streamed), drawn(reopened)
            assert a == b and any(ln.strip() == "72" for ln in a) and not any("####" in ln for ln in a)
            assert any("12*5 = 60" in ln for ln in a)

    asyncio.run(go())
