"""Pilot tests of `llmd chat` against a small in-test daemon (to force slowness, errors and disconnects)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmd.tui.chat_app import ChatApp
from llmd.tui.client import DaemonClient, Endpoint
from llmd.tui.screens import Confirm, HelpScreen, SettingsScreen, StartDaemonScreen, TextPrompt
from llmd.tui.store import ChatStore
from llmd.tui.top_app import TopScreen, TopView
from llmd.tui.widgets import MessageView, PromptInput
from tui_fake_daemon import ANSWER, FakeDaemon, free_port

SIZE = (110, 40)


@pytest.fixture
def fake():
    daemon = FakeDaemon().start()
    yield daemon
    daemon.stop()


def make_app(daemon: FakeDaemon, tmp_path, **kwargs) -> ChatApp:
    return ChatApp(DaemonClient([Endpoint(port=daemon.port)]), ChatStore(tmp_path / "chat.db"),
                   export_dir=tmp_path, **kwargs)


async def wait_for(pilot, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.05)


async def connected(pilot):
    await wait_for(pilot, lambda: "connected" in str(pilot.app.query_one("#status").render()))


async def send(pilot, text: str):
    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.insert(text)
    await pilot.press("enter")


def answers(app) -> list[MessageView]:
    return [v for v in app.query(MessageView) if v.role == "assistant"]


async def answered(pilot, count=1):
    await wait_for(pilot, lambda: len(answers(pilot.app)) >= count and not pilot.app.generating)
    await pilot.pause()


async def test_send_streams_markdown_with_timings_and_persists(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "write add()")
        await answered(pilot)
        view = answers(app)[0]
        assert view.content == ANSWER
        # the final render is complete: the code block is there with its code
        fences = view.body.query("MarkdownFence")
        assert len(fences) == 1 and "return a + b" in fences[0].code
        footer = str(view.footer.render())
        assert "TTFT 22 ms" in footer and "80.0 tok/s" in footer and "cached 32/40 prompt tokens" in footer
        assert "spec" not in footer  # speculation off: not shown
        assert app.query_one(PromptInput).text == ""
        conv = app.store.get(app.conversation.id)
        assert [m.role for m in conv.messages] == ["user", "assistant"]
        assert conv.messages[1].timings["generated_tokens"] > 0 and conv.title == "write add()"
        assert fake.requests[0]["messages"] == [{"role": "user", "content": "write add()"}]


async def test_speculative_acceptance_is_shown_when_on(fake, tmp_path):
    fake.behaviour.spec = True
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "hi")
        await answered(pilot)
        assert "spec 15/20 accepted (75%)" in str(answers(app)[0].footer.render())


async def test_shift_enter_and_ctrl_j_insert_newlines(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        app.query_one(PromptInput).focus()
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert app.query_one(PromptInput).text == "a\nb\nc"
        assert not fake.requests
        await pilot.press("enter")
        await answered(pilot)
        assert fake.requests[0]["messages"][-1]["content"] == "a\nb\nc"


async def test_escape_stops_and_aborts_on_the_daemon(fake, tmp_path):
    fake.behaviour.delay_s = 0.1
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "long answer please")
        await wait_for(pilot, lambda: answers(app) and len(answers(app)[0].content) >= 12)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        assert await asyncio.to_thread(fake.aborted.wait, 5), "the daemon never saw the abort"
        view = answers(app)[0]
        assert "stopped" in str(view.footer.render())
        assert 0 < len(view.content) < len(ANSWER) and fake.finished_requests == 0
        # the partial answer is kept
        assert app.store.get(app.conversation.id).messages[-1].content == view.content


async def test_ctrl_r_regenerates_the_last_answer(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "hello")
        await answered(pilot)
        fake.behaviour.answer = "A second, different answer."
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(fake.requests) == 2 and not app.generating)
        await pilot.pause()
        assert fake.requests[1]["messages"] == [{"role": "user", "content": "hello"}]
        assert [v.content for v in answers(app)] == ["A second, different answer."]
        assert [m.content for m in app.store.get(app.conversation.id).messages] == [
            "hello", "A second, different answer."]


async def test_daemon_dying_mid_answer_shows_a_message_and_retry_works(fake, tmp_path):
    fake.behaviour.die_after_chunks = 3
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "hello")
        await wait_for(pilot, lambda: answers(app) and answers(app)[0].has_class("failed"))
        footer = str(answers(app)[0].footer.render())
        assert "in the middle of the answer" in footer and "Ctrl+R" in footer
        assert app.is_running
        assert [m.role for m in app.store.get(app.conversation.id).messages] == ["user"]  # no half answer saved
        fake.behaviour.die_after_chunks = None
        await pilot.press("ctrl+r")
        await answered(pilot)
        await wait_for(pilot, lambda: answers(app)[-1].content == ANSWER)
        assert len(answers(app)) == 1 and not answers(app)[0].has_class("failed")


async def test_daemon_gone_entirely_then_back(tmp_path):
    port = free_port()
    daemon = FakeDaemon(port=port).start()
    app = make_app(daemon, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        daemon.stop()
        await send(pilot, "anyone there?")
        await wait_for(pilot, lambda: answers(app) and answers(app)[0].has_class("failed"))
        assert "Ctrl+R" in str(answers(app)[0].footer.render())
        daemon = FakeDaemon(port=port).start()
        try:
            await pilot.press("ctrl+r")
            await answered(pilot)
            await wait_for(pilot, lambda: answers(app)[-1].content == ANSWER)
        finally:
            daemon.stop()


async def test_daemon_errors_are_shown(fake, tmp_path):
    fake.behaviour.error_status = 429
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: answers(app) and answers(app)[0].has_class("failed"))
        assert "waiting queue is full (HTTP 429)" in str(answers(app)[0].footer.render())


async def test_sidebar_new_rename_search_delete_export(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "first chat about cats")
        await answered(pilot)
        first_id = app.conversation.id
        await pilot.press("ctrl+n")
        assert app.conversation is None and not app.query(MessageView)
        await send(pilot, "second chat about dogs")
        await answered(pilot)
        titles = lambda: [str(item.query_one("Label").render()) for item in app.query("ConversationItem")]
        assert titles() == ["second chat about dogs", "first chat about cats"]

        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPrompt))
        app.screen.query_one("Input").value = ""
        await pilot.press(*"Dogs", "enter")
        await wait_for(pilot, lambda: titles()[0] == "Dogs")
        assert app.store.get(app.conversation.id).title == "Dogs"

        await pilot.press("ctrl+f", *"cats")
        await wait_for(pilot, lambda: titles() == ["first chat about cats"])
        await pilot.press("enter", "enter")  # to the list, open the one hit
        await wait_for(pilot, lambda: app.conversation and app.conversation.id == first_id)
        assert app.query(MessageView)[0].content == "first chat about cats"

        await pilot.press("ctrl+e")
        exported = list(tmp_path.glob("llmd-chat-*.md"))
        assert len(exported) == 1
        text = exported[0].read_text()
        assert "first chat about cats" in text and "return a + b" in text

        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("y")
        await wait_for(pilot, lambda: [c.title for c in app.store.list()] == ["Dogs"])
        app.query_one("#search").value = ""
        await wait_for(pilot, lambda: titles() == ["Dogs"])


async def test_settings_persist_and_shape_requests(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        screen = app.screen
        select = screen.query_one("#model")
        assert [str(o[0]) for o in select._options[1:]] == ["fake-model", "other-model"]  # from /v1/models
        select.value = "other-model"
        screen.query_one("#system").text = "Answer in French."
        screen.query_one("#temperature").value = "abc"
        await pilot.press("ctrl+s")
        assert "temperature must be a number" in str(screen.query_one("#error").render())
        screen.query_one("#temperature").value = "0.4"
        screen.query_one("#max_tokens").value = "33"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        conv = app.store.get(app.conversation.id)
        assert (conv.model, conv.system_prompt, conv.temperature, conv.max_tokens) == (
            "other-model", "Answer in French.", 0.4, 33)
        await send(pilot, "hi")
        await answered(pilot)
        body = fake.requests[0]
        assert body["model"] == "other-model" and body["temperature"] == 0.4 and body["max_tokens"] == 33
        assert body["messages"][0] == {"role": "system", "content": "Answer in French."}
        assert "other-model" in app.sub_title


async def test_copy_message_and_code_block(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "code please")
        await answered(pilot)
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWER
        answers(app)[0].focus()
        await pilot.press("c")
        assert app.clipboard == "def add(a, b):\n    return a + b"
        app.query(MessageView)[0].focus()
        await pilot.press("y")
        assert app.clipboard == "code please"


async def test_help_palette_dashboard_and_quit(fake, tmp_path):
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert "Ctrl+R" in app.screen.query_one("Markdown").source
        await pilot.press("escape")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "CommandPalette")
        await pilot.press(*"new chat")
        await pilot.pause(0.5)
        await pilot.press("escape")
        await wait_for(pilot, lambda: type(app.screen).__name__ != "CommandPalette")
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: isinstance(app.screen, TopScreen))
        view = app.screen.query_one(TopView)
        await wait_for(pilot, lambda: len(view.history.series["tokens_per_second"]) >= 2)
        assert "running" in str(app.screen.query_one("#numbers").render())
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, TopScreen))
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)


async def test_no_daemon_offers_to_start_one_and_shows_loading(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    port = free_port()
    script = [sys.executable, str(Path(__file__).parent / "tui_fake_daemon.py"), "--port", str(port), "--loading-s", "3"]
    app = ChatApp(DaemonClient([Endpoint(port=port)]), ChatStore(tmp_path / "chat.db"), serve_command=script)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, StartDaemonScreen))
            await pilot.pause()
            assert f"127.0.0.1:{port}" in str(app.screen.query_one("#question").render())
            await pilot.click("#start")
            await wait_for(pilot, lambda: "loading the model" in str(app.screen.query_one("#progress").render()))
            await connected(pilot)
            assert app.daemon_process is not None and app.daemon_process.poll() is None
            assert (tmp_path / "state" / "llmd" / "daemon.log").exists()
            await send(pilot, "hi")
            await answered(pilot)
    finally:
        if app.daemon_process is not None:
            app.daemon_process.terminate()
            app.daemon_process.wait(10)


async def test_no_daemon_and_the_user_declines(tmp_path):
    app = ChatApp(DaemonClient([Endpoint(port=free_port())]), ChatStore(tmp_path / "chat.db"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, StartDaemonScreen))
        await pilot.pause()
        await pilot.click("#quit")
        await wait_for(pilot, lambda: not app.is_running)


HEAVY_MODULES = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "gguf", "triton", "PIL",
                 "huggingface_hub", "llguidance")


def test_tui_starts_without_the_engine_stack():
    """The TUI starts fast because it imports none of the engine's libraries (torch alone is seconds of CPU); a
    module list rather than a time limit, which a busy shared machine would trip."""
    code = ("import sys; import llmd.tui.chat_app, llmd.tui.top_app, llmd.tui.launcher; llmd.tui.launcher.make_client();"
            f" print(' '.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [], f"the TUI pulled in {', '.join(out)}"


async def test_model_picker_loads_on_selection_with_progress_and_errors(fake, tmp_path):
    from llmd.tui.screens import ModelPicker

    fake.behaviour.models = ["fake-model", "other-model", "broken-model"]
    fake.behaviour.load_errors = {"broken-model": "not enough memory"}
    fake.behaviour.load_gate = loaded = threading.Event()  # each load waits for the test to have seen its progress
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.entries)
        picker = app.screen
        assert [(e.name, e.loaded) for e in picker.entries] == [
            ("fake-model", True), ("other-model", False), ("broken-model", False)]
        options = picker.query_one("#models")
        options.highlighted = 2
        await pilot.press("enter")
        await wait_for(pilot, lambda: "loading broken-model" in str(picker.query_one("#progress").render()))
        loaded.set()
        await wait_for(pilot, lambda: "did not load" in str(picker.query_one("#error").render()))
        assert "not enough memory" in str(picker.query_one("#error").render()) and app.screen is picker
        options.highlighted = 1
        loaded.clear()
        await pilot.press("enter")
        await wait_for(pilot, lambda: "loading other-model" in str(picker.query_one("#progress").render()))
        loaded.set()
        await wait_for(pilot, lambda: "other-model" in app.sub_title)
        assert app.default_model == "other-model" and not isinstance(app.screen, ModelPicker)
        await send(pilot, "hi")
        await answered(pilot)
        assert fake.requests[-1]["model"] == "other-model"
        await pilot.press("ctrl+l")  # Esc keeps the model
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.entries)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ModelPicker))
        assert app.conversation.model == "other-model"


async def test_image_attached_with_slash_image_goes_with_the_next_message(fake, tmp_path):
    from PIL import Image

    picture = tmp_path / "cat.png"
    Image.new("RGB", (8, 8), (10, 20, 30)).save(picture)
    app = make_app(fake, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(pilot)
        await send(pilot, "/image /no/such/file.png")
        await send(pilot, f"/image {picture}")
        assert not fake.requests  # attaching sends nothing
        await send(pilot, "what is this?")
        await answered(pilot)
        (image_part, text_part) = fake.requests[0]["messages"][0]["content"]
        assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("data:image/")
        assert text_part == {"type": "text", "text": "what is this?"}
        await send(pilot, "and now?")  # the image stays with its own message only, also after a restart
        await answered(pilot, 2)
        second = fake.requests[1]["messages"]
        assert isinstance(second[0]["content"], list) and second[2] == {"role": "user", "content": "and now?"}
        assert app.store.get(app.conversation.id).messages[0].images == [str(picture.resolve())]
