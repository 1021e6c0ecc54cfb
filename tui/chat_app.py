"""`llmd chat`: a Textual chat with the daemon. It only speaks HTTP (see client.py) and never imports torch."""

from __future__ import annotations

import asyncio
import base64
import subprocess
from contextlib import aclosing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ListItem, ListView, Static
from textual.worker import Worker, WorkerState

from .client import ChatRequest, DaemonClient, DaemonError, DaemonUnavailable
from .launcher import DaemonStartFailed, daemon_log_path, serve_argv, spawn_daemon, wait_until_ready
from .screens import ChatSettings, Confirm, HelpScreen, ModelPicker, SettingsScreen, StartDaemonScreen, TextPrompt
from .store import DEFAULT_TITLE, ChatStore, Conversation, Message
from .top_app import TopScreen
from .widgets import MessageView, PromptInput

TITLE_CHARS = 40


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation):
        super().__init__(Label(conversation.title), id=f"conv-{conversation.id}")
        self.conversation_id = conversation.id


class ChatApp(App):
    TITLE = "llmd chat"
    # Inline rather than a .tcss file, so a wheel needs no package data.
    CSS = """
    #sidebar { width: 30; border-right: solid $primary-darken-2; }
    #sidebar Input { margin: 0 0 1 0; }
    #conversations { height: 1fr; }
    #main { width: 1fr; }
    #messages { height: 1fr; padding: 0 1; }
    #prompt { height: 5; border: round $accent; }
    #status { height: 1; color: $text-muted; padding: 0 1; }
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView:focus { background: $boost; }
    MessageView.user { border-left: thick $accent; }
    MessageView.assistant { border-left: thick $success; }
    MessageView.failed { border-left: thick $error; }
    MessageView .role { color: $text-muted; text-style: bold; }
    MessageView .body { margin: 0; padding: 0; }
    MessageView .timings { color: $text-muted; }
    MessageView.failed .timings { color: $error; }
    .dialog { width: 60; height: auto; max-height: 90%; border: thick $primary; background: $surface; padding: 1 2; }
    .dialog.wide { width: 80; }
    .dialog.picker { width: 96; max-width: 100%; }
    .dialog TextArea { height: 6; }
    .dialog .buttons { height: auto; margin-top: 1; }
    .dialog .error { color: $error; }
    ModalScreen { align: center middle; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop", show=False),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+l", "pick_model", "Model"),
        Binding("ctrl+o", "settings", "Settings"),
        Binding("ctrl+f", "search", "Search", show=False),
        Binding("f2", "rename", "Rename", show=False),
        # priority: the prompt box (a TextArea) would otherwise take these as delete-right, end-of-line and redo;
        # Delete, End and Ctrl+Z still do those there.
        Binding("ctrl+d", "delete", "Delete", show=False, priority=True),
        Binding("ctrl+e", "export", "Export", show=False, priority=True),
        Binding("ctrl+y", "copy_last", "Copy answer", show=False, priority=True),
        Binding("ctrl+t", "top", "Dashboard"),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", show=False),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        client: DaemonClient,
        store: ChatStore,
        model: str | None = None,
        auto_start: bool = False,
        serve_command: list[str] | None = None,
        export_dir: Path | None = None,
    ):
        super().__init__()
        self.client = client
        self.store = store
        self.default_model = model
        self.auto_start = auto_start
        self.serve_command = serve_command or serve_argv(model)
        self.export_dir = export_dir or Path.cwd()
        self.conversation: Conversation | None = None
        self.models: list[str] = []
        self.daemon_process: subprocess.Popen | None = None
        self._generation: Worker | None = None
        self._attached: list[str] = []  # image files `/image PATH` attached to the next message

    # --- layout -------------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Input(placeholder="search chats (Ctrl+F)", id="search")
                yield ListView(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)
                yield Static("", id="status")
        yield Footer()

    async def on_mount(self) -> None:
        await self.refresh_sidebar()
        recent = self.store.list()
        if recent:
            await self.open_conversation(recent[0].id)
        else:
            self.update_subtitle()
        self.query_one("#prompt").focus()
        self.connect()

    @property
    def messages_view(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    def update_subtitle(self) -> None:
        conv = self.conversation
        model = (conv.model if conv and conv.model else None) or self.default_model or "daemon default"
        self.sub_title = f"{conv.title if conv else DEFAULT_TITLE} · {model}"

    # --- the daemon ---------------------------------------------------------------------------------------------

    @work(exclusive=True, group="connect")
    async def connect(self) -> None:
        try:
            health = await self.client.health()
        except DaemonUnavailable:
            ready = await self.push_screen_wait(StartDaemonScreen(self.client.describe(), self.auto_start))
            if not ready:
                self.exit(message="No llmd daemon: start one with `llmd serve` or `llmd chat --start`.")
                return
            health = await self.client.health()
        if health.get("status") != "ok":
            await wait_until_ready(self.client, None, lambda s, t: self.set_status(f"daemon: {s} the model… {t:.0f} s"))
        await self.load_models()
        health = await self.client.health()
        self.set_status(f"connected · daemon model {health.get('model', '?')}")

    async def load_models(self) -> None:
        try:
            self.models = await self.client.models()
        except (DaemonUnavailable, DaemonError) as exc:
            self.set_status(f"could not list models: {exc}")

    @work(exclusive=True, group="launch")
    async def start_daemon(self, screen: StartDaemonScreen) -> None:
        log_path = daemon_log_path()
        try:
            self.daemon_process = spawn_daemon(self.serve_command, log_path)
            await wait_until_ready(self.client, self.daemon_process, screen.progress, log_path=log_path)
        except (DaemonStartFailed, OSError) as exc:
            screen.failed(str(exc))
            return
        screen.dismiss(True)

    # --- conversations ------------------------------------------------------------------------------------------

    async def refresh_sidebar(self) -> None:
        search = self.query_one("#search", Input).value
        listing = self.query_one("#conversations", ListView)
        await listing.clear()
        items = [ConversationItem(c) for c in self.store.list(search)]
        await listing.extend(items)
        if self.conversation:
            for index, item in enumerate(items):
                if item.conversation_id == self.conversation.id:
                    listing.index = index

    async def open_conversation(self, conversation_id: int | None) -> None:
        self.action_stop()
        view = self.messages_view
        await view.remove_children()
        self.conversation = self.store.get(conversation_id) if conversation_id is not None else None
        if self.conversation:
            await view.mount_all(
                MessageView(m.role, m.content, m.timings) for m in self.conversation.messages if m.role != "system"
            )
            view.scroll_end(animate=False)
        self.update_subtitle()

    @on(ListView.Selected, "#conversations")
    async def on_conversation_selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ConversationItem):
            if not self.conversation or event.item.conversation_id != self.conversation.id:
                await self.open_conversation(event.item.conversation_id)
            self.query_one("#prompt").focus()

    @on(Input.Changed, "#search")
    async def on_search(self) -> None:
        await self.refresh_sidebar()

    @on(Input.Submitted, "#search")
    def on_search_submitted(self) -> None:
        listing = self.query_one("#conversations", ListView)
        if listing.index is None and listing.children:
            listing.index = 0  # Enter again opens the first hit
        listing.focus()

    def action_search(self) -> None:
        self.query_one("#sidebar").display = True
        self.query_one("#search").focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    async def action_new_chat(self) -> None:
        await self.open_conversation(None)
        await self.refresh_sidebar()
        self.query_one("#prompt", PromptInput).clear()
        self.query_one("#prompt").focus()

    @work(exclusive=True, group="dialog")
    async def action_rename(self) -> None:
        if not self.conversation:
            self.notify("Nothing to rename yet: send a message first", severity="warning")
            return
        title = await self.push_screen_wait(TextPrompt("Rename this chat", self.conversation.title))
        if title is not None:
            self.store.rename(self.conversation.id, title)
            self.conversation = self.store.get(self.conversation.id)
            self.update_subtitle()
            await self.refresh_sidebar()

    @work(exclusive=True, group="dialog")
    async def action_delete(self) -> None:
        if not self.conversation:
            return
        if await self.push_screen_wait(Confirm(f"Delete “{self.conversation.title}”?")):
            self.store.delete(self.conversation.id)
            remaining = self.store.list()
            await self.open_conversation(remaining[0].id if remaining else None)
            await self.refresh_sidebar()
            self.notify("Chat deleted")

    def action_export(self) -> None:
        if not self.conversation:
            self.notify("Nothing to export yet", severity="warning")
            return
        path = self.export_path(self.conversation)
        path.write_text(self.store.export_markdown(self.conversation.id), encoding="utf-8")
        self.notify(f"Exported to {path}")

    def export_path(self, conversation: Conversation) -> Path:
        slug = "".join(ch if ch.isalnum() else "-" for ch in conversation.title.lower()).strip("-")[:40] or "chat"
        return self.export_dir / f"llmd-chat-{conversation.id}-{slug}.md"

    @work(exclusive=True, group="dialog")
    async def action_settings(self) -> None:
        if not self.models:
            await self.load_models()
        conv = self.conversation
        current = ChatSettings(
            model=(conv.model if conv else None) or self.default_model,
            system_prompt=conv.system_prompt if conv else "",
            temperature=conv.temperature if conv else None,
            max_tokens=conv.max_tokens if conv else None,
        )
        chosen = await self.push_screen_wait(SettingsScreen(current, self.models))
        if chosen is None:
            return
        if self.conversation is None:
            self.conversation = self.store.create()
        self.store.update_settings(self.conversation.id, model=chosen.model, system_prompt=chosen.system_prompt,
                                   temperature=chosen.temperature, max_tokens=chosen.max_tokens)
        self.conversation = self.store.get(self.conversation.id)
        self.update_subtitle()
        await self.refresh_sidebar()

    @work(exclusive=True, group="dialog")
    async def action_pick_model(self) -> None:
        """The model picker: the chosen model (loaded by the picker) answers this chat from now on."""
        conv = self.conversation
        current = (conv.model if conv else None) or self.default_model
        chosen = await self.push_screen_wait(ModelPicker(self.client, current))
        if chosen is None:
            return
        if conv is None:
            self.default_model = chosen  # the next chat is created with it
        else:
            self.store.update_settings(conv.id, model=chosen, system_prompt=conv.system_prompt,
                                       temperature=conv.temperature, max_tokens=conv.max_tokens)
            self.conversation = self.store.get(conv.id)
        self.update_subtitle()
        self.set_status(f"model {chosen} · loaded")
        self.query_one("#prompt").focus()

    # --- chatting -----------------------------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        if self.generating:
            self.notify("Still answering: Esc stops it", severity="warning")
            return
        self.query_one("#prompt", PromptInput).clear()
        if event.text.startswith("/image "):  # attach an image to the next message
            path = Path(event.text[len("/image "):].strip()).expanduser()
            if not path.is_file():
                self.notify(f"no such image file: {path}", severity="error")
                return
            self._attached.append(str(path.resolve()))
            self.notify(f"attached {path.name}: it goes with your next message")
            return
        if self.conversation is None:
            self.conversation = self.store.create(title=_title_from(event.text), model=self.default_model)
        elif self.conversation.title == DEFAULT_TITLE and not self.conversation.messages:
            self.store.rename(self.conversation.id, _title_from(event.text))
        images, self._attached = self._attached or None, []
        self.store.add_message(self.conversation.id, Message("user", event.text, images=images))
        self.conversation = self.store.get(self.conversation.id)
        await self.messages_view.mount(MessageView("user", event.text))
        self.update_subtitle()
        await self.refresh_sidebar()
        await self.generate()

    @property
    def generating(self) -> bool:
        return self._generation is not None and self._generation.state in (WorkerState.PENDING, WorkerState.RUNNING)

    async def generate(self) -> None:
        assert self.conversation is not None
        view = MessageView("assistant")
        await self.messages_view.mount(view)
        view.start_stream()
        self.messages_view.scroll_end(animate=False)
        self._generation = self.run_worker(self._stream_answer(self.conversation, view), group="generate")

    async def _stream_answer(self, conv: Conversation, view: MessageView) -> None:
        messages = ([{"role": "system", "content": conv.system_prompt}] if conv.system_prompt else []) + [
            {"role": m.role, "content": _content(m)} for m in conv.messages
        ]
        request = ChatRequest(messages, model=conv.model, temperature=conv.temperature, max_tokens=conv.max_tokens)
        timings: dict[str, Any] | None = None
        model = conv.model
        self.set_status("answering… (Esc stops)")
        try:
            # aclosing: a cancelled worker (Esc) closes the stream at once, which closes the HTTP response.
            async with aclosing(self.client.chat_stream(request)) as stream:
                async for chunk in stream:
                    if chunk.text:
                        await view.append(chunk.text)
                        if self.messages_view.max_scroll_y - self.messages_view.scroll_y < 3:
                            self.messages_view.scroll_end(animate=False)
                    timings = chunk.timings or timings
                    model = chunk.model or model
        except asyncio.CancelledError:
            # Esc: leaving the stream closed the HTTP response, so the daemon aborts the request. Keep what came.
            await view.finish(None, note="stopped")
            if view.content:
                self.store.add_message(conv.id, Message("assistant", view.content, model=model))
            self.set_status("stopped")
            raise
        except DaemonUnavailable as exc:
            await view.fail(f"{exc}. When it is back, Ctrl+R retries.")
            self.set_status("the daemon is not answering — Ctrl+R retries")
            return
        except DaemonError as exc:
            await view.fail(f"the daemon refused: {exc}. Ctrl+R retries.")
            self.set_status("error — Ctrl+R retries")
            return
        await view.finish(timings)
        self.store.add_message(conv.id, Message("assistant", view.content, timings=timings, model=model))
        self.set_status("")
        self.messages_view.scroll_end(animate=False)

    def action_stop(self) -> None:
        if self.generating:
            self._generation.cancel()

    async def action_regenerate(self) -> None:
        if self.generating or self.conversation is None:
            return
        views = list(self.messages_view.query(MessageView))
        if views and views[-1].role == "assistant":
            await views[-1].remove()
        conv = self.store.get(self.conversation.id)
        if conv.messages and conv.messages[-1].role == "assistant":
            self.store.delete_message(conv.messages[-1].id)
            conv = self.store.get(conv.id)
        if not conv.messages:
            return
        self.conversation = conv
        await self.generate()

    def action_copy_last(self) -> None:
        answers = [v for v in self.messages_view.query(MessageView) if v.role == "assistant" and v.content]
        if answers:
            answers[-1].action_copy_message()

    # --- other screens ------------------------------------------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_top(self) -> None:
        self.push_screen(TopScreen(self.client))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation", self.action_new_chat)
        yield SystemCommand("Pick a model", "Every model the daemon can serve; picking loads it",
                            self.action_pick_model)
        yield SystemCommand("Chat settings", "Model, system prompt, temperature, max tokens", self.action_settings)
        yield SystemCommand("Rename chat", "Give this conversation a title", self.action_rename)
        yield SystemCommand("Delete chat", "Delete this conversation", self.action_delete)
        yield SystemCommand("Export chat", "Write this conversation to a Markdown file", self.action_export)
        yield SystemCommand("Regenerate", "Answer the last message again", self.action_regenerate)
        yield SystemCommand("Copy last answer", "Copy the last answer to the clipboard", self.action_copy_last)
        yield SystemCommand("Engine dashboard", "Live engine stats (llmd top)", self.action_top)
        yield SystemCommand("Keys", "Show every key", self.action_help)

    async def on_unmount(self) -> None:
        await self.client.close()
        self.store.close()


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def _content(message: Message) -> str | list[dict[str, Any]]:
    """A stored message as the chat API takes it: its text, after its images (read from their files now; a file gone
    since is left out)."""
    parts: list[dict[str, Any]] = []
    for path in message.images or []:
        try:
            data = base64.b64encode(Path(path).read_bytes()).decode()
        except OSError:
            continue
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/*;base64,{data}"}})
    return parts + [{"type": "text", "text": message.content}] if parts else message.content
