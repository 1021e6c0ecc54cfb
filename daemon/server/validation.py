"""Request body parsing and table-driven field checks, shared by every dialect.

Each dialect declares a table `{field name: Field(...)}`; `check_fields` walks it and raises ApiError (400) naming the
first bad field. Unknown fields are ignored (editors send many), known ones must have the right type and stay in bounds.
`log_ignored` names, at DEBUG, the fields of a request that had no effect.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..engine.types import MAX_LOGPROBS, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

log = logging.getLogger("llmd.server")

# Upper bounds that are not engine limits (those come from llmd.engine.types).
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_NEW_TOKENS = 32768
MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 1_000_000  # a single prompt, message, prefix or suffix
MAX_PROMPT_TOKEN_IDS = 131072
MAX_INPUT_EXTRA = 64
MAX_SEED = 2**63 - 1


class ApiError(Exception):
    """An error answered to the client in its dialect's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers or {}


def bad_field(name: str, why: str) -> ApiError:
    return ApiError(400, f"{name} {why}", param=name)


@dataclass(frozen=True)
class Field:
    """One field's type and bounds. kind: "int", "number", "str", "bool", "list", "dict", "stop" (str or list of str),
    "str|list" (a prompt: text or a list of token ids), "str|list|dict" (also llama.cpp's multimodal prompt object)."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None  # characters for str, items for list
    choices: tuple | None = None


def _is_int(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (float("inf"), float("-inf"))


def _check_one(name: str, value: Any, spec: Field) -> Any:
    kind = spec.kind
    if kind == "int":
        if not _is_int(value):
            raise bad_field(name, "must be an integer")
        value = int(value)
    elif kind == "number":
        if not _is_number(value):
            raise bad_field(name, "must be a number")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise bad_field(name, "must be true or false")
    elif kind == "str":
        if not isinstance(value, str):
            raise bad_field(name, "must be a string")
    elif kind == "list":
        if not isinstance(value, list):
            raise bad_field(name, "must be an array")
    elif kind == "dict":
        if not isinstance(value, dict):
            raise bad_field(name, "must be an object")
    elif kind == "stop":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise bad_field(name, "must be a string or an array of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise bad_field(name, f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_STRING_LEN or not s for s in value):
            raise bad_field(name, f"strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters")
    elif kind in ("str|list", "str|list|dict"):
        if isinstance(value, str):
            pass
        elif isinstance(value, list) and all(_is_int(t) for t in value):
            if len(value) > MAX_PROMPT_TOKEN_IDS:
                raise bad_field(name, f"may hold at most {MAX_PROMPT_TOKEN_IDS} token ids")
            value = [int(t) for t in value]
        elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        elif not (kind == "str|list|dict" and isinstance(value, dict)):  # llama.cpp's multimodal prompt object
            raise bad_field(name, "must be a string or an array of token ids")
    else:  # pragma: no cover - a typo in a table
        raise AssertionError(kind)
    if spec.lo is not None and value < spec.lo:
        raise bad_field(name, f"must be at least {spec.lo:g}")
    if spec.hi is not None and value > spec.hi:
        raise bad_field(name, f"must be at most {spec.hi:g}")
    if spec.max_len is not None and isinstance(value, (str, list)) and len(value) > spec.max_len:
        unit = "characters" if isinstance(value, str) else "items"
        raise bad_field(name, f"must be at most {spec.max_len} {unit}")
    if spec.choices is not None and value not in spec.choices:
        raise bad_field(name, "must be one of " + ", ".join(map(str, spec.choices)))
    return value


def check_fields(body: dict, table: dict[str, Field], prefix: str = "") -> dict:
    """Return {name: checked value} for the table's fields present (and not null) in body."""
    out = {}
    for name, spec in table.items():
        if name in body and body[name] is not None:
            out[name] = _check_one(prefix + name, body[name], spec)
    return out


def log_ignored(body: dict, honoured: Collection[str], where: str) -> None:
    """Name at DEBUG the fields of a body outside `honoured`: accepted, with no effect here."""
    ignored = [name for name, value in body.items() if name not in honoured and value is not None]
    if ignored:
        log.debug("%s: accepted with no effect here: %s", where, ", ".join(ignored))


def require(body: dict, name: str) -> None:
    if body.get(name) is None:
        raise ApiError(400, f"{name} is required", param=name)


