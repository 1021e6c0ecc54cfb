"""The SQLite conversation store: CRUD, search, export, and upgrading an old schema in place."""

from __future__ import annotations

import sqlite3

import pytest

from llmd.tui.store import MIGRATIONS, SCHEMA_VERSION, ChatStore, Message, SchemaTooNew


def test_conversations_round_trip(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    conv = store.create("Capitals", model="m1", system_prompt="Be brief.", temperature=0.3, max_tokens=64)
    store.add_message(conv.id, Message("user", "What is the capital of France?"))
    store.add_message(conv.id, Message("assistant", "Paris.", timings={"ttft_ms": 12.0}, model="m1"))
    store.close()

    store = ChatStore(tmp_path / "chat.db")  # reopened: everything persisted
    got = store.get(conv.id)
    assert (got.title, got.model, got.system_prompt, got.temperature, got.max_tokens) == (
        "Capitals", "m1", "Be brief.", 0.3, 64)
    assert [(m.role, m.content) for m in got.messages] == [
        ("user", "What is the capital of France?"), ("assistant", "Paris.")]
    assert got.messages[1].timings == {"ttft_ms": 12.0}

    store.rename(conv.id, "  ")
    assert store.get(conv.id).title == "New chat"
    store.update_settings(conv.id, model=None, system_prompt="", temperature=None, max_tokens=None)
    assert store.get(conv.id).model is None
    store.delete(conv.id)
    assert store.list() == []
    assert store.db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascade


def test_list_is_recent_first_and_search_matches_titles_and_text(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    a = store.create("Rust lifetimes")
    b = store.create("Cooking")
    store.add_message(b.id, Message("user", "How long to boil an egg? 100% sure_please"))
    store.add_message(a.id, Message("user", "explain borrowck"))
    assert [c.title for c in store.list()] == ["Rust lifetimes", "Cooking"]
    assert [c.title for c in store.list("EGG")] == ["Cooking"]
    assert [c.title for c in store.list("rust")] == ["Rust lifetimes"]
    # LIKE wildcards in the query are literal characters
    assert [c.title for c in store.list("100%")] == ["Cooking"]
    assert store.list("_") == [store.list("sure_")[0]] and store.list("%") == store.list("100%")
    assert store.list("nothing like this") == []


def test_export_markdown(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    conv = store.create("Code", model="m1", system_prompt="You write Python.", temperature=0.5)
    store.add_message(conv.id, Message("user", "add?"))
    store.add_message(conv.id, Message("assistant", "```python\ndef add(a, b):\n    return a + b\n```"))
    text = store.export_markdown(conv.id)
    assert text.startswith("# Code\n")
    assert "model: m1, temperature: 0.5" in text
    assert "## System\n\nYou write Python." in text
    assert text.index("## User") < text.index("## Assistant") < text.index("def add(a, b):")


def test_old_schema_is_upgraded_in_place(tmp_path):
    path = tmp_path / "chat.db"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "PRAGMA user_version = 1;")
    db.execute("INSERT INTO conversations (title, system_prompt, created_at, updated_at) VALUES ('old', '', 1, 1)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'user', 'hi', 1)")
    db.commit()
    db.close()

    store = ChatStore(path)
    assert store.schema_version == SCHEMA_VERSION == 3
    conv = store.get(1)
    assert conv.title == "old" and conv.messages[0].content == "hi" and conv.messages[0].timings is None
    assert conv.messages[0].images is None
    store.add_message(1, Message("assistant", "hello", timings={"ttft_ms": 1.0}))
    store.add_message(1, Message("user", "and this?", images=["/pictures/cat.png"]))
    assert store.get(1).messages[1].timings == {"ttft_ms": 1.0}
    assert store.get(1).messages[2].images == ["/pictures/cat.png"]


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "chat.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNew, match="schema version"):
        ChatStore(path)


def test_default_location_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    store = ChatStore()
    assert store.path == tmp_path / "data" / "llmd" / "chat.sqlite3"
    assert store.path.exists()
