"""`mlx-dflash chat`: the Textual app driven with Pilot, plus snapshots of its
screens. A small random pair is registered through the model manager (a model
folder in MLX_DFLASH_HOME's settings), so the app loads it as a user would."""

import asyncio
import json
import time

import pytest

from app.chat import DRAFT_STYLE, TARGET_STYLE, AnswerBubble, ChatApp, ManagerBackend, SettingsScreen, UserBubble, build_prompt
from app.chat.screens import ConfirmScreen, HelpScreen, ListScreen, PromptScreen
from app.chat_history import Chat, HistoryStore
from app.chat_history import Message as ChatMessage

SIZE = (80, 24)  # the smallest common terminal: everything must fit and work here


@pytest.fixture
def backend(pairs, tmp_path, monkeypatch):
    from mlx_dflash.settings import SettingsStore

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # no models from the user's cache
    store = SettingsStore()
    store.set_global(model_dirs=[str(pairs())])
    return FolderBackend(store)


class FolderBackend(ManagerBackend):
    """The model manager, listing only the registered folder (the embedded pair,
    if present in this checkout, would make the switcher snapshot vary)."""

    def targets(self):
        return [e for e in super().targets() if e.source == "folder"]


def make_app(backend, tmp_path, **kw):
    kw.setdefault("flush_s", 0.0)  # post every token: streaming is visible even for short answers
    return ChatApp("target", backend=backend, history=HistoryStore(tmp_path / "chats"), **kw)


