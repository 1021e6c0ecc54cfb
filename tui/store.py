"""Conversations on disk: one SQLite file under the XDG data directory.

The schema is versioned with `PRAGMA user_version`; MIGRATIONS[i] takes a database from version i to i+1, so an
old file is upgraded in place on open and never loses its conversations.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.errors import LlmdError

MIGRATIONS: list[str] = [
    # 0 -> 1: conversations and their messages.
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        model TEXT,
        system_prompt TEXT NOT NULL DEFAULT '',
        temperature REAL,
        max_tokens INTEGER,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # 1 -> 2: the daemon's per-answer timings (TTFT, tok/s, cache hits...) and the model that wrote each answer.
    """
    ALTER TABLE messages ADD COLUMN timings TEXT;
    ALTER TABLE messages ADD COLUMN model TEXT;
    """,
    # 2 -> 3: the image files a user message was sent with (a JSON list of paths).
    """
    ALTER TABLE messages ADD COLUMN images TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

DEFAULT_TITLE = "New chat"


def default_db_path() -> Path:
    from llmd.config import data_dir

    return data_dir() / "chat.sqlite3"


@dataclass
class Message:
    role: str
    content: str
    id: int | None = None
    timings: dict[str, Any] | None = None
    model: str | None = None
    images: list[str] | None = None  # paths of the images sent with a user message


@dataclass
class Conversation:
    id: int
    title: str
    model: str | None = None
    system_prompt: str = ""
    temperature: float | None = None
    max_tokens: int | None = None
    updated_at: float = 0.0
    messages: list[Message] = field(default_factory=list)


class SchemaTooNew(LlmdError):
    """The file was written by a newer llmd; refusing to touch it keeps that data safe."""


class ChatStore:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path))
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA foreign_keys = ON")
        self._migrate()

    def close(self) -> None:
        self.db.close()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"{self.path} has schema version {version}; this llmd knows up to {SCHEMA_VERSION}")
        for target in range(version, SCHEMA_VERSION):
            # executescript commits first; wrapping each step in a transaction keeps a failed step from half-applying.
            self.db.executescript(f"BEGIN; {MIGRATIONS[target]} PRAGMA user_version = {target + 1}; COMMIT;")

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    # --- conversations ------------------------------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE, model: str | None = None, system_prompt: str = "",
               temperature: float | None = None, max_tokens: int | None = None) -> Conversation:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO conversations (title, model, system_prompt, temperature, max_tokens, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (title, model, system_prompt, temperature, max_tokens, now, now),
            )
        return self.get(cur.lastrowid)

    def get(self, conversation_id: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(conversation_id)
        conv = _conversation(row)
        conv.messages = [
            Message(role=m["role"], content=m["content"], id=m["id"], model=m["model"],
                    timings=json.loads(m["timings"]) if m["timings"] else None,
                    images=json.loads(m["images"]) if m["images"] else None)
            for m in self.db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        ]
        return conv

    def list(self, search: str = "") -> list[Conversation]:
        """Most recently used first. `search` matches titles and message text, case-insensitively."""
        if search:
            pattern = f"%{_escape_like(search)}%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m"
                " WHERE m.conversation_id = c.id AND m.content LIKE ? ESCAPE '\\') ORDER BY updated_at DESC, id DESC",
                (pattern, pattern),
            )
        else:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC")
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        title = title.strip() or DEFAULT_TITLE
        with self.db:
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def update_settings(self, conversation_id: int, *, model: str | None, system_prompt: str,
                        temperature: float | None, max_tokens: int | None) -> None:
        with self.db:
            self.db.execute(
                "UPDATE conversations SET model = ?, system_prompt = ?, temperature = ?, max_tokens = ? WHERE id = ?",
                (model, system_prompt, temperature, max_tokens, conversation_id),
            )

    def delete(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # --- messages -----------------------------------------------------------------------------------------------

    def add_message(self, conversation_id: int, message: Message) -> Message:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, timings, model, images)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, message.role, message.content, now,
                 json.dumps(message.timings) if message.timings else None, message.model,
                 json.dumps(message.images) if message.images else None),
            )
            self.db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        message.id = cur.lastrowid
        return message

    def delete_message(self, message_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # --- export -------------------------------------------------------------------------------------------------

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        lines = [f"# {conv.title}", ""]
        settings = [f"model: {conv.model or 'default'}"]
        if conv.temperature is not None:
            settings.append(f"temperature: {conv.temperature:g}")
        if conv.max_tokens is not None:
            settings.append(f"max tokens: {conv.max_tokens}")
        lines += [f"_{', '.join(settings)}_", ""]
        if conv.system_prompt:
            lines += ["## System", "", conv.system_prompt, ""]
        for m in conv.messages:
            lines += [f"## {m.role.capitalize()}", "", m.content, ""]
        return "\n".join(lines)


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=row["id"], title=row["title"], model=row["model"], system_prompt=row["system_prompt"],
        temperature=row["temperature"], max_tokens=row["max_tokens"], updated_at=row["updated_at"],
    )


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
