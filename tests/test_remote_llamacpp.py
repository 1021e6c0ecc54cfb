"""A remote model served by llama.cpp's own OpenAI-compatible server (llama-cpp-python's `llama_cpp.server`, on the
bundled SmolLM2 file): llmd's front daemon forwards to it under a [models.NAME] url, so Ollama, OpenAI and llama.cpp
clients of llmd reach another engine. Deselected by default (`anchor`): `make bench-anchor` installs the server,
then `pytest -m anchor tests/test_remote_llamacpp.py`."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import ollama
import openai
import pytest

from llmd_daemon_proc import free_port, start_daemon

pytestmark = [pytest.mark.anchor, pytest.mark.slow]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llama_server(smollm2_gguf, tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("llama_server") / "server.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf),
                             "--model_alias", "smol", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                break
        except OSError:
            log.seek(0)
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def front(tmp_path_factory, llama_server):
    base = tmp_path_factory.mktemp("llmd_front_llamacpp")
    (base / "config" / "llmd").mkdir(parents=True)
    (base / "config" / "llmd" / "config.toml").write_text(f'[models.lc]\nurl = "{llama_server}/v1"\nmodel = "smol"\n')
    d = start_daemon(base, "--model", "lc")
    yield d
    assert d.stop() == 0, d.log()


def test_dialects_reach_llama_cpp_server(front):
    resp = ollama.Client(host=front.url).chat(model="lc", messages=FRANCE,
                                              options={"temperature": 0, "num_predict": 16})
    assert "Paris" in resp.message.content and resp.eval_count > 0
    oa = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    chunks = list(oa.chat.completions.create(model="lc", messages=FRANCE, max_tokens=16, temperature=0, stream=True))
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    done = oa.completions.create(model="lc", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert done.choices[0].text.strip() and done.choices[0].finish_reason == "length"
    status, ps = front.get_json("/api/ps")
    assert status == 200 and [m["name"] for m in ps["models"]] == ["lc"]
    assert "Traceback" not in front.log()