async def until(pilot, cond, what, limit=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"gave up waiting for {what}"
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


def run(coro):
    asyncio.run(coro)


def test_send_streams_the_answer_and_saves_it(backend, tmp_path):
    backend.store.set_model("target", max_tokens=20)

    async def go():
        from mlx_dflash import generate

        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.loaded.drafter is not None and "DFlash" in str(app.query_one("#status").render())
            answer = await say(pilot, "hello")
            assert answer.role == "assistant"
            # the same answer the engine gives for this conversation (greedy, lossless)
            lm = app.loaded
            ref = generate(lm.model, lm.tokenizer, build_prompt(lm.tokenizer, "", [{"role": "user", "content": "hello"}]),
                           lm.drafter, **lm.settings.generation_kwargs())
            assert answer.content == ref.text
            assert answer.stats["generation_tokens"] == len(ref.token_ids) and answer.stats["mode"] == "dflash"
            bubbles = app.query(AnswerBubble)
            assert len(bubbles) == 1 and bubbles.first().text == ref.text
            assert bubbles.first().updates > 1  # streamed in parts, not shown at the end
            assert f"{len(ref.token_ids)} tokens" in str(bubbles.first().query_one(".summary").render())
            assert "tau" in str(app.query_one("#status").render())
            # a follow-up reuses the KV cache of the first turn: at least its whole prompt
            # (how much of the answer depends on how the answer's text re-tokenizes)
            follow = await say(pilot, "more")
            assert follow.stats["reused_tokens"] >= answer.stats["prompt_tokens"] > 0
        saved = json.loads((tmp_path / "chats" / f"{app.chat.id}.json").read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
        assert saved["messages"][1]["content"] == ref.text

    run(go())


def test_escape_stops_generation_at_once(backend, tmp_path):
    backend.store.set_model("target", max_tokens=4000)

    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press(*"go on")
            await pilot.press("enter")
            await until(pilot, lambda: app.turn is not None and app.turn.batches >= 3, "the first tokens")
            await pilot.press("escape")
            await until(pilot, lambda: app.turn is None, "the stop")
            answer = app.chat.messages[-1]
            assert answer.stats["finish"] == "stopped"
            assert 0 < answer.stats["generation_tokens"] < 4000
            assert "stopped" in str(app.query(AnswerBubble).last().query_one(".summary").render())
            # the input still works: a new message can be sent at once after a stop
            assert app.focused is app.query_one("#input")
            # clearing the chat mid-answer stops it and leaves no orphan answer behind
            await pilot.press(*"and again")
            await pilot.press("enter")
            await until(pilot, lambda: app.turn is not None and app.turn.batches >= 2, "the next answer")
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("y")
            await until(pilot, lambda: app.turn is None, "the stop")
            await pilot.pause()
            assert app.chat.messages == [] and not app.query(AnswerBubble)
            saved = json.loads((tmp_path / "chats" / f"{app.chat.id}.json").read_text())
            assert saved["messages"] == []
            # quitting mid-answer keeps what was written so far
            await pilot.press(*"last one")
            await pilot.press("enter")
            await until(pilot, lambda: app.turn is not None and app.turn.batches >= 2, "the next answer")
        saved = json.loads((tmp_path / "chats" / f"{app.chat.id}.json").read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        assert saved["messages"][1]["content"] and saved["messages"][1]["stats"]["finish"] == "stopped"
        assert saved["model"] == "target"

    run(go())


def test_settings_panel_validates_saves_and_applies(backend, tmp_path):
    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings panel")
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
            assert backend.store.model("target").block_size == 5
            # good values: saved through the model manager, applied to the next message
            scr.query_one("#f-top_p").value = "1.0"
            scr.query_one("#f-max_tokens").value = "7"
            scr.query_one("#f-dflash_enabled").value = False
            scr.query_one("#f-system_prompt").text = "Be brief."
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "the panel to close")
            s = backend.store.model("target")
            assert (s.max_tokens, s.block_size, s.dflash_enabled, s.system_prompt) == (7, 3, False, "Be brief.")
            answer = await say(pilot, "hi")
            assert answer.stats["generation_tokens"] == 7 and answer.stats["finish"] == "length"
            assert answer.stats["mode"] == "off"
            with_system = build_prompt(app.loaded.tokenizer, "Be brief.", [{"role": "user", "content": "hi"}])
            assert answer.stats["prompt_tokens"] == len(with_system) and app.chat.system == "Be brief."
            assert "DFlash off" in str(app.query_one("#status").render())
            # and back on, with the new verify width
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings panel")
            app.screen.query_one("#f-dflash_enabled").value = True
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "the panel to close")
            answer = await say(pilot, "again")
            assert answer.stats["mode"] == "dflash" and answer.stats["block_size"] == 3

    run(go())


def test_enabling_dflash_loads_the_drafter(backend, tmp_path):
    backend.store.set_model("target", dflash_enabled=False, max_tokens=5)

    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.loaded.drafter is None and "DFlash off" in str(app.query_one("#status").render())
            assert (await say(pilot, "hi")).stats["mode"] == "off"
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings panel")
            app.screen.query_one("#f-dflash_enabled").value = True
            await pilot.press("ctrl+s")
            await until(pilot, lambda: app.loaded is not None and app.loaded.drafter is not None, "the drafter")
            assert "DFlash on" in str(app.query_one("#status").render())
            assert (await say(pilot, "hi")).stats["mode"] == "dflash"

    run(go())


def test_history_reopens_after_restart_and_skips_corrupt_files(backend, tmp_path):
    backend.store.set_model("target", max_tokens=6)
    chats = tmp_path / "chats"
    chats.mkdir()
    bad = chats / "broken.json"
    bad.write_text("{not json")
    (chats / "deep.json").write_text("[" * 100_000)  # RecursionError in the JSON parser
    (chats / "utf16.json").write_bytes('{"id": "x", "messages": []}'.encode("utf-16"))
    old = Chat(title="an older chat", messages=[ChatMessage("user", "old question"),
                                                 ChatMessage("assistant", "old answer", [["old answer", False]], {})])
    HistoryStore(chats).save(old)
    old_file = chats / f"{old.id}.json"
    meta = json.loads(old_file.read_text())
    meta["updated"] -= 3600  # an hour older than what the first app writes
    old_file.write_text(json.dumps(meta))

    async def first():
        app = make_app(backend, tmp_path, reopen_last=False)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            for name in ("broken.json", "deep.json", "utf16.json"):
                assert any(name in n.message for n in app._notifications), name
            assert not app.query(UserBubble)  # --new: an empty chat
            answer = await say(pilot, "remember me")
            return app.chat.id, answer.content

    chat_id, content = asyncio.run(first())
    assert bad.read_text() == "{not json"  # skipped, never deleted or rewritten

    async def second():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await until(pilot, lambda: app.chat.id == chat_id, "the last chat to reopen")
            await pilot.pause()
            assert [w.text for w in app.query(UserBubble)] == ["remember me"]
            assert [w.text for w in app.query(AnswerBubble)] == [content]
            # the chat list switches to the older chat
            await pilot.press("ctrl+b")
            await pilot.pause()
            ids = [app.screen.query_one("OptionList").get_option_at_index(i).id for i in range(2)]
            assert ids == [chat_id, old.id]
            await pilot.press("down", "enter")
            await until(pilot, lambda: app.chat.id == old.id, "the older chat")
            await pilot.pause()
            assert [w.text for w in app.query(UserBubble)] == ["old question"]
            # a new chat starts empty
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert not app.query(UserBubble) and app.chat.id not in (old.id, chat_id)

    run(second())


def test_regenerate_copy_and_token_colours(backend, tmp_path):
    # a width other than the default: the engine's guard (which may choose plain
    # decoding where drafting cannot pay) stays off, so drafts are always verified
    backend.store.set_model("target", max_tokens=16, block_size=4)

    async def go():
        from drafters import OracleDrafter
        from mlx_dflash import generate

        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            # a drafter that is right about half the time, so both kinds of token occur
            lm = app.loaded
            ids = build_prompt(lm.tokenizer, "", [{"role": "user", "content": "colour"}])
            cont = generate(lm.model, lm.tokenizer, ids, None, max_tokens=40).token_ids
            lm.drafter = OracleDrafter(len(ids), cont, lm.model.args.vocab_size, noise=0.5, seed=1,
                                       layer_ids=lm.drafter.config.target_layer_ids)
            app.prompt_cache.drafter = None
            answer = await say(pilot, "colour")
            flags = {d for _, d in answer.spans}
            assert flags == {True, False} and "".join(t for t, _ in answer.spans) == answer.content
            assert answer.stats["accepted"] > 0
            bubble = app.query(AnswerBubble).last()
            assert not bubble.has_class("-colours")
            await pilot.press("ctrl+t")
            await pilot.pause()
            assert bubble.has_class("-colours") and bubble.query_one(".spans").display
            rendered = bubble.query_one(".spans").render()
            assert rendered.plain == answer.content
            colour = {s.style.foreground.hex.lower() for s in rendered.spans}
            assert colour == {DRAFT_STYLE.lower(), TARGET_STYLE.lower()}
            drafted = "".join(rendered.plain[s.start:s.end] for s in rendered.spans
                              if s.style.foreground.hex.lower() == DRAFT_STYLE.lower())
            assert drafted == "".join(t for t, d in answer.spans if d)
            assert "draft" in str(app.query_one("#status").render())
            await pilot.press("ctrl+t")
            await pilot.pause()
            assert not bubble.has_class("-colours")
            # copy the last answer
            copied = []
            app.copy_to_clipboard = copied.append
            await pilot.press("ctrl+y")
            assert copied == [answer.content]
            # regenerate replaces the last answer (greedy: the same text again)
            lm.drafter = None  # back to plain decoding: the oracle tracks one prompt only
            await pilot.press("ctrl+r")
            await until(pilot, lambda: app.turn is None and len(app.chat.messages) == 2
                        and app.chat.messages[-1] is not answer, "the new answer")
            assert [m.role for m in app.chat.messages] == ["user", "assistant"]
            assert app.chat.messages[-1].content == answer.content
            assert len(app.query(AnswerBubble)) == 1
            # clear empties the chat (after asking)
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("y")
            await until(pilot, lambda: not app.chat.messages, "the chat to clear")
            await pilot.pause()
            assert not app.chat.messages and not app.query(AnswerBubble)

    run(go())


def test_model_switcher_lists_targets_only(backend, tmp_path):
    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+o")
            await pilot.pause()
            ol = app.screen.query_one("OptionList")
            assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == ["target"]
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is app.screen_stack[0]

    run(go())


def test_unknown_model_is_one_line_error(backend, capsys):
    from app.cli import main

    assert main(["chat", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown model 'no-such-model'" in err


def test_load_error_shows_in_status(backend, tmp_path):
    async def go():
        app = ChatApp("no-such-model", backend=backend, history=HistoryStore(tmp_path / "chats"))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "error" in app.status, "the load error")
            assert "unknown model" in app.status and "\n" not in app.status
            await pilot.press(*"hi")
            await pilot.press("enter")
            await pilot.pause()
            assert not app.chat.messages  # nothing sent without a model; the text stays in the input
            assert app.query_one("#input").text == "hi"

    run(go())


def test_answer_shows_the_models_text_as_written():
    """Markdown would join an answer's lines and read `12*5 ... 12*5` as emphasis;
    the bubble keeps both, streamed or whole, and still renders real Markdown."""
    from textual.app import App
    from textual.widgets import Markdown

    text = "12*5 = <<12*5=60>>60 cakes\nSo **60** in all\n\n```python\nx = 2*3\n```\n"

    class Host(App):
        def compose(self):
            yield AnswerBubble(text)
            yield AnswerBubble()

    async def go():
        app = Host()
        async with app.run_test(size=SIZE) as pilot:
            whole, streamed = app.query(AnswerBubble)
            for i in range(0, len(text), 7):  # token-sized pieces
                await streamed.add(text[i:i + 7], [])
            await pilot.pause()
            for bubble in (whole, streamed):
                blocks = [type(b).__name__ for b in bubble.query_one(Markdown).children]
                para = str(bubble.query_one(Markdown).children[0].render())
                assert para == "12*5 = <<12*5=60>>60 cakes\nSo 60 in all", para  # bold rendered, not shown as **
                assert blocks[:2] == ["MarkdownParagraph", "MarkdownFence"], blocks

    run(go())


# -- 80x24: fits, help, asks before erasing, the chat list -----------------------------------


def screen_lines(app) -> list:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def squeeze(text: str) -> str:
    return "".join(text.split())


def test_status_bar_fits_80x24(backend, tmp_path):
    backend.store.set_model("target", max_tokens=8)

    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await say(pilot, "hello")
            await pilot.pause()
            bar = app.query_one("#status")
            text = bar.render().plain if hasattr(bar.render(), "plain") else str(bar.render())
            assert "ready" in text and "DFlash" in text and "tok/s" in text
            # every word of the status line is on screen (wrapped, not cut), and the footer too
            assert squeeze(text) in squeeze("".join(screen_lines(app)))
            assert bar.region.bottom <= SIZE[1] - 1 and "Help" in screen_lines(app)[-1]

    run(go())


def test_settings_panel_is_usable_at_80x24(backend, tmp_path):
    async def go():
        from app.chat.settings_panel import SETTINGS_FIELDS

        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings panel")
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
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "the panel to close")
            s = backend.store.model("target")
            assert (s.max_tokens, s.dtype) == (9, "bfloat16")
            await until(pilot, lambda: app.loaded is not None and app.loaded.settings.dtype == "bfloat16", "the reload")
            from mlx_dflash.loader import model_dtype

            assert model_dtype(app.loaded.model) == "bfloat16"

    run(go())


def test_help_screen_explains_keys_and_numbers(backend, tmp_path):
    async def go():
        from app.chat.screens import KEYS, TERMS

        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
            await pilot.pause()
            terms = dict(TERMS)
            for word in ("tau", "accepted", "verify width", "cached"):
                assert word in terms and "\n" not in terms[word]
            bound = {b.key for b in app.BINDINGS}
            for key in ("ctrl+s", "ctrl+o", "ctrl+b", "ctrl+n", "ctrl+l", "ctrl+r", "ctrl+y", "ctrl+t", "ctrl+q"):
                assert key in bound and key in dict(KEYS), key
            shown = "\n".join(screen_lines(app))
            assert "Enter" in shown and "ctrl+s" in shown
            body = app.screen.query_one("#help-body")
            await pilot.press("end")
            await pilot.pause()
            assert body.scroll_y == body.max_scroll_y
            assert "cached" in "\n".join(screen_lines(app))  # the last lines scrolled into view
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is app.screen_stack[0]
            app.query_one("#messages").focus()  # '?' opens it too, where it is not typed into the input
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")

    run(go())


def test_clear_asks_first(backend, tmp_path):
    backend.store.set_model("target", max_tokens=4)

    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await say(pilot, "keep me")
            path = tmp_path / "chats" / f"{app.chat.id}.json"
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("enter")  # Enter alone keeps (the focused button is Keep)
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen) and len(app.chat.messages) == 2
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("n")
            await pilot.pause()
            assert len(json.loads(path.read_text())["messages"]) == 2
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("y")
            await until(pilot, lambda: not app.chat.messages, "the chat to clear")
            assert json.loads(path.read_text())["messages"] == []

    run(go())


