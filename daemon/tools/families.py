"""How a model family writes tool calls and thoughts, read from its architecture and chat template.

A template that uses the `tools` variable renders the tools itself (native); its call format is recognised by the
markers it writes. A template without tools gets the generic fallback: the tools are described in the system turn
(see plan.py) and calls are asked for in the tagged format, which the grammar then enforces.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache

from .parsers import LeadingJsonParser, TaggedParser, ToolCallParser

FORMATS = ("hermes", "qwen3_coder", "llama3", "mistral", "generic")


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
        return TaggedParser(names, stream_args=stream_args)


@dataclass(frozen=True)
class ModelTraits:
    tools: ToolFormat
    thinks: bool  # the template knows a <think> block (Qwen3, DeepSeek-R1 style)
    # the model itself does tools (Ollama's "tools" capability): its template takes `tools`, or writes a known call
    # format; the generic fallback serves tools on any model, but is no capability of it
    has_tools: bool = False


_USES_TOOLS = re.compile(r"\btools\b")
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@lru_cache(maxsize=32)
def model_traits(architecture: str, template: str | None) -> ModelTraits:
    text = template or ""
    thinks = "<think>" in text or "enable_thinking" in text
    if not _USES_TOOLS.search(text):
        return ModelTraits(ToolFormat("generic", native=False), thinks, any(m in text for m in CALL_MARKERS))
    if "<tool_call>" in text:
        name = "qwen3_coder" if "<function=" in text else "hermes"
    elif "[TOOL_CALLS]" in text:
        name = "mistral"
    elif "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text):
        name = "llama3"
    else:  # a template that takes tools in a format not known here: describe them ourselves
        return ModelTraits(ToolFormat("generic", native=False), thinks, has_tools=True)
    return ModelTraits(ToolFormat(name, native=True), thinks, has_tools=True)
