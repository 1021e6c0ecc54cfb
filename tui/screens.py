"""Modal screens of `llmd chat`: help, rename, confirm, per-conversation settings, the model picker, and starting a
daemon."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, LoadingIndicator, Markdown, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from .client import DaemonError, DaemonUnavailable, ModelEntry

if TYPE_CHECKING:
    from .client import DaemonClient

WHERE_CHARS = 30

KEYS_HELP = """\
# llmd chat — keys

| key | does |
|---|---|
| Enter | send the message |
| Shift+Enter, Ctrl+J | new line in the message |
| /image PATH (sent as a message) | attach an image to your next message (a model that sees images) |
| Esc | stop the answer (aborts it on the daemon) |
| Ctrl+R | regenerate the last answer (or retry after an error) |
| Ctrl+N | new chat |
| Ctrl+P | command palette |
| Ctrl+L | pick a model: every one the daemon can serve; picking loads it |
| Ctrl+O | settings of this chat: model, system prompt, temperature, max tokens |
| Ctrl+F | search conversations |
| F2 | rename this chat |
| Ctrl+D | delete this chat |
| Ctrl+E | export this chat to Markdown |
| Ctrl+Y | copy the last answer |
| Tab, then y / c | on a focused message: copy it / copy its code block (c again: the next block) |
| Ctrl+T | engine dashboard (`llmd top`) |
| Ctrl+B | show or hide the sidebar |
| F1 | this help |
| Ctrl+Q | quit |
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Markdown(KEYS_HELP)
            yield Static("Esc closes", classes="hint")


class TextPrompt(ModalScreen[str | None]):
    """Ask for one line of text (rename)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            yield Input(self.value, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    BINDINGS = [Binding("escape,n", "answer(False)", "No"), Binding("y", "answer(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


@dataclass
class ChatSettings:
    model: str | None
    system_prompt: str
    temperature: float | None
    max_tokens: int | None


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Model, system prompt, temperature and max tokens of one conversation. Ctrl+S saves, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, current: ChatSettings, models: list[str]):
        super().__init__()
        self.current = current
        self.models = list(models)
        if current.model and current.model not in self.models:
            self.models.insert(0, current.model)

    def compose(self) -> ComposeResult:
        c = self.current
        with Vertical(classes="dialog wide"):
            yield Label("Model")
            yield Select([(m, m) for m in self.models], value=c.model if c.model else Select.NULL,
                         prompt="daemon default", id="model")
            yield Label("System prompt")
            yield TextArea(c.system_prompt, id="system")
            yield Label("Temperature (empty: the daemon's default)")
            yield Input("" if c.temperature is None else f"{c.temperature:g}", id="temperature")
            yield Label("Max tokens (empty: the daemon's default)")
            yield Input("" if c.max_tokens is None else str(c.max_tokens), id="max_tokens")
            yield Static("", id="error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save (Ctrl+S)", id="save", variant="primary")
                yield Button("Cancel (Esc)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            settings = self._read()
        except ValueError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        self.dismiss(settings)

    def _read(self) -> ChatSettings:
        model = self.query_one("#model", Select).value
        temperature_text = self.query_one("#temperature", Input).value.strip()
        max_tokens_text = self.query_one("#max_tokens", Input).value.strip()
        temperature = None
        if temperature_text:
            try:
                temperature = float(temperature_text)
            except ValueError:
                raise ValueError(f"temperature must be a number, not {temperature_text!r}") from None
            if not 0 <= temperature <= 2:
                raise ValueError("temperature must be between 0 and 2")
        max_tokens = None
        if max_tokens_text:
            if not max_tokens_text.isdigit() or int(max_tokens_text) < 1:
                raise ValueError(f"max tokens must be a positive whole number, not {max_tokens_text!r}")
            max_tokens = int(max_tokens_text)
        return ChatSettings(
            model=None if model is Select.NULL else str(model),
            system_prompt=self.query_one("#system", TextArea).text,
            temperature=temperature,
            max_tokens=max_tokens,
        )


def model_row(entry: ModelEntry, current: str | None) -> str:
    """One picker line: loaded mark, name, where it comes from, size, and where it lives (its tail)."""
    mark = "●" if entry.loaded else " "
    size = f"{entry.size / 2**20:.0f} MiB" if entry.size else ""
    where = entry.where if len(entry.where) <= WHERE_CHARS else "…" + entry.where[-(WHERE_CHARS - 1):]
    name = entry.name + (" (this chat)" if entry.name == current else "")
    return f"{mark} {name:<30} {entry.source:<9} {size:>9}  {where}"


class ModelPicker(ModalScreen[str | None]):
    """Every model the daemon can serve (as /v1/models lists them), loaded ones first and marked ●. Enter picks one:
    a model not loaded yet is loaded first, its progress shown here; a failure shows the daemon's reason and the
    list stays open. Dismisses the picked name, or None (Esc)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, client: DaemonClient, current: str | None):
        super().__init__()
        self.client, self.current = client, current
        self.entries: list[ModelEntry] = []
        self.loading: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog picker"):
            yield Label("Models the daemon can serve (● loaded). Enter picks one, loading it first; Esc cancels.")
            yield OptionList(id="models")
            yield LoadingIndicator(id="spinner")
            yield Static("", id="progress")
            yield Static("", id="error", classes="error")

    def on_mount(self) -> None:
        self.query_one("#spinner").display = False
        self.refresh_list()

    @work(exclusive=True, group="list")
    async def refresh_list(self) -> None:
        try:
            self.entries = await self.client.model_entries()
        except (DaemonUnavailable, DaemonError) as exc:
            self.query_one("#error", Static).update(f"could not list the models: {exc}")
            return
        options = self.query_one("#models", OptionList)
        options.clear_options()
        options.add_options([Option(model_row(e, self.current), id=e.name) for e in self.entries])
        names = [e.name for e in self.entries]
        options.highlighted = names.index(self.current) if self.current in names else 0 if names else None
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if self.loading is not None:
            return
        entry = next((e for e in self.entries if e.name == event.option.id), None)
        if entry is None:
            return
        if entry.loaded:
            self.dismiss(entry.name)
        else:
            self.load(entry.name)

    @work(exclusive=True, group="load")
    async def load(self, name: str) -> None:
        self.loading = name
        self.query_one("#error", Static).update("")
        self.query_one("#spinner").display = True
        progress = self.query_one("#progress", Static)
        started = time.monotonic()
        task = asyncio.ensure_future(self.client.load_model(name))
        try:
            while not task.done():
                progress.update(f"loading {name}… {time.monotonic() - started:.1f} s")
                await asyncio.wait({task}, timeout=0.2)
            task.result()
        except (DaemonUnavailable, DaemonError) as exc:
            self.query_one("#spinner").display = False
            progress.update("")
            self.query_one("#error", Static).update(f"{name} did not load: {exc}")
            self.loading = None
            self.query_one("#models", OptionList).focus()  # pick another
            return
        finally:
            task.cancel()  # Esc while loading: stop waiting (the daemon finishes the load by itself)
        self.dismiss(name)

    def action_cancel(self) -> None:
        self.dismiss(None)


