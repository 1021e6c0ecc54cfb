"""An image-text model served end to end: a tiny Gemma 3 with its SigLIP tower behind a real daemon, asked about
real PNG/JPEG/WebP bytes through the official `openai` and `ollama` clients and Anthropic's route; the greedy answer
equals transformers' generate on the same folder, images and chat; the same image twice hits the prefix cache;
/api/show says vision.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import pytest
import torch
from llmd_daemon_proc import start_daemon
from PIL import Image
from tiny_models import write_tiny_gemma3_vision

TOKENS = 8


def picture(fmt: str, color: tuple[int, int, int], size=(80, 60)) -> bytes:
    """A solid picture with a checkered corner (random noise pools to nearly the same embeddings for every image)."""
    img = Image.new("RGB", size, color)
    for x in range(0, 24, 6):
        for y in range(0, 24, 6):
            if (x + y) // 6 % 2:
                img.paste((255 - color[0], 255 - color[1], 255 - color[2]), (x, y, x + 6, y + 6))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


IMAGES = {"png": picture("PNG", (220, 40, 40)), "jpeg": picture("JPEG", (30, 160, 60)),
          "webp": picture("WEBP", (40, 60, 230))}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("vision-served") / "gemma3-vl")


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("vision-daemon") / "llmd", "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


def expected_text(folder, image: bytes, question: str) -> str:
    """transformers' greedy answer to one user turn holding the image then the question."""
    import transformers as tf

    model = tf.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = tf.AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def stats(daemon) -> dict:
    with urllib.request.urlopen(daemon.url + "/v1/llmd/stats", timeout=30) as resp:
        return json.loads(resp.read())["models"][0]["stats"]


def test_openai_client_sees_the_image_as_transformers_does(daemon, folder):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    answers = {}
    for fmt, data in IMAGES.items():
        url = f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"
        reply = client.chat.completions.create(
            model=folder.name, max_tokens=TOKENS, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is this?"}]}])
        answers[fmt] = reply.choices[0].message.content
        assert answers[fmt] == expected_text(folder, data, "What is this?"), fmt
    assert len(set(answers.values())) > 1  # the answer depends on the image
    hits = stats(daemon)["kv"]["prefix_hits_tokens"]
    client.chat.completions.create(  # the same image again: its blocks come from the prefix cache
        model=folder.name, max_tokens=2, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(IMAGES['png']).decode()}"}},
            {"type": "text", "text": "Again?"}]}])
    assert stats(daemon)["kv"]["prefix_hits_tokens"] - hits >= 16


def test_ollama_and_anthropic_routes_and_capabilities(daemon, folder):
    import ollama

    client = ollama.Client(host=daemon.url)
    want = expected_text(folder, IMAGES["png"], "What is this?")
    got = client.chat(model=folder.name, messages=[{"role": "user", "content": "What is this?",
                                                   "images": [IMAGES["png"]]}],
                      options={"temperature": 0, "num_predict": TOKENS, "repeat_penalty": 1.0})
    assert got.message.content == want
    assert "vision" in client.show(folder.name).capabilities
    body = {"model": folder.name, "max_tokens": TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(IMAGES["png"]).decode()}},
        {"type": "text", "text": "What is this?"}]}]}
    req = urllib.request.Request(daemon.url + "/v1/messages", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-api-key": "x"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    text = "".join(b["text"] for b in answer["content"] if b["type"] == "text")
    assert text == want
