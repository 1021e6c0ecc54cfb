"""Widgets of the chat screen: the prompt box, one message (streamed Markdown + its timings line), and formatting."""

from __future__ import annotations

import re
from typing import Any

from textual import events
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as TextualMessage
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream

CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks of a Markdown text, in order."""
    return [body.rstrip("\n") for body in CODE_BLOCK.findall(markdown)]


def format_timings(timings: dict[str, Any] | None) -> str:
    """The line under an answer: TTFT, tok/s, tokens, prompt cache hits and speculative acceptance (when on)."""
    if not timings:
        return ""
    parts = []
    if timings.get("ttft_ms") is not None:
        parts.append(f"TTFT {timings['ttft_ms']:.0f} ms")
    if timings.get("tokens_per_second") is not None:
        parts.append(f"{timings['tokens_per_second']:.1f} tok/s")
    if timings.get("generated_tokens") is not None:
        parts.append(f"{timings['generated_tokens']} tokens")
    prompt = timings.get("prompt_tokens")
    cached = timings.get("cached_prompt_tokens")
    if cached is not None and prompt:
        parts.append(f"cached {cached}/{prompt} prompt tokens")
    proposed = timings.get("spec_proposed") or 0
    if proposed:
        accepted = timings.get("spec_accepted") or 0
        parts.append(f"spec {accepted}/{proposed} accepted ({100 * accepted / proposed:.0f}%)")
    return " · ".join(parts)


class PromptInput(TextArea):
    """Enter sends; Shift+Enter and Ctrl+J insert a new line."""

    class Submitted(TextualMessage):
        def __init__(self, text: str):
            self.text = text
            super().__init__()

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class MessageView(Vertical, can_focus=True):
    """One chat message. An assistant answer streams into its Markdown and ends with a timings line."""

    BINDINGS = [
        Binding("y", "copy_message", "Copy message"),
        Binding("c", "copy_code", "Copy code block"),
    ]

    def __init__(self, role: str, content: str = "", timings: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(classes=f"message {role}", **kwargs)
        self.role = role
        self.content = content
        self.timings = timings
        self._stream: MarkdownStream | None = None
        self._code_index = 0

    def compose(self):
        yield Static(self.role, classes="role")
        yield Markdown(self.content, classes="body")
        yield Static(format_timings(self.timings), classes="timings")

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    @property
    def footer(self) -> Static:
        return self.query_one(".timings", Static)

    # --- streaming ----------------------------------------------------------------------------------------------

    def start_stream(self) -> None:
        self.content = ""
        self.footer.update("…")
        self._stream = Markdown.get_stream(self.body)

    async def append(self, text: str) -> None:
        self.content += text
        if self._stream is not None:
            await self._stream.write(text)

    async def finish(self, timings: dict[str, Any] | None, note: str = "") -> None:
        """End the stream and render the whole text once more, so the final view is complete even where the
        incremental render lagged (an unclosed code fence, a table still growing)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.body.update(self.content)
        self.timings = timings
        line = format_timings(timings)
        self.footer.update(" · ".join(p for p in (line, note) if p))

    async def fail(self, message: str) -> None:
        await self.finish(None)
        self.add_class("failed")
        self.footer.update(f"⚠ {message}")

    # --- copying ------------------------------------------------------------------------------------------------

    def action_copy_message(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("Copied the message")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.content)
        if not blocks:
            self.notify("This message has no code block", severity="warning")
            return
        index = self._code_index % len(blocks)
        self.app.copy_to_clipboard(blocks[index])
        self._code_index += 1
        self.notify(f"Copied code block {index + 1}/{len(blocks)}")
