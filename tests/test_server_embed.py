"""Embeddings over HTTP against a real `llmd serve` (bundled SmolLM2): the official openai and ollama clients, the
legacy Ollama route, llama.cpp's routes, and bad input answered with a 4xx naming the field."""

from __future__ import annotations

import base64
import math
import struct

import aiohttp
import httpx
import ollama
import openai
import pytest

from llmd_daemon_proc import start_daemon

MAX_LEN = 128
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_embed"), "--max-model-len", str(MAX_LEN))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def model(daemon) -> str:
    return daemon.stats()["model"]


def server_errors(daemon) -> int:
    return sum(n for code, n in daemon.stats()["server"]["http_responses"].items() if code.startswith("5"))


def close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_openai_client_float_and_base64(daemon, model):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    vec = floats.data[0].embedding
    assert len(vec) == 576 and abs(math.sqrt(sum(x * x for x in vec)) - 1.0) < 1e-5
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    b64 = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")  # asked for: left as text
    decoded = [list(struct.unpack(f"<{len(vec)}f", base64.b64decode(b.embedding))) for b in b64.data]
    assert all(close(f.embedding, d) for f, d in zip(floats.data, decoded))
    default = client.embeddings.create(model=model, input=TEXTS[0])  # the client asks for base64 by itself
    assert close(default.data[0].embedding, vec)
    ids = httpx.post(daemon.url + "/tokenize", json={"content": TEXTS[0], "add_special": True}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids], encoding_format="float")
    assert close(by_ids.data[0].embedding, vec)


def test_ollama_client_embed_and_the_legacy_route(daemon, model):
    client = ollama.Client(host=daemon.url)
    res = client.embed(model=model, input=TEXTS)
    assert len(res.embeddings) == 2 and res.prompt_eval_count > 0 and res.total_duration > 0
    openai_vec = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x").embeddings.create(
        model=model, input=TEXTS[0], encoding_format="float").data[0].embedding
    assert close(res.embeddings[0], openai_vec)
    legacy = client.embeddings(model=model, prompt=TEXTS[0]).embedding  # not normalized, as Ollama answers it
    norm = math.sqrt(sum(x * x for x in legacy))
    assert abs(norm - 1.0) > 1e-3 and close([x / norm for x in legacy], openai_vec, 1e-5)
    long = " ".join(["word"] * (3 * MAX_LEN))
    assert len(client.embed(model=model, input=long).embeddings[0]) == 576  # truncate defaults to true
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=model, input=long, truncate=False)
    assert err.value.status_code == 400 and "input" in str(err.value)


async def test_llamacpp_routes(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        for path in ("/embedding", "/embeddings"):
            async with http.post(path, json={"content": TEXTS[0]}) as resp:
                assert resp.status == 200
                body = await resp.json()
        assert body[0]["index"] == 0 and len(body[0]["embedding"][0]) == 576
        async with http.post("/embedding", json={"content": TEXTS, "embd_normalize": -1}) as resp:
            raw = await resp.json()
        assert len(raw) == 2 and abs(math.sqrt(sum(x * x for x in raw[0]["embedding"][0])) - 1.0) > 1e-3


BAD = [
    ("/v1/embeddings", {"model": "any"}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": {"text": "x"}}, "input"),
    ("/v1/embeddings", {"input": ["a", 5]}, "input[1]"),
    ("/v1/embeddings", {"input": ["a"] * 513}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], [10**9]]}, "input[1]"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "hi " * (3 * MAX_LEN)}, "input"),
    ("/v1/embeddings", {"input": "hi", "model": "other"}, "model"),
    ("/api/embed", {"input": [[1, 2]]}, "input[0]"),
    ("/api/embed", {"input": "hi", "options": {"num_ctx": "big"}}, "options.num_ctx"),
    ("/api/embed", {"input": "hi", "truncate": "yes"}, "truncate"),
    ("/api/embeddings", {"prompt": 5}, "prompt"),
    ("/embedding", {"content": "hi", "embd_normalize": 1}, "embd_normalize"),
    ("/embedding", {}, "content"),
]


async def test_bad_input_is_a_4xx_naming_the_field(daemon):
    before = server_errors(daemon)
    async with aiohttp.ClientSession(daemon.url) as http:
        for path, body, field in BAD:
            async with http.post(path, json=body) as resp:
                text = await resp.text()
                assert 400 <= resp.status < 500, (path, body, resp.status, text)
                assert field in text, (path, body, text)
    assert server_errors(daemon) == before
    s = daemon.wait_idle()
    assert s["kv"]["blocks_used"] == 0 and s["kv"]["blocks_cached"] == 0, s  # embeddings keep no KV