def test_chat_list_deletes_and_renames(backend, tmp_path):
    chats = tmp_path / "chats"
    a = Chat(title="first", messages=[ChatMessage("user", "a")])
    b = Chat(title="second", messages=[ChatMessage("user", "b")])
    HistoryStore(chats).save(a)
    HistoryStore(chats).save(b)

    async def go():
        app = make_app(backend, tmp_path, reopen_last=False)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+b")
            await until(pilot, lambda: isinstance(app.screen, ListScreen), "the chat list")
            await pilot.pause()
            ol = app.screen.query_one("OptionList")
            assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == [b.id, a.id]
            # rename the highlighted (newest) chat; its place in the list stays
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, PromptScreen), "the rename prompt")
            app.screen.query_one("#text").value = "renamed chat"
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ListScreen), "the list again")
            assert "renamed chat" in str(ol.get_option_at_index(0).prompt)
            assert json.loads((chats / f"{b.id}.json").read_text())["title"] == "renamed chat"
            # delete asks; "n" keeps the file
            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, ListScreen), "the list again")
            assert (chats / f"{b.id}.json").exists()
            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("y")
            await until(pilot, lambda: isinstance(app.screen, ListScreen), "the list again")
            await pilot.pause()
            assert not (chats / f"{b.id}.json").exists() and (chats / f"{a.id}.json").exists()
            assert [ol.get_option_at_index(i).id for i in range(ol.option_count)] == [a.id]
            await pilot.press("enter")
            await until(pilot, lambda: app.chat.id == a.id, "the remaining chat to open")

    run(go())


