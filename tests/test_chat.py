"""`mlx-dflash chat`: the conversation (streaming, stop, regenerate, history, errors)
driven with Pilot, plus snapshots of its screens (tests/chat_pilot.py: the pair and
the steps; the panels and dialogs: tests/test_chat_screens.py)."""

import asyncio
import json
import threading

import pytest

from chat_pilot import SIZE, drive, make_app, press_for, press_until, ready, say, start, status_text, until

from app.chat import DRAFT_STYLE, TARGET_STYLE, AnswerBubble, ChatApp, SettingsScreen, UserBubble, build_prompt
from app.chat.engine import Prefill
from app.chat.widgets import status_markup
from app.chat.screens import ConfirmScreen
from app.chat.history import Chat, HistoryStore
from app.chat.history import Message as ChatMessage


def saved_chat(tmp_path, app) -> dict:
    return json.loads((tmp_path / "chats" / f"{app.chat.id}.json").read_text())


async def clear(pilot):
    """ctrl+l and confirm with y."""
    await press_for(pilot, "ctrl+l", ConfirmScreen, "the question")
    await pilot.press("y")


@pytest.mark.slow
def test_send_streams_the_answer_and_saves_it(chat_backend, tmp_path):
    chat_backend.store.set_model("target", max_tokens=20)

    async def body(app, pilot):
        from mlx_dflash import generate

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
        return app, ref

    app, ref = drive(chat_backend, tmp_path, body)
    saved = saved_chat(tmp_path, app)
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][1]["content"] == ref.text


@pytest.mark.slow
def test_escape_stops_generation_at_once(chat_backend, tmp_path):
    chat_backend.store.set_model("target", max_tokens=4000)

    async def body(app, pilot):
        await start(pilot, "go on", 3, "the first tokens")
        await pilot.press("escape")
        await until(pilot, lambda: app.turn is None, "the stop")
        answer = app.chat.messages[-1]
        assert answer.stats["finish"] == "stopped"
        assert 0 < answer.stats["generation_tokens"] < 4000
        assert "stopped" in str(app.query(AnswerBubble).last().query_one(".summary").render())
        # the input still works: a new message can be sent at once after a stop
        assert app.focused is app.query_one("#input")
        # clearing the chat mid-answer stops it and leaves no orphan answer behind
        await start(pilot, "and again", 2, "the next answer")
        await clear(pilot)
        await until(pilot, lambda: app.turn is None, "the stop")
        await pilot.pause()
        assert app.chat.messages == [] and not app.query(AnswerBubble)
        assert saved_chat(tmp_path, app)["messages"] == []
        # quitting mid-answer keeps what was written so far
        await start(pilot, "last one", 2, "the next answer")
        return app

    # token batches every 50 ms (the app's default), not every token: a 4000-token answer
    # posted token by token floods the UI under CPU contention, and Pilot's pause() then
    # times out waiting for the backlog (seen with and without this file's refactor)
    saved = saved_chat(tmp_path, drive(chat_backend, tmp_path, body, flush_s=0.05))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert saved["messages"][1]["content"] and saved["messages"][1]["stats"]["finish"] == "stopped"
    assert saved["model"] == "target"


@pytest.mark.slow
def test_history_reopens_after_restart_and_skips_corrupt_files(chat_backend, tmp_path):
    chat_backend.store.set_model("target", max_tokens=6)
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

    async def first(app, pilot):
        for name in ("broken.json", "deep.json", "utf16.json"):
            assert any(name in n.message for n in app._notifications), name
        assert not app.query(UserBubble)  # --new: an empty chat
        answer = await say(pilot, "remember me")
        return app.chat.id, answer.content

    chat_id, content = drive(chat_backend, tmp_path, first, reopen_last=False)
    assert bad.read_text() == "{not json"  # skipped, never deleted or rewritten

    async def second(app, pilot):
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

    drive(chat_backend, tmp_path, second)


@pytest.mark.slow
def test_regenerate_copy_and_token_colours(chat_backend, tmp_path):
    # a fixed width (the guard off): the engine's guard (which may choose plain
    # decoding where drafting cannot pay) stays off, so drafts are always verified
    chat_backend.store.set_model("target", max_tokens=16, block_size=4, guard=False)

    async def body(app, pilot):
        from drafters import OracleDrafter
        from mlx_dflash import generate

        # a drafter that is right about half the time, so both kinds of token occur
        lm = app.loaded
        ids = build_prompt(lm.tokenizer, "", [{"role": "user", "content": "colour"}])
        cont = generate(lm.model, lm.tokenizer, ids, None, max_tokens=40).token_ids
        lm.drafter = OracleDrafter(len(ids), cont, lm.model.args.vocab_size, noise=0.5, seed=1,
                                   layer_ids=lm.drafter.config.target_layer_ids)
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
        await clear(pilot)
        await until(pilot, lambda: not app.chat.messages, "the chat to clear")
        await pilot.pause()
        assert not app.chat.messages and not app.query(AnswerBubble)

    drive(chat_backend, tmp_path, body)


