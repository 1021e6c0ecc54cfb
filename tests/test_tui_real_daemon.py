"""`llmd chat` and `llmd top` against a real `llmd serve` on the real default model (SmolLM2-135M-Instruct),
through Pilot and through the real command in a real terminal (tmux)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from llmd.tui.chat_app import ChatApp
from llmd.tui.client import DaemonClient, Endpoint
from llmd.tui.store import ChatStore
from llmd.tui.top_app import TopApp, TopView
from llmd.tui.widgets import MessageView, PromptInput
from llmd_daemon_proc import llmd_exe, start_daemon

pytestmark = pytest.mark.slow
SIZE = (110, 40)
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_tui"))
    yield d
    d.stop()


def chat_app(daemon, tmp_path, **settings) -> ChatApp:
    store = ChatStore(tmp_path / "chat.db")
    conv = store.create("France", **settings)
    del conv
    # Through the Unix socket, as `llmd chat` does by default.
    return ChatApp(DaemonClient([Endpoint(socket_path=daemon.socket_path)]), store)


async def wait_for(pilot, condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.1)


def answers(app):
    return [v for v in app.query(MessageView) if v.role == "assistant"]


async def ask(pilot, text):
    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.insert(text)
    await pilot.press("enter")


async def test_real_answer_with_timings_and_a_prefix_cache_hit_on_regenerate(daemon, tmp_path):
    app = chat_app(daemon, tmp_path, temperature=0.0, max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "connected" in str(app.query_one("#status").render()))
        await ask(pilot, QUESTION)
        await wait_for(pilot, lambda: answers(app) and not app.generating)
        await pilot.pause()
        first = answers(app)[0]
        assert "Paris" in first.content
        footer = str(first.footer.render())
        assert "TTFT" in footer and "tok/s" in footer and "tokens" in footer, footer
        timings = app.store.get(app.conversation.id).messages[-1].timings
        assert timings["generated_tokens"] > 0 and timings["prompt_tokens"] > 16

        await pilot.press("ctrl+r")  # the same prompt again: its full blocks come from the prefix cache
        await wait_for(pilot, lambda: len(daemon_requests_done(daemon)) and not app.generating
                       and answers(app) and answers(app)[0] is not first and answers(app)[0].timings)
        again = app.store.get(app.conversation.id).messages[-1]
        assert again.content == first.content  # greedy: the same answer
        assert again.timings["cached_prompt_tokens"] >= 16, again.timings
        assert "cached" in str(answers(app)[0].footer.render())


def daemon_requests_done(daemon) -> list:
    return [1] * daemon.stats()["requests_finished_total"]


async def test_escape_aborts_the_request_on_the_real_daemon(daemon, tmp_path):
    aborts_before = daemon.stats().get("server", {}).get("aborts", {}).get("disconnect", 0)
    # far more tokens than the daemon makes before the Escape lands (400 were done first on a 2-core Zen 5 under the
    # suite's load); greedy, this prompt runs past 6,000 tokens without an end of turn
    app = chat_app(daemon, tmp_path, temperature=0.0, max_tokens=4000)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "connected" in str(app.query_one("#status").render()))
        await ask(pilot, "Write a very long story about a dragon.")
        await wait_for(pilot, lambda: answers(app) and len(answers(app)[0].content) > 20)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        assert "stopped" in str(answers(app)[0].footer.render())
    stats = daemon.wait_idle(timeout=30)
    assert stats["requests_running"] == 0
    assert stats.get("server", {}).get("aborts", {}).get("disconnect", 0) == aborts_before + 1


async def test_top_follows_the_real_daemon(daemon):
    app = TopApp(DaemonClient([Endpoint(port=daemon.port)]))
    async with app.run_test(size=SIZE) as pilot:
        view = app.query_one(TopView)
        await wait_for(pilot, lambda: len(view.history.series["tokens_per_second"]) >= 2, timeout=30)
        model = daemon.stats()["model"]
        assert model in str(app.query_one("#top-status").render())
        panels = [str(p.render()) for p in app.query(".model")]  # one per loaded model
        assert len(panels) == len(daemon.stats()["models"]) and model in panels[0], panels
        assert "KV blocks" in panels[0] and "8k-token sequences that fit" in panels[0]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_llmd_chat_in_a_real_terminal(daemon, tmp_path):
    session = f"llmd-tui-{os.getpid()}"
    env = dict(daemon.env, XDG_DATA_HOME=str(tmp_path / "data"), TERM="xterm-256color")
    tmux = ["tmux", "-L", session]  # a private tmux server: nothing shared with the user's

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_screen(text: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            shown = screen()
            if text in shown:
                return shown
            assert time.monotonic() < deadline, f"{text!r} never appeared:\n{shown}"
            time.sleep(0.3)

    # A saved chat whose settings (persisted per conversation) keep the answer short; `llmd chat` opens it.
    store = ChatStore(tmp_path / "data" / "llmd" / "chat.sqlite3")
    store.create("France", temperature=0.0, max_tokens=24)
    store.close()
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                    "env", *[f"{k}={v}" for k, v in env.items() if k.startswith(("XDG_", "PATH", "HOME", "TERM"))],
                    llmd_exe(), "chat"], check=True)
    try:
        wait_screen("connected", timeout=60)
        subprocess.run([*tmux, "send-keys", "-t", session, "-l", QUESTION], check=True)
        subprocess.run([*tmux, "send-keys", "-t", session, "Enter"], check=True)
        wait_screen("Paris")  # streamed in
        shown = wait_screen("tok/s")  # the timings line comes with the end of the answer
        assert "Paris" in shown and "TTFT" in shown, shown
        subprocess.run([*tmux, "send-keys", "-t", session, "C-q"], check=True)
        deadline = time.monotonic() + 20
        while subprocess.run([*tmux, "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "Ctrl+Q did not quit"
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    # the exchange was saved under the XDG data dir
    saved = ChatStore(tmp_path / "data" / "llmd" / "chat.sqlite3").list()[0]
    assert [m.role for m in ChatStore(tmp_path / "data" / "llmd" / "chat.sqlite3").get(saved.id).messages] == [
        "user", "assistant"]


@pytest.fixture(scope="module")
def two_model_daemon(tmp_path_factory, tiny_qwen2, smollm2_gguf):
    """The bundled SmolLM2 (loaded at start) and, in the config, a tiny model and a GGUF cut after 1 MiB (its
    header reads, its load fails)."""
    base = tmp_path_factory.mktemp("llmd_tui_models")
    broken = base / "broken.gguf"
    with open(smollm2_gguf, "rb") as src:
        broken.write_bytes(src.read(1 << 20))
    (base / "config" / "llmd").mkdir(parents=True)
    (base / "config" / "llmd" / "config.toml").write_text(
        f'[models.tiny]\npath = "{tiny_qwen2}"\n\n[models.broken]\npath = "{broken}"\n')
    d = start_daemon(base, "--kv-cache-bytes", str(48 << 20))
    yield d
    d.stop()


def picker_rows(screen) -> list[str]:
    options = screen.query_one("#models")
    return [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]


async def test_model_picker_lists_loads_and_reports_a_failed_load(two_model_daemon, tiny_qwen2, tmp_path):
    """Ctrl+L lists every servable model with where it lives and whether it is loaded; picking a cold one loads it
    on the daemon, and the chat then answers with it; a model that fails to load shows the
    daemon's reason and the picker stays open."""
    from llmd.tui.screens import ModelPicker

    d = two_model_daemon
    app = chat_app(d, tmp_path, temperature=0.0, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "connected" in str(app.query_one("#status").render()))
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.entries)
        picker = app.screen
        rows = {e.name: e for e in picker.entries}
        bundled = d.stats()["model"]
        assert rows[bundled].loaded and rows[bundled].source == "bundled" and rows[bundled].size > 0
        assert not rows["tiny"].loaded and rows["tiny"].source == "config" and rows["tiny"].where == str(tiny_qwen2)
        shown = picker_rows(picker)
        assert shown[0].startswith("●") and bundled in shown[0]  # loaded first, marked
        assert any(r.startswith(" ") and "tiny" in r and "config" in r for r in shown), shown

        # a load that fails: the daemon's reason, and the list stays open
        picker.query_one("#models").highlighted = [e.name for e in picker.entries].index("broken")
        await pilot.press("enter")
        await wait_for(pilot, lambda: "did not load" in str(picker.query_one("#error").render()))
        assert app.screen is picker and "broken" in str(picker.query_one("#error").render())

        # a cold model: loaded on selection (in milliseconds: its progress line is tested against a slow fake daemon,
        # test_tui_chat.py), then picked for this chat
        picker.query_one("#models").highlighted = [e.name for e in picker.entries].index("tiny")
        await pilot.press("enter")
        await wait_for(pilot, lambda: "tiny" in app.sub_title)
        assert app.conversation.model == "tiny"
        assert "tiny" in {m["name"] for m in d.get_json("/api/ps")[1]["models"]}

        await ask(pilot, QUESTION)
        await wait_for(pilot, lambda: answers(app) and not app.generating)
        saved = app.store.get(app.conversation.id).messages[-1]
        assert saved.role == "assistant" and saved.model == "tiny" and saved.timings["generated_tokens"] == 6

        # opened again: tiny is now loaded and the current one; Enter on it picks it at once
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.entries)
        assert {e.name: e for e in app.screen.entries}["tiny"].loaded
        assert any("tiny (this chat)" in r for r in picker_rows(app.screen))
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, ModelPicker) and "loaded" in str(
            app.query_one("#status").render()))
        assert app.conversation.model == "tiny"