class StartDaemonScreen(ModalScreen[bool]):
    """No daemon answers: offer to start one, then show its loading progress. Dismisses True once it is ready."""

    BINDINGS = [Binding("escape", "give_up", "Quit")]

    def __init__(self, where: str, auto_start: bool):
        super().__init__()
        self.where, self.auto_start = where, auto_start

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(f"No llmd daemon answers at {self.where}.", id="question")
            with Horizontal(classes="buttons", id="choices"):
                yield Button("Start one (llmd serve)", id="start", variant="primary")
                yield Button("Quit", id="quit")
            yield LoadingIndicator(id="spinner")
            yield Static("", id="progress")

    def on_mount(self) -> None:
        self.query_one("#spinner").display = False
        if self.auto_start:
            self.start()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "start":
            self.start()
        else:
            self.action_give_up()

    def start(self) -> None:
        self.query_one("#choices").display = False
        self.query_one("#spinner").display = True
        self.query_one("#question", Label).update("Starting llmd serve…")
        self.app.start_daemon(self)  # type: ignore[attr-defined]

    def progress(self, status: str, elapsed: float, extra: Any = None) -> None:
        word = "starting the server" if status == "starting" else f"{status} the model" if status == "loading" else status
        self.query_one("#progress", Static).update(f"{word}… {elapsed:.1f} s")

    def failed(self, message: str) -> None:
        self.query_one("#spinner").display = False
        self.query_one("#question", Label).update("The daemon did not start.")
        self.query_one("#progress", Static).update(message)
        self.query_one("#choices").display = True

    def action_give_up(self) -> None:
        self.dismiss(False)
