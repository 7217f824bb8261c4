"""Attaching files in the chat (ctrl+f), driven by Textual's Pilot against the real engine
(gemma-3-270m on llama.cpp, 512 tokens of context) and a real SQLite history."""
from __future__ import annotations

import pytest

from app.tui.screens.attach import AttachScreen, complete_path
from app.tui.widgets.attachments import AttachmentBar, AttachmentChip
from app.tui.widgets.messages import UserMessage
from core.attachments import compose_message, read_attachment
from core.history import History
from tests.app.conftest import N_CTX, wait_until
from tests.app.test_tui import SIZE, make_app, type_and_send

pytestmark = pytest.mark.asyncio

MAX_TOKENS = 12     # make_app's: the reply's room, kept free in the context


def chips(app) -> list[str]:
    return [str(chip.render()) for chip in app.query(AttachmentChip)]


async def test_complete_path_follows_the_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "notebook").mkdir()
    (tmp_path / "other.md").write_text("x")
    (tmp_path / ".hidden").write_text("x")
    base = f"{tmp_path}/"
    assert complete_path(base + "ot") == base + "other.md"
    assert complete_path(base + "not") == base + "note"                  # what the two share
    assert complete_path(base + "noteb") == base + "notebook/"           # a directory gets its /
    assert complete_path(base + "note") == base + "notebook/"            # no more shared: the first
    assert complete_path(base + "zz") is None and complete_path(base + "nope/x") is None
    assert complete_path(base + "h") is None and complete_path(base + ".h") == base + ".hidden"


async def test_attach_a_file_see_its_chip_and_send_it(engine, tmp_path):
    db = tmp_path / "h.db"
    docs = tmp_path / "docs"
    docs.mkdir()
    notes = docs / "notes.txt"
    notes.write_text("Zorblax's favourite fruit is the quince.\n", encoding="utf-8")
    other = docs / "other.md"
    other.write_text("# Unrelated\nThe sky is blue.\n", encoding="utf-8")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    app = make_app(engine, db)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        assert not app.query_one(AttachmentBar).display
        await pilot.press("ctrl+f")
        await pilot.pause()
        assert isinstance(app.screen, AttachScreen)
        box = app.screen.query_one("#attach-path")
        await pilot.press(*str(docs), "enter")                       # enter on a directory opens it
        assert isinstance(app.screen, AttachScreen) and box.value == f"{docs}/"
        await pilot.press("n", "o")
        await wait_until(pilot, lambda: box._suggestion == f"{docs}/notes.txt", 10, "the completion")
        await pilot.press("tab")                                     # takes the completion
        assert box.value == f"{docs}/notes.txt"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(chips(app)) == 1, 30, "the chip")
        n_tokens = engine.count_tokens(read_attachment(notes).block())
        assert chips(app) == [f"notes.txt · {n_tokens} tokens ×"] and app.query_one(AttachmentBar).display

        await pilot.press("ctrl+f")                                  # a binary file: a toast, no chip
        await pilot.pause()
        app.screen.query_one("#attach-path").value = str(docs / "image.png")
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("binary" in n.message for n in app._notifications), 30, "the refusal")
        note = next(n for n in app._notifications if "binary" in n.message)
        assert note.severity == "error" and "image.png is a binary file" in note.message
        assert len(chips(app)) == 1

        await pilot.press("ctrl+f")                                  # a second file, then removed again
        await pilot.pause()
        app.screen.query_one("#attach-path").value = str(other)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(chips(app)) == 2, 30, "the second chip")
        app.query_one("#input").focus()
        await pilot.press("shift+tab")                               # onto the last chip
        assert app.focused is list(app.query(AttachmentChip))[-1]
        await pilot.press("delete")
        await pilot.pause()
        assert chips(app) == [f"notes.txt · {n_tokens} tokens ×"] and app.focused is app.query_one("#input")

        question = "What is Zorblax's favourite fruit?"
        await type_and_send(pilot, question)
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "the reply")
        await pilot.pause()
        expected = compose_message(question, [read_attachment(notes)])
        assert expected.startswith("File: notes.txt\n") and expected.endswith(question)
        assert [u.content for u in app.query(UserMessage)] == [expected]
        assert "the quince" in str(app.query_one(UserMessage).query_one(".body").render())
        stored = History(db).messages(app.conversation_id)
        assert [(m.role, m.content) for m in stored][0] == ("user", expected)
        assert History(db).get_conversation(app.conversation_id).title == question
        assert chips(app) == [] and not app.query_one(AttachmentBar).display   # sent with the message


async def test_what_does_not_fit_is_refused_and_nothing_is_lost(engine, tmp_path):
    db = tmp_path / "h.db"
    part = "alpha beta gamma delta epsilon zeta eta theta\n"
    a, b, huge = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "huge.txt"
    a.write_text(part * 30, encoding="utf-8")
    b.write_text(part * 31, encoding="utf-8")
    huge.write_text(part * 70, encoding="utf-8")
    n_a, n_b, n_huge = (engine.count_tokens(read_attachment(p).block()) for p in (a, b, huge))
    budget = N_CTX - MAX_TOKENS
    assert n_a < budget and n_b < budget < n_a + n_b and n_huge > budget      # the premise
    app = make_app(engine, db)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        for path in (a, b, huge):
            await pilot.press("ctrl+f")
            await pilot.pause()
            app.screen.query_one("#attach-path").value = str(path)
            await pilot.press("enter")
            await pilot.pause()
        await wait_until(pilot, lambda: any("huge.txt" in n.message for n in app._notifications), 30, "the refusal")
        assert next(n.message for n in app._notifications if "huge.txt" in n.message) == (
            f"huge.txt is {n_huge} tokens but the context holds {N_CTX} (with {MAX_TOKENS} kept free for the reply); "
            "attach a smaller file or raise --ctx")
        await wait_until(pilot, lambda: len(chips(app)) == 2, 30, "two chips")
        assert [c.split(" ·")[0] for c in chips(app)] == ["a.txt", "b.txt"]

        await type_and_send(pilot, "Count the words")                # both together do not fit
        await pilot.pause()
        refusal = next(n for n in app._notifications if "the message with its attachments" in n.message)
        n_message = len(engine.prompt_ids(
            [{"role": "user", "content": compose_message("Count the words", [read_attachment(a), read_attachment(b)])}],
            chat=engine.has_chat_template))
        assert refusal.severity == "error" and refusal.message == (
            f"the message with its attachments is {n_message} tokens (a.txt: {n_a}, b.txt: {n_b}) but the context "
            f"holds {N_CTX} (with {MAX_TOKENS} kept free for the reply); attach less or raise --ctx")
        assert app.query_one("#input").text == "Count the words" and len(chips(app)) == 2     # nothing lost
        assert app.conversation_id is None and not app.generating

        app.clear_notifications()                                    # (the toasts lie over the chips)
        await pilot.pause()
        await pilot.click(list(app.query(AttachmentChip))[-1])       # clicking a chip removes it
        await pilot.pause()
        assert [c.split(" ·")[0] for c in chips(app)] == ["a.txt"]
        app.query_one("#input").focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "the reply")
        stored = History(db).messages(app.conversation_id)
        assert stored[0].content == compose_message("Count the words", [read_attachment(a)])
        assert app.reply_widget.status == "complete"
