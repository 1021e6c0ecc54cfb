"""A chat's images, from the request's parts to the engine's ImageSpans (llmd.engine.types).

Every dialect turns its image parts into {"type": "image", "image": bytes} in a user message's content
(validation.image_part). Here, once the model is bound: a model without a tower answers 400; the images are decoded
and bounded (llmd.model.vision.images) and encoded by the model's tower, both off the event loop, each encoding kept
in a small LRU by the image's pixel digest (a multi-turn chat re-sends its images); the chat template sees plain
{"type": "image"} parts, the rendered text is widened around each image as the family's processor does, and the
image's placeholder tokens in the encoded prompt become its span. An encoding [tokens, hidden] is one run of
placeholders; one [rows, cols, hidden] (Mistral 3's, whose rows end in a break token) is a run per row, each its own
span, and its encoder's `expand` is given each image's (rows, cols) instead of its token count.
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections import OrderedDict
from typing import Any

from ..engine.types import ImageSpan
from ..model.vision.images import MAX_IMAGES, InvalidImage, decode_image
from .validation import ApiError

ENCODED_CACHE = 32  # images' embeddings kept per model
_encoded: "weakref.WeakKeyDictionary[Any, OrderedDict[bytes, Any]]" = weakref.WeakKeyDictionary()


def take_images(messages: list[dict]) -> tuple[list[dict], list[tuple[str, bytes]]]:
    """The messages with each image part reduced to {"type": "image"}, and the images' bytes in order, each with the
    request field it came from."""
    out, images = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") == "image":
                    images.append((part.get("field") or f"messages[{i}].content[{j}]", part["image"]))
                    part = {"type": "image"}
                parts.append(part)
            msg = {**msg, "content": parts}
        out.append(msg)
    if len(images) > MAX_IMAGES:
        raise ApiError(400, f"a request may hold at most {MAX_IMAGES} images ({len(images)} given)",
                       param="messages")
    return out, images


EncodedImage = tuple[bytes, Any, tuple[int, int] | None]  # an image's digest, embeddings and token grid


def _encode(vision: Any, data: bytes, where: str) -> EncodedImage:
    """(digest, embeddings, token grid) of one image, from the cache or the tower; runs in a worker thread. The grid:
    the tower's token_grid (rows, columns) where it has one (Qwen3.5: its multimodal RoPE), else None."""
    try:
        decoded = decode_image(data)
        cache = _encoded.setdefault(vision, OrderedDict())
        hit = cache.get(decoded.digest)
        if hit is None:
            pixels = vision.preprocess(decoded.image)
            grid = vision.token_grid(pixels) if hasattr(vision, "token_grid") else None
            hit = cache[decoded.digest] = (vision.encode(pixels), grid)
            while len(cache) > ENCODED_CACHE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(decoded.digest)
    except InvalidImage as exc:
        raise ApiError(400, f"{where}: the image {exc}", param=where) from None
    return decoded.digest, *hit


async def encode_images(vision: Any, images: list[tuple[str, bytes]]) -> list[EncodedImage]:
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, _encode, vision, data, where) for where, data in images]


def expand(vision: Any, text: str, encoded: list[EncodedImage]) -> str:
    """The rendered prompt widened around each image (a placeholder the user typed themselves: a 400)."""
    try:
        return vision.expand(text, [_grid(e) if e.dim() == 3 else int(e.shape[0]) for _, e, _ in encoded])
    except ValueError as exc:
        raise ApiError(400, f"the prompt's images do not match its image placeholders: {exc}",
                       param="messages") from None


def image_spans(vision: Any, ids: list[int], encoded: list[EncodedImage]) -> list[ImageSpan]:
    """Each image's run of placeholder tokens in `ids`, in order, with its embeddings."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == vision.image_token_id:
            j = i
            while j < len(ids) and ids[j] == vision.image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    rows = [row for image in encoded for row in _rows(*image)]
    lengths = [int(e.shape[0]) for _, e, _ in rows]
    if [n for _, n in runs] != lengths:
        raise ApiError(400, f"the chat template placed {len(runs)} image runs ({[n for _, n in runs]} tokens) for "
                            f"{len(encoded)} images sent ({lengths} tokens): send images in user messages",
                       param="messages")
    return [ImageSpan(start, n, digest, embeds, bool(vision.bidirectional), grid)
            for (start, n), (digest, embeds, grid) in zip(runs, rows)]


def _grid(embeds: Any) -> tuple[int, int]:
    return int(embeds.shape[0]), int(embeds.shape[1])


def _rows(digest: bytes, embeds: Any, grid: tuple[int, int] | None) -> list[EncodedImage]:
    """An image's runs of placeholders with their embeddings: the whole image, or each row of a [rows, cols, hidden]
    encoding, keyed in the prefix cache by the image's digest and the row."""
    if embeds.dim() != 3:
        return [(digest, embeds, grid)]
    return [(hashlib.sha256(digest + r.to_bytes(4, "little")).digest(), row, None) for r, row in enumerate(embeds)]
