"""A remote model: a second llmd process is the OpenAI-compatible upstream of a front daemon, which serves it under
a [models.NAME] url through the same engine seam. Every dialect works through it; streaming; a client hang-up
cancels the upstream request; upstream errors and timeouts map to 4xx/502/504 answers."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import ollama
import openai
import pytest

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MIB = 2**20


@pytest.fixture(scope="module")
def silent_server():
    """A TCP server that accepts connections and never answers (for the timeout)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_upstream"), "--kv-cache-bytes", str(32 * MIB))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def front(tmp_path_factory, upstream, silent_server):
    base = tmp_path_factory.mktemp("llmd_front")
    (base / "config" / "llmd").mkdir(parents=True)
    (base / "config" / "llmd" / "config.toml").write_text(f'''
[models.far]
url = "{upstream.url}/v1"
model = "smollm2:135m"

[models.ghost]
url = "{upstream.url}/v1"
model = "no-such-model"

[models.down]
url = "http://127.0.0.1:1/v1"

[models.mute]
url = "http://127.0.0.1:{silent_server}/v1"
timeout = 1.5
''')
    d = start_daemon(base, "--model", "far")  # the remote model is the front's default: nothing loads locally
    yield d
    assert d.stop() == 0, d.log()


def test_every_dialect_through_the_remote(front):
    client = ollama.Client(host=front.url)
    resp = client.chat(model="far", messages=FRANCE, options={"temperature": 0, "num_predict": 12})
    assert "Paris" in resp.message.content and resp.eval_count > 0
    parts = list(client.generate(model="far", prompt="What is the capital of France?", stream=True,
                                 options={"temperature": 0, "num_predict": 12}))
    assert parts[-1].done and "Paris" in "".join(p.response for p in parts)
    oa = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    chunks = list(oa.chat.completions.create(model="far", messages=FRANCE, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage  # upstream's own token counts (the front tokenizes nothing)
    assert "Paris" in text and 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 20, usage
    done = oa.completions.create(model="far", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 3
    status, ps = front.get_json("/api/ps")
    assert [m["name"] for m in ps["models"]] == ["far"] and ps["models"][0]["size"] == 0
    metrics = urlread(front, "/metrics")
    assert 'llmd:request_success_total{model_name="far",finished_reason="length"}' in metrics


def urlread(d, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(d.url + path, timeout=30) as r:
        return r.read().decode()


async def test_client_hang_up_cancels_upstream(front, upstream):
    before = upstream.stats()
    body = {"model": "far", "messages": FRANCE, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(front.url) as http:
        async with http.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: {")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        s = upstream.stats()
        if s["requests_running"] == 0 and s["server"]["aborts"].get("disconnect", 0) > \
                before["server"]["aborts"].get("disconnect", 0):
            break
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.1)
    assert s["generation_tokens_total"] - before["generation_tokens_total"] < 400  # cut off, not run to the end
    assert s["kv"]["blocks_used"] == 0


@pytest.mark.parametrize("model,status,words", [("ghost", 404, "no-such-model"), ("down", 502, "cannot reach"),
                                                ("mute", 504, "did not answer within 1.5s")])
async def test_upstream_errors_map_to_clear_answers(front, model, status, words):
    async with aiohttp.ClientSession(front.url) as http:
        for stream in (False, True):  # a stream learns upstream's status before its own status line
            body = {"model": model, "messages": FRANCE, "max_tokens": 2, "stream": stream}
            async with http.post("/v1/chat/completions", json=body) as r:
                answer = await r.json()
                assert r.status == status and words in answer["error"]["message"], answer
        async with http.post("/api/chat", json={"model": model, "messages": FRANCE, "stream": False}) as r:
            assert r.status == status and words in (await r.json())["error"]
    assert "Traceback" not in front.log()
