"""Chat history in SQLite: conversations and their messages, written so that nothing is lost.

- WAL mode with synchronous=FULL: a commit survives a kill -9 (and a power cut); readers never block
  the writer, and a second kvchat on the same file waits (busy_timeout) instead of failing.
- Every message is written in its own transaction as soon as it is complete. An assistant reply is
  inserted as 'streaming' when it starts and checkpointed while it grows, so a crash keeps the
  partial text; the next open marks such leftovers 'interrupted'.
- One connection per History, shared by the UI thread and the generation worker under a lock.

Message status: complete | streaming | stopped (the user pressed Esc) | interrupted (crash) | error.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from models.errors import BadInputError

DB_NAME = "history.sqlite3"
BUSY_TIMEOUT_MS = 10_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    title         TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    model         TEXT NOT NULL DEFAULT '',
    settings      TEXT NOT NULL DEFAULT '{}',
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content         TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'complete',
    model           TEXT NOT NULL DEFAULT '',
    timings         TEXT NOT NULL DEFAULT '{}',
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def default_path() -> Path:
    from core.paths import data_dir
    return data_dir() / DB_NAME


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str = ""
    model: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass
class StoredMessage:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "complete"
    model: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


class History:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: we open transactions ourselves, one per logical write.
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("PRAGMA foreign_keys = ON")
        with self._tx() as db:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            # A reply still 'streaming' here was cut off by a crash (or the other instance is
            # writing it right now; it was updated in the last few seconds then, so leave it).
            db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming' AND updated_at < ?",
                       (time.time() - 5,))

    # --- plumbing --------------------------------------------------------------------------
    class _Tx:
        def __init__(self, history: "History"):
            self.h = history

        def __enter__(self) -> sqlite3.Connection:
            self.h._lock.acquire()
            try:
                self.h._db.execute("BEGIN IMMEDIATE")   # take the write lock now: no upgrade deadlock
            except BaseException:
                self.h._lock.release()
                raise
            return self.h._db

        def __exit__(self, exc_type, exc, tb) -> None:
            try:
                self.h._db.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.h._lock.release()

    def _tx(self) -> "History._Tx":
        return History._Tx(self)

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def integrity_check(self) -> str:
        return self._query("PRAGMA integrity_check")[0][0]

    # --- conversations ---------------------------------------------------------------------
    def create_conversation(self, title: str, system_prompt: str = "", model: str = "",
                            settings: dict | None = None) -> int:
        now = time.time()
        with self._tx() as db:
            cur = db.execute("INSERT INTO conversations (title, system_prompt, model, settings, created_at, updated_at)"
                             " VALUES (?, ?, ?, ?, ?, ?)",
                             (title, system_prompt, model, json.dumps(settings or {}), now, now))
            return int(cur.lastrowid)

    def list_conversations(self) -> list[Conversation]:
        """Most recently used first."""
        rows = self._query("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC")
        return [_conversation(r) for r in rows]

    def get_conversation(self, conversation_id: int) -> Conversation:
        rows = self._query("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            raise BadInputError(f"no conversation with id {conversation_id}")
        return _conversation(rows[0])

    def update_conversation(self, conversation_id: int, *, title: str | None = None,
                            system_prompt: str | None = None, model: str | None = None,
                            settings: dict | None = None) -> None:
        changes = {k: v for k, v in (("title", title), ("system_prompt", system_prompt), ("model", model),
                                      ("settings", None if settings is None else json.dumps(settings)))
                   if v is not None}
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self._tx() as db:
            db.execute(f"UPDATE conversations SET {sets + ', ' if sets else ''}updated_at = ? WHERE id = ?",
                       (*changes.values(), time.time(), conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # --- messages --------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, status: str = "complete",
                    model: str = "", timings: dict | None = None) -> int:
        now = time.time()
        with self._tx() as db:
            cur = db.execute("INSERT INTO messages (conversation_id, role, content, status, model, timings,"
                             " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (conversation_id, role, content, status, model, json.dumps(timings or {}), now, now))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            return int(cur.lastrowid)

    def start_reply(self, conversation_id: int, model: str = "") -> int:
        """An assistant reply that is about to stream: stored at once, empty, as 'streaming'."""
        return self.add_message(conversation_id, "assistant", "", status="streaming", model=model)

    def checkpoint_reply(self, message_id: int, content: str) -> None:
        """Save the text streamed so far (called every ~0.5 s while a reply grows)."""
        with self._tx() as db:
            db.execute("UPDATE messages SET content = ?, updated_at = ? WHERE id = ?", (content, time.time(), message_id))

    def finish_reply(self, message_id: int, content: str, status: str = "complete",
                     timings: dict | None = None) -> None:
        with self._tx() as db:
            db.execute("UPDATE messages SET content = ?, status = ?, timings = ?, updated_at = ? WHERE id = ?",
                       (content, status, json.dumps(timings or {}), time.time(), message_id))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [_message(r) for r in rows]

    def get_message(self, message_id: int) -> StoredMessage:
        rows = self._query("SELECT * FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise BadInputError(f"no message with id {message_id}")
        return _message(rows[0])

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and every later one in its conversation (regenerate, edit and resend)."""
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))

    # --- export ----------------------------------------------------------------------------
    def export_conversation(self, conversation_id: int, fmt: str = "md") -> str:
        conv = self.get_conversation(conversation_id)
        msgs = self.messages(conversation_id)
        if fmt == "json":
            return json.dumps({
                "id": conv.id, "title": conv.title, "system_prompt": conv.system_prompt, "model": conv.model,
                "settings": conv.settings, "created_at": conv.created_at, "updated_at": conv.updated_at,
                "messages": [{"id": m.id, "role": m.role, "content": m.content, "status": m.status,
                              "model": m.model, "timings": m.timings, "created_at": m.created_at} for m in msgs],
            }, ensure_ascii=False, indent=2)
        if fmt != "md":
            raise BadInputError(f"unknown export format '{fmt}' (choose md or json)")
        return "\n".join(_markdown_lines(conv, msgs))


def _markdown_lines(conv: Conversation, msgs: list[StoredMessage]) -> Iterator[str]:
    yield f"# {conv.title}"
    yield ""
    if conv.model:
        yield f"*model: {conv.model}*"
        yield ""
    if conv.system_prompt:
        yield "## System"
        yield ""
        yield conv.system_prompt
        yield ""
    for m in msgs:
        note = "" if m.status == "complete" else f" ({m.status})"
        yield f"## {m.role.capitalize()}{note}"
        yield ""
        yield m.content
        yield ""


def _conversation(r: sqlite3.Row) -> Conversation:
    return Conversation(r["id"], r["title"], r["system_prompt"], r["model"], json.loads(r["settings"] or "{}"),
                        r["created_at"], r["updated_at"])


def _message(r: sqlite3.Row) -> StoredMessage:
    return StoredMessage(r["id"], r["conversation_id"], r["role"], r["content"], r["status"], r["model"],
                         json.loads(r["timings"] or "{}"), r["created_at"])
