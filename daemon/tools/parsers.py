"""Streaming parsers that turn a model's text into content, reasoning and tool calls, per model family.

Text arrives in arbitrary pieces (a marker may be split across tokens), so each parser holds back only what could
still be the start of a marker, and releases everything else at once. A call is emitted whole, when its closing
marker (or the end of the output) arrives; a complete call that does not parse, or names no tool of the request, is
given back as the text it was: a malformed call is never an error.

The end of an answer:
- a call that repeats an earlier one (same name, same arguments) ends the answer: it is dropped with everything
  after it, and `ended` tells the caller to stop the generation there (a small model under a grammar that allows
  call after call would otherwise write the same call until max_tokens);
- a call the output ends inside of (cut by max_tokens, `finish(cut=True)`, or by a stop token) is dropped if it does
  not parse, and so is a start of a call marker left at the end after a call or when cut: call markup never reaches
  the content.

Formats (what the model writes; the engine's text keeps non-special marker tokens, drops special ones):
- tagged (Hermes, Qwen2.5, Qwen3, and the generic fallback): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
  repeated for parallel calls; Qwen3-Coder's XML body `<function=NAME><parameter=P>V</parameter></function>` inside
  the same tags is read too.
- llama3: the answer is one JSON object `{"name": .., "parameters": {..}}` (after `<|python_tag|>`, if kept), or
  several separated by `;`.
- mistral: `[TOOL_CALLS]` (a special token, so often dropped) then a JSON array of `{"name", "arguments"}`, or
  `NAME[ARGS]{..}` in newer tokenizers.
- harmony (gpt-oss): the answer is messages, each a header and a body: `<|channel|>analysis<|message|>...<|end|>`
  (a thought), `<|start|>assistant<|channel|>final<|message|>...` (the answer), `<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{..}` (a call; the recipient may also stand before the channel, as
  the template writes past calls). Its markers are special tokens the tokenizer shows (model/tokenizer.py); the end
  tokens <|return|> and <|call|> end the generation, so the last message usually ends with the output. See
  HarmonyParser.
Reasoning (Qwen3, DeepSeek-R1 style): `<think>...</think>` before the answer; see ReasoningSplit.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=_call_id)
    streamed: bool = False  # its start and arguments already went out as CallDeltas

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class CallDelta:
    """A call streamed as it is written: its start (id and name), then fragments of its arguments' JSON text."""

    id: str
    name: str | None = None
    arguments: str = ""


