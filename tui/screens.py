"""Modal screens of `llmd chat`: help, rename, confirm, per-conversation settings, and starting a daemon."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, LoadingIndicator, Markdown, Select, Static, TextArea

KEYS_HELP = """\
# llmd chat — keys

| key | does |
|---|---|
| Enter | send the message |
| Shift+Enter, Ctrl+J | new line in the message |
| Esc | stop the answer (aborts it on the daemon) |
| Ctrl+R | regenerate the last answer (or retry after an error) |
| Ctrl+N | new chat |
| Ctrl+P | command palette |
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