def test_unknown_model_is_one_line_error(chat_backend, capsys):
    from app.cli import main

    assert main(["chat", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown model 'no-such-model'" in err


@pytest.mark.slow
def test_load_error_shows_in_status(chat_backend, tmp_path):
    async def go():
        app = ChatApp("no-such-model", backend=chat_backend, history=HistoryStore(tmp_path / "chats"))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "error" in app.status, "the load error")
            assert "unknown model" in app.status and "\n" not in app.status
            await pilot.press(*"hi")
            await pilot.press("enter")
            await pilot.pause()
            assert not app.chat.messages  # nothing sent without a model; the text stays in the input
            assert app.query_one("#input").text == "hi"

    asyncio.run(go())


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

    asyncio.run(go())


def test_chat_takes_any_listed_spelling(chat_backend):
    assert chat_backend.resolve("TARGET").id == "target"
    assert chat_backend.resolve("someorg/target").id == "target"


@pytest.mark.slow
def test_low_acceptance_warns_once_in_the_chat(chat_backend, tmp_path):
    """The random pair fits by shape and accepts almost nothing: one warning."""
    chat_backend.store.set_model("target", max_tokens=60, block_size=4, guard=False)  # fixed width: the guard would go plain and draft nothing

    async def body(app, pilot):
        await say(pilot, "hello")
        await say(pilot, "again")
        warned = [n.message for n in app._notifications if "drafted tokens" in n.message]
        assert len(warned) == 1 and "accepted" in warned[0]

    drive(chat_backend, tmp_path, body)


# -- snapshots (fixed size; wall-clock numbers masked) ------------------------------------


def snapshot(chat_backend, tmp_path, snap_compare, steps):
    """The screen after `await steps(pilot)` on the loaded app matches the test's snapshot."""
    # a fixed width (the guard off): no timing-driven guard deciding what the screen shows
    chat_backend.store.set_model("target", max_tokens=6, block_size=4, guard=False)

    async def before(pilot):
        await ready(pilot)
        pilot.app.query_one("#input").cursor_blink = False  # a blink phase would vary the screen
        await steps(pilot)
        await pilot.pause()

    return snap_compare(make_app(chat_backend, tmp_path, mask_timings=True), terminal_size=SIZE, run_before=before)


@pytest.mark.slow
def test_snapshot_chat_screen(chat_backend, tmp_path, snap_compare):
    # a saved chat with a Markdown answer (reopened at start), then a live answer
    md = "Here it is:\n\n```python\ndef hello(name):\n    return f\"hi {name}\"\n```\n\nRun it with **Python 3**."
    stats = {"generation_tokens": 30, "generation_tps": 41.5, "mode": "dflash", "tau": 3.4, "acceptance_rate": 0.6,
             "ttft": 0.12, "prompt_tokens": 20, "reused_tokens": 0, "finish": "stop"}
    HistoryStore(tmp_path / "chats").save(Chat(messages=[
        ChatMessage("user", "A Python hello function?"), ChatMessage("assistant", md, [[md, True]], stats)]))

    async def steps(pilot):
        await say(pilot, "Thanks")

    assert snapshot(chat_backend, tmp_path, snap_compare, steps)


@pytest.mark.slow
def test_snapshot_settings_panel(chat_backend, tmp_path, snap_compare):
    async def steps(pilot):
        screen = lambda: pilot.app.screen  # noqa: E731
        await press_until(pilot, "ctrl+s", lambda: isinstance(screen(), SettingsScreen)
                          and screen().query("#f-temperature"), "the settings panel")
        screen().query_one("#f-temperature").value = "-1"
        await pilot.pause()
        await press_until(pilot, "ctrl+s", lambda: screen().query_one("#err-temperature").display, "the message")

    assert snapshot(chat_backend, tmp_path, snap_compare, steps)


@pytest.mark.slow
def test_snapshot_model_switcher(chat_backend, tmp_path, snap_compare):
    async def steps(pilot):
        screen = lambda: pilot.app.screen  # noqa: E731
        await press_until(pilot, "ctrl+o", lambda: screen().query("OptionList")
                          and screen().query_one("OptionList").has_focus, "the model list")

    assert snapshot(chat_backend, tmp_path, snap_compare, steps)


@pytest.mark.slow
def test_escape_during_a_long_prefill_keeps_the_chunks_done(chat_backend, tmp_path):
    """A long prompt shows its prefill progress; Esc mid-prefill stops after the
    chunk in flight, the prompt cache keeps the chunks done (consistent), and the
    next answer goes on from them to the same text as a fresh generation."""
    from mlx_dflash import generate

    system = "hello there " * 700  # about 5,600 tokens: three prefill chunks of 2,048
    chat_backend.store.set_model("target", max_tokens=8, system_prompt=system)
    gate = threading.Event()

    async def body(app, pilot):
        post = app.post_message

        def held(m):  # the engine waits after its first progress report until Esc is in
            out = post(m)
            if isinstance(m, Prefill):
                gate.wait(60)
            return out

        app.post_message = held
        await pilot.press(*"hi")
        await pilot.press("enter")
        await until(pilot, lambda: "prefill 2048/" in status_text(app), "the prefill progress")
        turn = app.turn
        await pilot.press("escape")
        await until(pilot, lambda: turn.cancel.is_set(), "the stop")
        gate.set()
        await until(pilot, lambda: app.turn is None, "the stopped turn")
        await until(pilot, lambda: not app.query(AnswerBubble), "the empty answer's removal")
        assert turn.text == "" and app.status == "stopped"
        lm = app.loaded
        [(pc, _)] = app.prompt_store.entries.values()  # the stopped turn's cache, given back to the store
        prompt = build_prompt(lm.tokenizer, system, [{"role": "user", "content": "hi"}])
        # stopped after the chunk in flight: two chunks kept, the last not done
        assert pc.tokens == prompt[:4096] and len(prompt) > 4096
        assert all(c.offset == 4096 for c in pc.target)
        assert pc.pending.shape[1] == 4096  # the drafter's features of the kept rows
        app.post_message = post
        await pilot.press("ctrl+r")  # answer the same question again: from the kept chunks
        await until(pilot, lambda: app.turn is None and app.chat.messages[-1].role == "assistant", "the answer")
        answer = app.chat.messages[-1]
        ref = generate(lm.model, lm.tokenizer, prompt, lm.drafter, **lm.settings.generation_kwargs())
        assert answer.content == ref.text and answer.stats["reused_tokens"] == 4096
        assert answer.stats["prompt_tokens"] == len(prompt) and answer.stats["mode"] == "dflash"

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_a_reopened_chat_shows_its_end(chat_backend, tmp_path):
    """A saved conversation longer than the screen reopens scrolled to its last message
    (issue 37: it opened at the top)."""
    long = Chat(title="a long chat", messages=[
        ChatMessage(role, f"{role} message {i}\n\n" + "a line of text\n" * 3, [] if role == "user" else
                    [[f"{role} message {i}", False]], {} if role == "assistant" else None)
        for i in range(20) for role in ("user", "assistant")])
    HistoryStore(tmp_path / "chats").save(long)

    async def body(app, pilot):
        await until(pilot, lambda: app.chat.id == long.id and app.query(AnswerBubble), "the saved chat")
        box = app.query_one("#messages")
        await until(pilot, lambda: box.max_scroll_y > 0 and box.scroll_y == box.max_scroll_y, "the chat's end",
                    limit=20)
        for _ in range(5):  # and it stays there
            await pilot.pause(0.05)
        assert box.scroll_y == box.max_scroll_y > 0

    drive(chat_backend, tmp_path, body)


@pytest.mark.slow
def test_a_new_start_of_the_chat_finds_its_prompt_on_disk(chat_backend, tmp_path):
    """The prompt store's disk tier: the next start of the app (nothing in memory)
    continues the reopened chat from the prefix the last one wrote, and says so."""
    chat_backend.store.set_model("target", max_tokens=8)

    async def first(app, pilot):
        return (await say(pilot, "Tell me about lists.")).content

    async def second(app, pilot):
        answer = await say(pilot, "And dicts?")
        return answer.stats, status_markup(app.loaded, app.settings, app.last_stats, "ready", False, True)

    drive(chat_backend, tmp_path, first)  # (quitting waits for its write to disk)
    stats, bar = drive(chat_backend, tmp_path, second)
    assert stats["prompt_cache"]["tier"] == "disk" and stats["reused_tokens"] > 20
    assert f"cached {stats['reused_tokens']}/{stats['prompt_tokens']} from disk" in bar  # (a bar wide enough)
