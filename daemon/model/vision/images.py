"""Image bytes from a request -> a bounded RGB image, or an InvalidImage naming the problem.

Requests carry images as base64 (OpenAI data URIs, Ollama `images`, Anthropic base64 sources, llama.cpp
`image_data`). Every image is untrusted input: its size is read from the header before any pixel is decoded (a
decompression bomb is refused there), only PNG, JPEG, WebP and GIF (its first frame) are opened, and the decode runs
off the event loop (the server calls `decode_image` in an executor). `digest` keys the image in the prefix cache and
the encoder cache: a hash of the decoded pixels and their size, so the same picture sent as PNG or re-encoded
losslessly is one image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image

MAX_SIDE = 8192  # pixels on a side
MAX_MEGAPIXELS = 32.0  # per image
MAX_IMAGES = 16  # per request
MAX_ENCODED_BYTES = 20 * 2**20  # one image's bytes before decoding
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URI = re.compile(r"^data:image/[a-zA-Z0-9.+-]+;base64,", re.ASCII)


class InvalidImage(ValueError):
    """An image a request cannot use; the message says why (the server names the request part)."""


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    digest: bytes


def image_bytes(value: object) -> bytes:
    """A base64 string (bare or a data: URI) -> its bytes, bounded."""
    if not isinstance(value, str):
        raise InvalidImage("must be a base64 string or a data: URI")
    if value.startswith("data:"):
        match = _DATA_URI.match(value)
        if match is None:
            raise InvalidImage("a data: URI must be data:image/<type>;base64,<data>")
        value = value[match.end():]
    elif value.startswith(("http://", "https://", "file:")):
        raise InvalidImage("remote and file URLs are not fetched; send the image as base64 or a data: URI")
    if len(value) > MAX_ENCODED_BYTES * 4 // 3 + 4:
        raise InvalidImage(f"is larger than {MAX_ENCODED_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidImage("is not valid base64") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as RGB, any transparency composited onto white (as transformers' image processors do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(data: bytes) -> DecodedImage:
    """Bytes -> an RGB image and its digest; InvalidImage for anything corrupt, truncated, unsupported or too big."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width < 1 or height < 1 or max(width, height) > MAX_SIDE:
                raise InvalidImage(f"is {width}x{height}: at most {MAX_SIDE} pixels a side")
            if width * height > MAX_MEGAPIXELS * 1e6:
                raise InvalidImage(f"is {width * height / 1e6:.1f} megapixels: at most {MAX_MEGAPIXELS:g}")
            img.load()
    except InvalidImage:
        raise
    except Image.UnidentifiedImageError:
        raise InvalidImage(f"is not an image in a supported format ({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidImage("is a decompression bomb (too many pixels)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidImage(f"is corrupt or truncated ({exc})") from None
    rgb = to_rgb(img)
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).digest()
    return DecodedImage(rgb, digest)