def test_chat_takes_any_listed_spelling(backend):
    assert backend.resolve("TARGET").id == "target"
    assert backend.resolve("someorg/target").id == "target"


def test_low_acceptance_warns_once_in_the_chat(backend, tmp_path):
    """The random pair fits by shape and accepts almost nothing: one warning."""
    backend.store.set_model("target", max_tokens=60, block_size=4)  # fixed width: the guard would go plain and draft nothing

    async def go():
        app = make_app(backend, tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await say(pilot, "hello")
            await say(pilot, "again")
            warned = [n.message for n in app._notifications if "drafted tokens" in n.message]
            assert len(warned) == 1 and "accepted" in warned[0]

    run(go())


# -- snapshots (fixed size; wall-clock numbers masked) ------------------------------------


def _snap_app(backend, tmp_path):
    # a width other than the default: no timing-driven guard deciding what the screen shows
    backend.store.set_model("target", max_tokens=6, block_size=4)
    return make_app(backend, tmp_path, mask_timings=True)


async def still(pilot):
    """Loaded, with the input's cursor not blinking (a blink phase would vary the screen)."""
    await ready(pilot)
    pilot.app.query_one("#input").cursor_blink = False


def test_snapshot_chat_screen(backend, tmp_path, snap_compare):
    # a saved chat with a Markdown answer (reopened at start), then a live answer
    md = "Here it is:\n\n```python\ndef hello(name):\n    return f\"hi {name}\"\n```\n\nRun it with **Python 3**."
    stats = {"generation_tokens": 30, "generation_tps": 41.5, "mode": "dflash", "tau": 3.4, "acceptance_rate": 0.6,
             "ttft": 0.12, "prompt_tokens": 20, "reused_tokens": 0, "finish": "stop"}
    HistoryStore(tmp_path / "chats").save(Chat(messages=[
        ChatMessage("user", "A Python hello function?"), ChatMessage("assistant", md, [[md, True]], stats)]))

    async def before(pilot):
        await still(pilot)
        await say(pilot, "Thanks")
        await pilot.pause()

    assert snap_compare(_snap_app(backend, tmp_path), terminal_size=SIZE, run_before=before)


def test_snapshot_settings_panel(backend, tmp_path, snap_compare):
    async def before(pilot):
        await still(pilot)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen)
                    and pilot.app.screen.query("#f-temperature"), "the settings panel")
        pilot.app.screen.query_one("#f-temperature").value = "-1"
        await pilot.pause()
        await pilot.press("ctrl+s")
        await until(pilot, lambda: pilot.app.screen.query_one("#err-temperature").display, "the message")
        await pilot.pause()

    assert snap_compare(_snap_app(backend, tmp_path), terminal_size=SIZE, run_before=before)


def test_snapshot_model_switcher(backend, tmp_path, snap_compare):
    async def before(pilot):
        await still(pilot)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: pilot.app.screen.query("OptionList")
                    and pilot.app.screen.query_one("OptionList").has_focus, "the model list")
        await pilot.pause()

    assert snap_compare(_snap_app(backend, tmp_path), terminal_size=SIZE, run_before=before)
