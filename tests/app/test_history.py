"""core.history: transactions, recovery of cut-off replies, two writers, export."""
import json
import sqlite3
import threading
import time

import pytest

from core.history import History
from models.errors import BadInputError


def test_messages_round_trip_and_order(tmp_path):
    h = History(tmp_path / "h.db")
    a = h.create_conversation("first", system_prompt="be brief", model="m", settings={"temperature": 0.2})
    b = h.create_conversation("second")
    h.add_message(a, "user", "hi")
    reply = h.start_reply(a, "m")
    h.checkpoint_reply(reply, "hel")
    h.finish_reply(reply, "hello", "stopped", {"predicted_n": 2})
    msgs = h.messages(a)
    assert [(m.role, m.content, m.status) for m in msgs] == [("user", "hi", "complete"), ("assistant", "hello", "stopped")]
    assert msgs[1].timings == {"predicted_n": 2}
    conv = h.get_conversation(a)
    assert (conv.system_prompt, conv.model, conv.settings) == ("be brief", "m", {"temperature": 0.2})
    # the most recently written conversation is listed first
    assert [c.id for c in h.list_conversations()] == [a, b]
    h.update_conversation(b, title="renamed")
    assert h.list_conversations()[0].title == "renamed"
    h.delete_messages_from(a, reply)
    assert [m.role for m in h.messages(a)] == ["user"]
    h.delete_conversation(a)
    assert [c.id for c in h.list_conversations()] == [b]
    assert h.messages(a) == []
    with pytest.raises(BadInputError):
        h.get_conversation(a)


def test_wal_mode_and_integrity(tmp_path):
    h = History(tmp_path / "h.db")
    mode = sqlite3.connect(tmp_path / "h.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert h.integrity_check() == "ok"


def test_cut_off_reply_is_marked_interrupted_on_reopen(tmp_path):
    path = tmp_path / "h.db"
    h = History(path)
    conv = h.create_conversation("c")
    reply = h.start_reply(conv)
    h.checkpoint_reply(reply, "partial text")
    h._db.execute("UPDATE messages SET updated_at = updated_at - 60")   # the writer died a minute ago
    h2 = History(path)
    m = h2.get_message(reply)
    assert (m.content, m.status) == ("partial text", "interrupted")


def test_two_writers_on_one_database(tmp_path):
    """Two History objects (as two kvchat instances would) write at once: nothing lost, db intact."""
    path = tmp_path / "h.db"
    first, second = History(path), History(path)
    conv = first.create_conversation("shared")
    errors = []

    def write(h: History, tag: str) -> None:
        try:
            for i in range(60):
                reply = h.start_reply(conv)
                h.checkpoint_reply(reply, f"{tag}{i}-part")
                h.finish_reply(reply, f"{tag}{i}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(first, "a")), threading.Thread(target=write, args=(second, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    contents = sorted(m.content for m in History(path).messages(conv))
    assert contents == sorted([f"a{i}" for i in range(60)] + [f"b{i}" for i in range(60)])
    assert first.integrity_check() == "ok"


def test_export_markdown_and_json(tmp_path):
    h = History(tmp_path / "h.db")
    conv = h.create_conversation("Title", system_prompt="sys", model="m")
    h.add_message(conv, "user", "question")
    r = h.start_reply(conv)
    h.finish_reply(r, "answer", "stopped")
    md = h.export_conversation(conv, "md")
    assert md.startswith("# Title")
    assert "## System\n\nsys" in md and "## User\n\nquestion" in md and "## Assistant (stopped)\n\nanswer" in md
    data = json.loads(h.export_conversation(conv, "json"))
    assert data["title"] == "Title" and data["system_prompt"] == "sys"
    assert [(m["role"], m["content"], m["status"]) for m in data["messages"]] == [
        ("user", "question", "complete"), ("assistant", "answer", "stopped")]
    with pytest.raises(BadInputError):
        h.export_conversation(conv, "html")
    with pytest.raises(BadInputError):
        h.export_conversation(conv + 100, "md")


def test_export_command(tmp_path, capsys):
    import argparse

    from app.export import add_export_parser, cmd_export
    path = tmp_path / "h.db"
    h = History(path)
    conv = h.create_conversation("CLI export")
    h.add_message(conv, "user", "hello there")
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", str(conv), "--format", "json", "--db", str(path)])
    assert cmd_export(args) == 0
    assert json.loads(capsys.readouterr().out)["messages"][0]["content"] == "hello there"
    args = parser.parse_args(["export", str(conv + 5), "--db", str(path)])
    with pytest.raises(BadInputError, match="no conversation"):
        cmd_export(args)
