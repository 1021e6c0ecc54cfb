"""One chat request on one model: the messages and template variables, then the constraint and output parser.

`plan_chat` is model-aware (it needs the model's ModelTraits) and runs once the request's engine is known:
- a native template gets the tools as its `tools` variable and the history as it is;
- the generic fallback describes the tools in the system turn, writes past calls as tagged text in the assistant
  turns and tool results as a user turn, so any template (SmolLM2's, Gemma's) can render them;
- an assistant turn's reasoning (`thinking`, tools.spec) goes to a native template as `reasoning_content` too, the
  name Qwen's and Gemma 4's templates read (they show it in the turns after the last user message);
- `think` becomes the template's `enable_thinking`; a reasoning effort (OpenAI's names, none..max) becomes the
  `reasoning_effort` of a template that reads it, as the nearest of low, medium and high (gpt-oss knows those three
  and cannot stop thinking: none and minimal are low, xhigh and max high);
- harmony (gpt-oss): the template names a tool result after the call before it and renders one call per assistant
  turn, so a turn with several calls becomes one turn per call, each followed by its result; a turn's reasoning
  goes with its first call as `thinking` (the template shows a call's reasoning until a later answer), and a call
  turn with both text and reasoning keeps the reasoning (the template refuses both).
After rendering, `ChatPlan.output(prompt_text)` builds the constraint and the parser. The answer holds a thought
when the prompt ends inside one (Qwen3.5 opens `<think>`, Gemma 4 its thought channel after tool results), or when
thinking is on (asked, or the template's default) and the prompt does not end with a thought the template closed
itself (thinking off: Qwen's empty `<think></think>`, Gemma 4's empty channel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..engine.types import Constraint
from .families import ModelTraits
from .grammar import answer_constraint, grammar_has_calls, harmony_grammar, lark_grammar
from .parsers import OutputParser, ReasoningSplit
from .spec import AnswerFormat, ToolSpec

GENERIC_INSTRUCTIONS = """You can call the following tools. To call a tool, answer with exactly:
<tool_call>
{{"name": "<tool name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
{when}
Tools:
{tools}"""


def _describe(spec: ToolSpec) -> str:
    lines = []
    for fn in spec.allowed():
        lines.append(f"- {fn.name}: {fn.description or '(no description)'} Arguments (JSON schema): "
                     f"{json.dumps(fn.parameters, ensure_ascii=False)}")
    return "\n".join(lines)


def _when(spec: ToolSpec) -> str:
    if spec.choice == "required":
        return "You must call one of the tools."
    if spec.forced:
        return f"You must call the tool {spec.choice}."
    return "Call a tool only when it helps; otherwise answer in plain text."


def _call_text(call: dict) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def generic_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """The history in plain turns: calls as tagged text, tool results as one user turn per run of results."""
    out: list[dict] = []
    for msg in messages:
        if msg["role"] == "tool":
            text = f"<tool_response>\n{msg.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_results": True})
        elif msg["role"] == "assistant" and msg.get("tool_calls"):
            parts = [msg.get("content") or ""] + [_call_text(c) for c in msg["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        else:
            out.append({"role": msg["role"], "content": msg.get("content") or ""})
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if spec is not None and spec.choice != "none" and spec.functions:
        note = GENERIC_INSTRUCTIONS.format(when=_when(spec), tools=_describe(spec))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


EFFORT_LEVELS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high",
                 "max": "high"}


def harmony_messages(messages: list[dict]) -> list[dict]:
    """The history as gpt-oss's template takes it (see the module docstring)."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        i += 1
        if msg["role"] != "assistant" or not msg.get("tool_calls"):
            out.append(msg)
            continue
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        for k, call in enumerate(msg["tool_calls"]):
            turn: dict = {"role": "assistant", "content": "", "tool_calls": [call]}
            if k == 0 and msg.get("thinking"):
                turn["thinking"] = msg["thinking"]
            elif k == 0:
                turn["content"] = msg.get("content") or ""  # the template shows it as the call's reasoning
            out.append(turn)
            mine = next((r for r in results if r.get("tool_call_id") == call.get("id")), None)
            if mine is None and results and results[0].get("tool_call_id") is None:
                mine = results[0]  # results without ids come in the calls' order
            if mine is not None:
                results.remove(mine)
                out.append(mine)
        out.extend(results)
    return out


def fold_system(messages: list[dict]) -> list[dict] | None:
    """The system turn moved to the start of the first user turn, for templates that refuse a system role
    (Gemma 2); None when there is nothing to fold."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return None
    user = messages[1]["content"]
    if isinstance(user, list):  # parts with images: the system text opens them
        content: str | list = [{"type": "text", "text": messages[0]["content"] + "\n\n"}, *user]
    else:
        content = messages[0]["content"] + "\n\n" + user
    first = {**messages[1], "content": content}
    return [first, *messages[2:]]


@dataclass
class ChatPlan:
    messages: list[dict]
    tools: list[dict] | None  # the template's `tools` variable
    template_kwargs: dict
    traits: ModelTraits
    spec: ToolSpec | None
    answer: AnswerFormat | None
    think: bool | None
    calls_possible: bool = False
    fallback_messages: list[dict] | None = None  # for a template that refuses the system turn the plan added

    def output(self, prompt_text: str) -> tuple[Constraint | None, OutputParser]:
        """The constraint and the parser, once the prompt's text is known."""
        fmt = self.traits.tools
        spec = self.spec if self.calls_possible else None
        if fmt.name == "harmony":  # the channels say what is thought, answer and call; there is always a parser
            names = {f.name: f.parameters for f in spec.allowed()} if spec is not None else {}
            stream = spec is not None and grammar_has_calls(fmt, spec, self.answer)
            return harmony_grammar(spec, self.answer), OutputParser(None, fmt.parser(names, stream_args=stream))
        open_tag, close_tag = self.traits.think_tags
        end = prompt_text.rstrip()
        opened = self.traits.thinks and end.endswith(open_tag.rstrip())
        asked = self.traits.thinks_unasked if self.think is None else self.think
        thinking = opened or (self.traits.thinks and asked and not end.endswith(close_tag))
        reasoning = ReasoningSplit(opened, open_tag, close_tag) if thinking else None
        parser_tools = None
        if spec is not None:  # calls the grammar writes are valid, so they may stream before they are complete
            parser_tools = fmt.parser({f.name: f.parameters for f in spec.allowed()},
                                      stream_args=grammar_has_calls(fmt, spec, self.answer))
        thought = ("opened" if opened else "open") if thinking else None
        if spec is None and thought is None and self.answer is not None:
            constraint = answer_constraint(self.answer)
        else:
            constraint = lark_grammar(fmt, spec, self.answer, thought, self.traits.think_tags)
        return constraint, OutputParser(reasoning, parser_tools)


def plan_chat(messages: list[dict], spec: ToolSpec | None, answer: AnswerFormat | None, think: bool | None,
              template_kwargs: dict, traits: ModelTraits, effort: str | None = None) -> ChatPlan:
    """effort: the request's reasoning effort in OpenAI's names (none, minimal, low, medium, high, xhigh, max)."""
    kwargs = dict(template_kwargs)
    if think is not None:
        kwargs.setdefault("enable_thinking", think)
    if effort is not None and traits.effort:
        kwargs.setdefault("reasoning_effort", EFFORT_LEVELS[effort])
    if traits.tools.name == "harmony":
        messages = harmony_messages(messages)
    elif traits.tools.native:
        messages = [{**m, "reasoning_content": m["thinking"]} if m.get("thinking") else m for m in messages]
    if "enable_thinking" in kwargs:
        think = bool(kwargs["enable_thinking"])
    calls = spec is not None and spec.choice != "none" and bool(spec.functions)
    if calls and traits.tools.native:
        tools = [f.as_tool() for f in spec.functions]  # type: ignore[union-attr]  # all: the grammar narrows
        return ChatPlan(messages, tools, kwargs, traits, spec, answer, think, calls_possible=True)
    # a native template renders a history with calls itself; any other gets it as plain turns
    msgs = messages if traits.tools.native else generic_messages(messages, spec if calls else None)
    fallback = fold_system(msgs) if calls else None
    return ChatPlan(msgs, None, kwargs, traits, spec, answer, think, calls_possible=calls, fallback_messages=fallback)
