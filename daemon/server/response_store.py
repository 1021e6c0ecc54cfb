"""The OpenAI Responses store: the last responses answered with `store` on, so that `previous_response_id` can continue
a conversation and `GET` / `DELETE /v1/responses/{id}` find one. In memory only (a daemon restart forgets them),
bounded by count and by the characters of their conversations; the oldest go first."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED_RESPONSES = 256
MAX_STORED_CHARS = 32 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    conversation: list[dict]  # the normalised history up to and with its answer (instructions are not carried on)
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict]) -> None:
        chars = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if chars > self.max_chars:
            return  # larger than the whole store: kept nowhere (previous_response_id then answers 400)
        self.delete(response["id"])
        self._items[response["id"]] = StoredResponse(response, conversation, chars)
        self.chars += chars
        while len(self._items) > self.max_responses or self.chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self.chars -= old.chars

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.chars -= old.chars
        return old is not None
