"""A base model (no chat template, as the Gemma 3 270M GGUF ships): Ollama's /api/generate reads the prompt as it
is, as Ollama's default template does, while the chat routes say the model has no chat template."""

from __future__ import annotations

import json
import shutil

import ollama
import openai
import pytest

from llmd_daemon_proc import start_daemon


@pytest.fixture(scope="module")
def base_model(tiny_llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("llmd_base_model")
    folder = base / "tiny-base"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    d = start_daemon(base, "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


def test_generate_reads_the_prompt_raw_and_chat_is_a_400(base_model):
    client = ollama.Client(host=base_model.url)
    raw = client.generate(model="tiny-base", prompt="def fibonacci(n):", raw=True,
                          options={"temperature": 0, "num_predict": 4})
    plain = client.generate(model="tiny-base", prompt="def fibonacci(n):", options={"temperature": 0, "num_predict": 4})
    assert plain.response == raw.response and plain.prompt_eval_count == raw.prompt_eval_count > 0
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="tiny-base", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400 and "template" in str(err.value)
    oa = openai.OpenAI(base_url=base_model.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tiny-base", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "template" in str(err.value)
