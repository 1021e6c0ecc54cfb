"""Fill-in-the-middle end to end on a model that has FIM tokens: a tiny random-weight Qwen2 whose tokenizer gets
Qwen's <|fim_*|> tokens. Random weights make any text possible, so the checks are on the prompt built from the FIM
tokens (exact token counts) and on a completion being produced."""

from __future__ import annotations

import json
import shutil

import aiohttp
import pytest
from tokenizers import AddedToken, Tokenizer

from llmd_daemon_proc import start_daemon

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def daemon(tiny_qwen2, tmp_path_factory):
    base = tmp_path_factory.mktemp("llmd_fim")
    folder = base / "tiny-fim"
    shutil.copytree(tiny_qwen2, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    tok.save(str(folder / "tokenizer.json"))
    d = start_daemon(base, "--model", str(folder))
    yield d
    assert d.stop() == 0


async def token_count(http, text: str) -> int:
    async with http.post("/tokenize", json={"content": text}) as r:
        return len((await r.json())["tokens"])


async def test_fim_via_completions_suffix_and_infill(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        expected_prompt = await token_count(http, PREFIX) + await token_count(http, SUFFIX) + 3
        async with http.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}) as r:
            body = await r.json()
        assert r.status == 200, body
        assert body["usage"]["prompt_tokens"] == expected_prompt
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"

        async with http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 5,
                                              "temperature": 0}) as r:
            infill = await r.json()
        assert r.status == 200, infill
        assert infill["tokens_evaluated"] == expected_prompt and 1 <= infill["tokens_predicted"] <= 5
        if infill["tokens_predicted"] == 5:  # greedy, same prompt: the same completion as above
            assert infill["content"] == body["choices"][0]["text"]

        extra = [{"filename": "util.py", "text": "import math"}]
        async with http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2,
                                              "input_extra": extra, "stream": True}) as r:
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        assert events[-1]["stop"] is True and events[-1]["tokens_evaluated"] > expected_prompt

        async with http.post("/api/show", json={"model": "tiny-fim"}) as r:
            assert "insert" in (await r.json())["capabilities"]
        async with http.post("/api/generate", json={"model": "tiny-fim", "prompt": PREFIX, "suffix": SUFFIX,
                                                    "stream": False, "options": {"num_predict": 3}}) as r:
            gen = await r.json()
        assert gen["done"] is True and gen["prompt_eval_count"] == expected_prompt and gen["eval_count"] >= 1