@dataclass
class Piece:
    """What one piece of output text turned into. `deltas` stream calls early (OpenAI); every call also comes whole
    in `calls` once complete (Ollama, non-streamed answers)."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    deltas: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def add(self, other: "Piece") -> "Piece":
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)
        self.deltas.extend(other.deltas)
        return self


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may yet become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_from(obj, names: Collection[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, args)


_FUNCTION_XML = re.compile(r"^\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.S)
_PARAMETER_XML = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(raw: str, schema: dict):
    """A Qwen3-Coder parameter value: strings as written, other types as JSON (or Python's True/False/None)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(raw.strip(), raw)


def _xml_call(body: str, names) -> ToolCall | None:
    """Qwen3-Coder: <function=NAME><parameter=P>VALUE</parameter>...</function>. `names` may map each tool's name
    to its parameters schema, which types the values."""
    m = _FUNCTION_XML.match(body)
    if not m or m.group(1) not in names:
        return None
    params = names.get(m.group(1), {}) if isinstance(names, dict) else {}
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    args = {pname: _xml_value(raw, props.get(pname, {})) for pname, raw in _PARAMETER_XML.findall(m.group(2))}
    return ToolCall(m.group(1), args)


def _json_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """One JSON object, an array of them, or objects separated by ';' (Llama 3.x); None unless all are calls."""
    text = text.strip()
    try:
        values = [json.loads(text)]
    except ValueError:
        try:
            values = [json.loads(part) for part in text.split(";") if part.strip()]
        except ValueError:
            return None
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [_call_from(v, names) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallParser:
    """Base: `feed(text) -> Piece` as text arrives, `finish(cut) -> Piece` at the end of the output (cut: by
    max_tokens). `ended`: a call repeated an earlier one; the answer is over and later text is dropped."""

    def __init__(self, names: Collection[str]):
        self.names = names
        self.ended = False
        self._emitted: set[tuple[str, str]] = set()  # (name, arguments JSON) of every call emitted

    def _new(self, call: ToolCall) -> bool:
        """Whether `call` repeats no earlier call; a repeat ends the answer."""
        key = (call.name, json.dumps(call.arguments, sort_keys=True))
        self.ended = self.ended or key in self._emitted
        self._emitted.add(key)
        return not self.ended

    def feed(self, text: str) -> Piece:
        raise NotImplementedError

    def finish(self, cut: bool = False) -> Piece:
        raise NotImplementedError


_JSON_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class TaggedParser(ToolCallParser):
    """Calls between an opening and a closing tag, anywhere in the text, any number of them.

    stream_args: the first JSON call streams as CallDeltas as soon as its name is read, then its arguments as they
    come (holding back what may be the object's closing brace and tag). Only for output a grammar keeps valid: a call
    already streamed cannot be taken back as text. Later calls come whole, once it is known they repeat no earlier
    one."""

    def __init__(self, names: Collection[str], open_tag: str = "<tool_call>", close_tag: str = "</tool_call>",
                 stream_args: bool = False):
        super().__init__(names)
        self.open_tag, self.close_tag = open_tag, close_tag
        self.stream_args = stream_args
        self.buf = ""
        self.in_call = False
        self.seen_call = False
        self.head: CallDelta | None = None  # the streaming call's start
        self.args_at = 0  # where its arguments start in buf
        self.sent = 0  # characters of its arguments sent

    def _body(self, body: str) -> list[ToolCall] | None:
        call = _xml_call(body, self.names) if body.lstrip().startswith("<function=") else None
        return [call] if call else _json_calls(body, self.names)

    def _args_so_far(self, final: bool) -> str:
        """The arguments' text that is surely theirs: not the object's closing brace, nor a start of the tag."""
        pending = self.buf[self.args_at:]
        if not final:
            pending = pending[:len(pending) - _held_prefix(pending, self.close_tag)]
        pending = pending.rstrip()
        return pending[:-1].rstrip() if pending.endswith("}") else pending

    def _stream(self, out: Piece, final: bool = False) -> None:
        if self.seen_call:
            return
        if self.head is None:
            m = _JSON_HEAD.match(self.buf)
            if not m or m.group(1) not in self.names:
                return
            self.head, self.args_at, self.sent = CallDelta(_call_id(), m.group(1)), m.end(), 0
            out.deltas.append(self.head)
        args = self._args_so_far(final)
        if len(args) > self.sent:
            out.deltas.append(CallDelta(self.head.id, arguments=args[self.sent:]))
            self.sent = len(args)

    def _close(self, body: str, out: Piece, ended_inside: bool = False) -> None:
        """A call body: its closing tag came, or the output ended inside it (then one that does not parse is a call
        cut short, and dropped)."""
        calls = self._body(body)
        if self.stream_args and calls is not None and len(calls) == 1:
            self._stream(out, final=True)  # what is left of its arguments (all of them, if it came in one piece)
            if self.head is not None:
                calls[0].id, calls[0].streamed = self.head.id, True
        self.head = None
        if calls is None:
            if not ended_inside:
                out.content += self.open_tag + body + self.close_tag
            return
        for call in calls:
            if not self._new(call):
                return
            out.calls.append(call)
            self.seen_call = True

    def feed(self, text: str) -> Piece:
        self.buf += text
        out = Piece()
        while not self.ended:
            if not self.in_call:
                at = self.buf.find(self.open_tag)
                if at < 0:
                    # hold what may still become the tag, and trailing whitespace (before a call it is no content)
                    keep = _held_prefix(self.buf, self.open_tag)
                    release = self.buf[:len(self.buf) - keep]
                    keep += len(release) - len(release.rstrip())
                    cut = len(self.buf) - keep
                    out.content, self.buf = out.content + self.buf[:cut], self.buf[cut:]
                    return out
                out.content += self.buf[:at].rstrip()
                self.buf, self.in_call = self.buf[at + len(self.open_tag):], True
            else:
                at = self.buf.find(self.close_tag)
                if at < 0:
                    if self.stream_args:
                        self._stream(out)
                    return out
                body, rest = self.buf[:at], self.buf[at + len(self.close_tag):]
                self.buf, self.in_call = body, False
                self._close(body, out)
                self.buf = rest
        self.buf = ""
        return out

    def finish(self, cut: bool = False) -> Piece:
        out = Piece()
        text = self.buf
        if self.ended:
            pass
        elif self.in_call:  # the output ended inside a call (a stop token took the closing tag, or max_tokens)
            self._close(text, out, ended_inside=True)
        else:
            held = _held_prefix(text, self.open_tag)
            if held and (cut or self.seen_call):  # the start of a call's marker, not text
                text = text[:len(text) - held]
            if not (self.seen_call and not text.strip()):
                out.content = text
        self.buf, self.in_call = "", False
        return out


_DECODER = json.JSONDecoder()


class LeadingJsonParser(ToolCallParser):
    """Llama 3.x and Mistral: the answer is calls when it starts with a call (after an optional marker); then the
    whole answer is held to the end and read as JSON calls, else released as text. `name_args`: Mistral's newer
    `NAME[ARGS]{...}` form is read too. Held calls are read as each JSON object completes, so a repeat ends the
    answer at once."""

    def __init__(self, names: Collection[str], markers: tuple[str, ...], name_args: bool = False):
        super().__init__(names)
        self.markers = markers
        self.name_args = name_args
        self.buf = ""
        self.mode: str | None = None  # None: undecided; "text"; "calls"
        self.found: list[ToolCall] = []  # the complete JSON calls read so far
        self.scanned = 0  # where in buf the next one starts

    def _decide(self) -> str | None:
        head = self.buf.lstrip()
        for marker in self.markers:
            head = head[len(marker):].lstrip() if head.startswith(marker) else head
        if not head or any(m.startswith(head) for m in self.markers):
            return None
        if head[0] in "{[":
            return "calls"
        if self.name_args:
            m = re.match(r"^([A-Za-z0-9_.\-]+)(.*)$", head, re.S)
            name, rest = (m.group(1), m.group(2)) if m else ("", head)
            if rest.startswith("[ARGS]") and name in self.names:
                return "calls"
            if ("[ARGS]".startswith(rest) if rest else any(n.startswith(name) for n in self.names)):
                return None
        return "text"

    def feed(self, text: str) -> Piece:
        if self.ended:
            return Piece()
        self.buf += text
        if self.mode is None:
            self.mode = self._decide()
        if self.mode == "text":
            out, self.buf = Piece(content=self.buf), ""
            return out
        if self.mode == "calls":
            self._scan()
        return Piece()

    def _scan(self) -> None:
        """Read the JSON calls completed since the last feed; at a repeat, cut the answer before it."""
        while True:
            at = self.scanned
            while at < len(self.buf):  # separators and markers between calls
                marker = next((m for m in self.markers if self.buf.startswith(m, at)), "")
                if not marker and self.buf[at] not in " \t\n;,[":
                    break
                at += len(marker) or 1
            try:
                obj, end = _DECODER.raw_decode(self.buf, at)
            except ValueError:  # not complete yet, or no JSON call
                return
            call = _call_from(obj, self.names)
            if call is None:
                return
            if not self._new(call):
                self.buf = self.buf[:at]
                return
            self.found.append(call)
            self.scanned = end

    def _calls(self, text: str) -> list[ToolCall] | None:
        for marker in self.markers:
            text = text.replace(marker, ";")
        if self.name_args:
            found = re.findall(r"([A-Za-z0-9_.\-]+)\[ARGS\](\{.*?\})(?=;|\s*$|[A-Za-z0-9_.\-]+\[ARGS\])", text, re.S)
            if found:
                try:
                    calls = [_call_from({"name": n, "arguments": json.loads(a)}, self.names) for n, a in found]
                except ValueError:
                    return None
                return calls if all(calls) else None  # type: ignore[return-value]
        return _json_calls(text.strip().strip(";"), self.names)

    def finish(self, cut: bool = False) -> Piece:
        text, self.buf = self.buf, ""
        if self.mode != "calls":
            return Piece(content=text)
        calls = self.found if self.ended else self._calls(text)
        if calls is None:
            if not cut:
                return Piece(content=text)
            calls = self.found  # a call cut by max_tokens is dropped; the complete ones before it stay
        if self.name_args:  # Mistral's templates take back only ids of 9 alphanumerics
            for call in calls:
                call.id = uuid.uuid4().hex[:9]
        return Piece(calls=calls)


HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", *HARMONY_ENDS)
_HARMONY_OPENINGS = ("<|channel|>", "to=", "<|constrain|>", "assistant")  # what the first header may start with
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_]+)")
MAX_HARMONY_HEADER = 512  # characters before <|message|>; a longer "header" is no harmony frame


