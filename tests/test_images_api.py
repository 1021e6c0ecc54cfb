"""Image parts on every route, through a real daemon: a model without a vision tower answers 400 saying so, naming
the part; a bad image (not base64, a remote URL, corrupt bytes, a decompression bomb) is a 400 naming the part; no
image is silently dropped. (The image-text model served end to end: tests/test_vision_served.py.)
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import pytest
from llmd_daemon_proc import start_daemon
from PIL import Image

from llmd.model.vision.images import InvalidImage, decode_image


def png(width: int = 32, height: int = 24, color=(200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def daemon(tiny_qwen2, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("img-api") / "llmd", "--model", str(tiny_qwen2))
    yield d
    assert d.stop() == 0, d.log()


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(daemon.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read().decode().splitlines()[-1])
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def error_text(body: dict) -> str:
    return json.dumps(body)


IMAGE = b64(png())
ROUTES = [
    ("/v1/chat/completions", {"model": "qwen2", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}]}]},
     "messages[0].content[1]"),
    ("/api/chat", {"model": "qwen2", "stream": False, "messages": [{"role": "user", "content": "What is this?",
                                                                     "images": [IMAGE]}]}, "messages[0].images[0]"),
    ("/api/generate", {"model": "qwen2", "stream": False, "prompt": "What is this?", "images": [IMAGE]},
     "images[0]"),
    ("/v1/messages", {"model": "qwen2", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}},
        {"type": "text", "text": "What is this?"}]}]}, "messages[0].content[0]"),
    ("/v1/responses", {"model": "qwen2", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{IMAGE}"}]}]}, "input[0].content[1]"),
]


@pytest.mark.parametrize("path,body,part", ROUTES, ids=[r[0] for r in ROUTES])
def test_a_text_model_refuses_images_by_name(daemon, path, body, part):
    status, answer = post(daemon, path, body)
    assert status == 400, answer
    assert "does not see images" in error_text(answer) and part in error_text(answer)


@pytest.mark.parametrize("url,problem", [
    ("data:image/png;base64,!!!", "not valid base64"),
    ("https://example.com/cat.png", "not fetched"),
    (f"data:image/png;base64,{b64(png()[:40])}", None),  # truncated: refused when decoded (text model: first)
])
def test_bad_image_parts_are_400_naming_the_part(daemon, url, problem):
    body = {"model": "qwen2", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
    status, answer = post(daemon, "/v1/chat/completions", body)
    assert status == 400, answer
    assert "messages[0].content[0]" in error_text(answer)
    if problem:
        assert problem in error_text(answer)


def test_decoding_bounds_and_digest():
    same = decode_image(png())
    assert decode_image(png()).digest == same.digest and decode_image(png(color=(1, 2, 3))).digest != same.digest
    with pytest.raises(InvalidImage, match="truncated|corrupt"):
        decode_image(png()[:60])
    with pytest.raises(InvalidImage, match="supported format"):
        decode_image(b"GIF89a not really")
    buf = io.BytesIO()
    Image.new("L", (9000, 10)).save(buf, format="PNG")
    with pytest.raises(InvalidImage, match="a side"):
        decode_image(buf.getvalue())
    buf = io.BytesIO()
    Image.new("1", (7000, 7000)).save(buf, format="PNG")  # 49 megapixels in a few kB
    with pytest.raises(InvalidImage, match="megapixels|bomb"):
        decode_image(buf.getvalue())


def test_llamacpp_multimodal_prompts_are_read(daemon):
    """llama.cpp's two forms reach the model check (a text model: 400 naming the prompt), a marker count that does
    not match the images is a 400 of its own, and a dict prompt on OpenAI's route is refused."""
    for body in ({"prompt": {"prompt_string": "What is <__media__>?", "multimodal_data": [IMAGE]}},
                 {"prompt": "What is [img-3]?", "image_data": [{"data": IMAGE, "id": 3}]}):
        status, answer = post(daemon, "/completion", {"n_predict": 4, **body})
        assert status == 400 and "does not see images" in error_text(answer), answer
    status, answer = post(daemon, "/completion", {"prompt": {"prompt_string": "no marker", "multimodal_data": [IMAGE]}})
    assert status == 400 and "image markers" in error_text(answer)
    status, answer = post(daemon, "/v1/completions", {"model": "qwen2", "prompt": {"prompt_string": "x"}})
    assert status == 400 and "prompt" in error_text(answer)
