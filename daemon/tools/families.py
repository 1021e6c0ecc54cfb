"""How a model family writes tool calls and thoughts, read from its architecture and chat template.

A template that uses the `tools` variable renders the tools itself (native); its call format is recognised by the
markers it writes. A template without tools gets the generic fallback: the tools are described in the system turn
(see plan.py) and calls are asked for in the tagged format, which the grammar then enforces.

Harmony (gpt-oss): a template that writes `<|channel|>` and `<|message|>` frames every turn as messages on channels;
the model always thinks (its `analysis` channel) and calls tools natively (`commentary` to `functions.NAME`). A
template that reads `reasoning_effort` takes the request's reasoning effort (low, medium, high) as that variable.

Gemma 4: a template that writes `<|tool_call>` and `<|channel>` calls tools in Gemma 4's own syntax and thinks in a
`<|channel>thought` channel, only when asked (`enable_thinking`); see gemma4.py.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache

from . import gemma4
from .parsers import HarmonyParser, LeadingJsonParser, TaggedParser, ToolCallParser

FORMATS = ("hermes", "qwen3_coder", "llama3", "mistral", "harmony", "gemma4", "generic")
THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class ToolFormat:
    """name: one of FORMATS; native: the model's template renders `tools` itself."""

    name: str
    native: bool

    @property
    def args_key(self) -> str:
        return "parameters" if self.name == "llama3" else "arguments"

    def parser(self, names: Collection[str], stream_args: bool = False) -> ToolCallParser:
        """names: the tools a call may name (mapped to their parameters schema, which types XML values);
        stream_args: a grammar keeps the calls valid, so they may stream before they are complete."""
        if self.name == "llama3":
            return LeadingJsonParser(names, ("<|python_tag|>",))
        if self.name == "mistral":
            return LeadingJsonParser(names, ("[TOOL_CALLS]",), name_args=True)
        if self.name == "harmony":
            return HarmonyParser(names, stream_args=stream_args)
        if self.name == "gemma4":  # its calls are no JSON: they come whole
            return gemma4.Gemma4Parser(names)
        return TaggedParser(names, stream_args=stream_args)


@dataclass(frozen=True)
class ModelTraits:
    tools: ToolFormat
    thinks: bool  # the template knows a <think> block (Qwen3, DeepSeek-R1 style) or an analysis channel (harmony)
    # the model itself does tools (Ollama's "tools" capability): its template takes `tools`, or writes a known call
    # format; the generic fallback serves tools on any model, but is no capability of it
    has_tools: bool = False
    effort: bool = False  # the template reads `reasoning_effort` (gpt-oss: low, medium, high)
    think_tags: tuple[str, str] = THINK_TAGS  # what opens and closes a thought in the output
    thinks_unasked: bool = True  # thinks when the request says nothing (Qwen3); Gemma 4 only when asked


_USES_TOOLS = re.compile(r"\btools\b")
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", gemma4.CALL_TAGS[0])
HARMONY_MARKERS = ("<|channel|>", "<|message|>")


@lru_cache(maxsize=32)
def model_traits(architecture: str, template: str | None) -> ModelTraits:
    text = template or ""
    effort = "reasoning_effort" in text
    if all(m in text for m in HARMONY_MARKERS):
        return ModelTraits(ToolFormat("harmony", native=True), thinks=True, has_tools=True, effort=effort)
    if gemma4.CALL_TAGS[0] in text and "<|channel>" in text:
        return ModelTraits(ToolFormat("gemma4", native=True), thinks=True, has_tools=True, effort=effort,
                           think_tags=gemma4.THOUGHT_TAGS, thinks_unasked=False)
    thinks = "<think>" in text or "enable_thinking" in text
    if not _USES_TOOLS.search(text):
        return ModelTraits(ToolFormat("generic", native=False), thinks, any(m in text for m in CALL_MARKERS), effort)
    if "<tool_call>" in text:
        name = "qwen3_coder" if "<function=" in text else "hermes"
    elif "[TOOL_CALLS]" in text:
        name = "mistral"
    elif "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text):
        name = "llama3"
    else:  # a template that takes tools in a format not known here: describe them ourselves
        return ModelTraits(ToolFormat("generic", native=False), thinks, has_tools=True, effort=effort)
    return ModelTraits(ToolFormat(name, native=True), thinks, has_tools=True, effort=effort)