def _held_marker(text: str) -> int:
    return max(_held_prefix(text, m) for m in HARMONY_MARKERS)


class HarmonyParser(ToolCallParser):
    """gpt-oss's messages, by channel: `analysis` -> reasoning, `final` (and `commentary` without a recipient: a
    preamble the user may see) -> content, a message to `functions.NAME` -> a call whose body is its arguments'
    JSON. The prompt ends with `<|start|>assistant`, so the output opens with the first message's header; an output
    that does not (a model that ignores the format) is content as written. Bodies stream as they come; a call comes
    whole at its end marker or the output's end (the <|call|> that ends it is an end-of-generation token), and with
    stream_args (a grammar keeps it valid) the first call streams its arguments as they are written. A body to an
    unknown recipient, or one that is no JSON object, is given back as content (dropped when max_tokens cut it)."""

    def __init__(self, names: Collection[str], stream_args: bool = False):
        super().__init__(names)
        self.stream_args = stream_args
        self.buf = ""
        self.state = "header"  # header -> body -> between -> header ...; "text": no harmony frames, all content
        self.first = True  # the first header (its `<|start|>assistant` is the prompt's)
        self.route = "content"  # where the body goes: reasoning, content or call
        self.call_name = ""
        self.body = ""  # a call's body so far
        self.seen_call = False
        self.head: CallDelta | None = None  # the streaming call's start
        self.sent = 0  # characters of its body sent

    def _header_possible(self) -> bool:
        head = self.buf.lstrip()
        return not head or any(o.startswith(head) or head.startswith(o) for o in _HARMONY_OPENINGS)

    def _open(self, header: str, out: Piece) -> None:
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        self.body, self.head, self.sent = "", None, 0
        if recipient:
            target = recipient.group(1)
            self.route = "call"
            self.call_name = target[len("functions."):] if target.startswith("functions.") else target
            if self.stream_args and not self.seen_call and target.startswith("functions.") \
                    and self.call_name in self.names:
                self.head = CallDelta(_call_id(), self.call_name)
                out.deltas.append(self.head)
        else:
            self.route = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _write(self, text: str, out: Piece) -> None:
        if self.route == "reasoning":
            out.reasoning += text
        elif self.route == "content":
            out.content += text
        else:
            self.body += text
            if self.head is not None and len(self.body) > self.sent:
                out.deltas.append(CallDelta(self.head.id, arguments=self.body[self.sent:]))
                self.sent = len(self.body)

    def _close(self, out: Piece, cut: bool = False) -> None:
        """The end of a message's body (its end marker, or the output's end)."""
        if self.route != "call":
            return
        call = None
        try:
            args = json.loads(self.body)
        except ValueError:
            args = None
        if isinstance(args, dict) and self.call_name in self.names:
            call = ToolCall(self.call_name, args)
        if call is None:
            if not cut:
                out.content += self.body
            return
        if self.head is not None:
            call.id, call.streamed = self.head.id, True
        if self._new(call):
            out.calls.append(call)
            self.seen_call = True

    def feed(self, text: str) -> Piece:
        self.buf += text
        out = Piece()
        while not self.ended:
            if self.state == "text":
                out.content, self.buf = out.content + self.buf, ""
                break
            if self.state == "between":  # after a message: nothing but the next one's <|start|>
                at = self.buf.find("<|start|>")
                if at < 0:
                    self.buf = self.buf[len(self.buf) - _held_prefix(self.buf, "<|start|>"):]
                    break
                self.buf, self.state = self.buf[at + len("<|start|>"):], "header"
            if self.state == "header":
                at = self.buf.find("<|message|>")
                if at < 0:
                    if len(self.buf) > MAX_HARMONY_HEADER or (self.first and not self._header_possible()):
                        self.state = "text"
                        continue
                    break
                self._open(self.buf[:at], out)
                self.buf, self.state, self.first = self.buf[at + len("<|message|>"):], "body", False
            if self.state == "body":
                ends = [(at, m) for m in (*HARMONY_ENDS, "<|start|>") if (at := self.buf.find(m)) >= 0]
                if not ends:
                    keep = _held_marker(self.buf)
                    self._write(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                at, marker = min(ends)
                self._write(self.buf[:at], out)
                self._close(out)
                # a <|start|> without an end marker before it opens the next message all the same
                self.buf = self.buf[at:] if marker == "<|start|>" else self.buf[at + len(marker):]
                self.state = "between"
        if self.ended:
            self.buf = ""
        return out

    def finish(self, cut: bool = False) -> Piece:
        out = Piece()
        if self.ended:
            pass
        elif self.state == "text" or (self.first and "<|" not in self.buf):  # no frame at all: text as written
            out.content = self.buf
        elif self.state == "body":  # the usual end: <|return|> or <|call|> ended the generation, unseen
            self._write(self.buf, out)
            self._close(out, cut)
        # an unfinished header, or what follows a message's end, is markup
        self.buf, self.state = "", "between"
        return out


class ReasoningSplit:
    """`<think>...</think>` before the answer: the thought goes to `reasoning`, the rest on to `content`.
    `started`: the prompt already opened the thought (the template ends with `<think>`)."""

    def __init__(self, started: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.state = "thinking" if started else "start"  # start -> thinking -> (gap ->) answer
        self.buf = ""

    def feed(self, text: str) -> Piece:
        self.buf += text
        out = Piece()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(self.open_tag):
                self.buf, self.state = head[len(self.open_tag):], "thinking"
            elif self.open_tag.startswith(head):
                return out  # not yet known
            else:
                self.state = "answer"
        if self.state == "thinking":
            at = self.buf.find(self.close_tag)
            if at < 0:
                keep = _held_prefix(self.buf, self.close_tag)
                out.reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.reasoning = self.buf[:at]
            self.buf, self.state = self.buf[at + len(self.close_tag):], "gap"
        if self.state == "gap":  # the blank lines between the thought and the answer belong to neither
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.state = "answer"
        if self.state == "answer":
            out.content, self.buf = self.buf, ""
        return out

    def finish(self) -> Piece:
        out = Piece()
        if self.state == "thinking":
            out.reasoning = self.buf
        elif self.state != "gap":
            out.content = self.buf
        self.buf = ""
        return out


class OutputParser:
    """Reasoning split first (its answer goes on), then the tool-call parser; either may be absent."""

    def __init__(self, reasoning: ReasoningSplit | None = None, tools: ToolCallParser | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.calls = 0

    @property
    def ended(self) -> bool:
        """The answer is over before the output is (a call repeated an earlier one): stop generating."""
        return self.tools is not None and self.tools.ended

    def _after_reasoning(self, piece: Piece, final: bool, cut: bool = False) -> Piece:
        if self.tools is None:
            return piece
        out = Piece(reasoning=piece.reasoning)
        if piece.content:
            out.add(self.tools.feed(piece.content))
        if final:
            out.add(self.tools.finish(cut))
        return out

    def feed(self, text: str) -> Piece:
        piece = self.reasoning.feed(text) if self.reasoning else Piece(content=text)
        out = self._after_reasoning(piece, final=False)
        self.calls += len(out.calls)
        return out

    def finish(self, cut: bool = False) -> Piece:
        """The rest at the end of the output; cut: max_tokens ended it."""
        piece = self.reasoning.finish() if self.reasoning else Piece()
        out = self._after_reasoning(piece, final=True, cut=cut)
        self.calls += len(out.calls)
        return out

    def parse(self, text: str) -> Piece:
        """The whole output at once (non-streamed answers)."""
        return self.feed(text).add(self.finish())