# Shared bounds, reused across dialect tables.
TEMPERATURE = Field("number", 0, 100)
TOP_P = Field("number", 0, 1)
TOP_K = Field("int", -1, 1_000_000)  # -1 and 0 both mean off (vLLM and llama.cpp clients send -1)
MIN_P = Field("number", 0, 1)
PENALTY = Field("number", -2, 2)
REPEAT_PENALTY = Field("number", 0, 10)
SEED = Field("int", -MAX_SEED, MAX_SEED)
MAX_TOKENS = Field("int", 1, MAX_NEW_TOKENS)
STOP = Field("stop")
TEXT = Field("str", max_len=MAX_TEXT_CHARS)
LOGPROBS_TOP = Field("int", 0, MAX_LOGPROBS)


async def read_json(request: web.Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """Read and parse a JSON object body, with clear 4xx errors for every way it can be wrong."""
    ctype = request.content_type
    # Many clients (curl -d, some editor plugins) send JSON without a content type or as form-encoded; accept those,
    # but refuse types that clearly are not JSON.
    if ctype not in ("application/json", "application/x-www-form-urlencoded", "application/octet-stream", "text/plain",
                     ""):
        raise ApiError(415, f"unsupported content type {ctype!r}: send application/json")
    too_large = ApiError(413, f"request body is larger than the {max_bytes} byte limit")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:
        raw = await request.read()  # the app's client_max_size caps this read too
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    if len(raw) > max_bytes:
        raise too_large
    if not raw.strip():
        raise ApiError(400, "request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _reject_lone_surrogates(body)
    return body


# JSON can escape UTF-16 surrogates; a pair decodes to one character, a lone one to a str that is no Unicode text
# (the tokenizer and any UTF-8 encode fail on it). Bodies without such an escape need no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_lone_surrogates(body: dict) -> None:
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(400, f"request body holds an unpaired surrogate (\\u{ord(item[exc.start]):04x}): "
                                    "strings must be valid Unicode") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI content parts of type text."""
    if isinstance(content, str):
        text = content
    elif content is None:
        text = ""
    elif isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_field(f"{where}[{i}]", "must be an object with a type")
            if part["type"] != "text":
                raise bad_field(f"{where}[{i}].type", f"{part['type']!r} is not supported (text only)")
            if not isinstance(part.get("text"), str):
                raise bad_field(f"{where}[{i}].text", "must be a string")
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise bad_field(where, "must be a string or an array of content parts")
    if len(text) > MAX_TEXT_CHARS:
        raise bad_field(where, f"must be at most {MAX_TEXT_CHARS} characters")
    return text


IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def image_part(part: dict, where: str) -> dict:
    """An image content part in any dialect's form -> {"type": "image", "image": bytes, "field": where} (what chat
    templates see as an image part, its bytes kept for the encoder, and the request field it came from): OpenAI's image_url ({"url": data URI} or the URI itself),
    Responses' input_image (image_url), Anthropic's image (a base64 source). Remote URLs are never fetched."""
    from ..model.vision.images import InvalidImage, image_bytes

    kind = part["type"]
    if kind == "image":  # Anthropic
        source, field = part.get("source"), f"{where}.source"
        if not isinstance(source, dict) or source.get("type") != "base64":
            raise bad_field(field, "must be a base64 source ({type: base64, media_type, data}); URLs are not fetched")
        value, field = source.get("data"), f"{field}.data"
    else:
        value, field = part.get("image_url"), f"{where}.image_url"
        if isinstance(value, dict):
            value, field = value.get("url"), f"{field}.url"
    try:
        return {"type": "image", "image": image_bytes(value), "field": where}
    except InvalidImage as exc:
        raise bad_field(field, str(exc)) from None


def message_content(content: Any, where: str) -> str | list[dict]:
    """A user message's content: its text (as message_text), or, when it holds images, its parts in order, the
    images as image_part gives them and the text parts as {"type": "text", "text": ...}."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                for p in content):
        return message_text(content, where)
    parts: list[dict] = []
    for i, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
            parts.append(image_part(part, f"{where}[{i}]"))
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"),
                                                                                                   str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_field(f"{where}[{i}]", "must be a text part or an image part")
    return parts


def content_text(content: str | list[dict]) -> str:
    """A message's text, whether its content is a string or parts with images."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


ROLES = ("system", "user", "assistant", "tool", "developer")


def parse_messages(value: Any, name: str = "messages") -> list[dict]:
    """Validate a chat message list and return [{role, content}] with text content (a user message with images: its
    parts, see message_content)."""
    if not isinstance(value, list):
        raise bad_field(name, "must be an array of messages")
    if not value:
        raise bad_field(name, "must hold at least one message")
    if len(value) > MAX_MESSAGES:
        raise bad_field(name, f"may hold at most {MAX_MESSAGES} messages")
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise bad_field(where, "must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_field(f"{where}.role", "must be one of " + ", ".join(ROLES))
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        read = message_content if role == "user" else message_text
        out.append({"role": role, "content": read(msg.get("content"), f"{where}.content")})
    return out
