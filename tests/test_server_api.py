"""The daemon's HTTP dialects, driven by real clients (openai, ollama, aiohttp, curl) against a real `llmd serve`
process on the bundled SmolLM2 model. One daemon per module; generations stay short (2 shared CPU cores)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time

import aiohttp
import pytest

from llmd_daemon_proc import llmd_exe, start_daemon

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
TIMING_KEYS = {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "e2e_ms", "prompt_tokens",
               "cached_prompt_tokens", "generated_tokens", "tokens_per_second", "spec_proposed", "spec_accepted"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_api"))
    yield d
    # `llmd stop` finds the daemon through its socket and stops it gracefully.
    out = subprocess.run([llmd_exe(), "stop"], env=d.env, capture_output=True, text=True, timeout=120)
    code = d.stop()
    assert out.returncode == 0 and "stopped llmd" in out.stdout, out.stderr
    assert code == 0, d.log()
    assert not d.socket_path.exists()


@pytest.fixture(scope="module")
def model_name(daemon):
    return daemon.stats()["model"]


def server_errors(daemon) -> int:
    """5xx answers so far (tests compare before and after, which leaves out /health's 503s while loading)."""
    return sum(n for code, n in daemon.stats()["server"]["http_responses"].items() if code.startswith("5"))


def assert_no_leak(daemon):
    s = daemon.wait_idle()
    assert s["kv"]["blocks_used"] == 0, s  # at idle only evictable cached blocks remain (counted apart)


def test_health_loading_then_ready_and_socket_mode(daemon, model_name):
    assert daemon.saw_loading, "/health should answer 503 while the model loads"
    status, body = daemon.get_json("/health")
    assert status == 200 and body == {"status": "ok", "model": model_name}
    assert daemon.socket_path.stat().st_mode & 0o777 == 0o600


def test_openai_chat_non_streaming_and_streaming(daemon, model_name):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data][0] == model_name  # the loaded default first, then the servable

    resp = client.chat.completions.create(model=model_name, messages=FRANCE, max_tokens=8, temperature=0)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    timings = resp.model_extra["timings"]
    assert set(timings) == TIMING_KEYS
    assert timings["generated_tokens"] == resp.usage.completion_tokens
    assert timings["ttft_ms"] > 0 and timings["e2e_ms"] >= timings["ttft_ms"]

    # Streaming, same greedy request: the same text, usage in a last chunk, timings on the finishing chunk.
    chunks = list(client.chat.completions.create(model=model_name, messages=FRANCE, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == resp.choices[0].finish_reason
    assert set(finishing[0].model_extra["timings"]) == TIMING_KEYS
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == resp.usage.completion_tokens
    # The second identical prompt hits the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_openai_completions_and_fim(daemon, model_name):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    resp = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=3,
                                     temperature=0, logprobs=2)
    assert resp.choices[0].text.strip()
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == resp.usage.completion_tokens and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    # a stop string is named in vLLM's stop_reason next to finish_reason "stop"
    word = resp.choices[0].text.split()[0]
    stopped = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=3,
                                        temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == word

    # SmolLM2 has no fill-in-the-middle tokens: a clear 400 that says so (tests/test_server_fim.py covers a model
    # that has them).
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="def add(a, b):\n    return ", suffix="\n", max_tokens=2)
    assert "fill-in-the-middle" in err.value.message and err.value.param == "suffix"


def test_ollama_client(daemon, model_name):
    import ollama

    client = ollama.Client(host=daemon.url)
    resp = client.chat(model=model_name, messages=FRANCE, options={"num_predict": 8, "temperature": 0})
    assert "Paris" in resp.message.content
    assert resp.done and resp.done_reason in ("stop", "length")
    assert resp.eval_count >= 1 and resp.prompt_eval_count > 5 and resp.total_duration > 0
    assert resp.eval_duration > 0 and resp.prompt_eval_duration > 0

    parts = list(client.generate(model=model_name, prompt="Say hello.", stream=True,
                                 options={"num_predict": 3, "temperature": 0, "seed": 1}))
    assert parts[-1].done and parts[-1].eval_count == 3 and parts[-1].done_reason == "length"
    assert all(not p.done for p in parts[:-1]) and "".join(p.response for p in parts).strip()

    assert [m.model for m in client.list().models][0] == model_name
    # What `ollama list` / `ollama show` print: the file's size, parameter count and quantization (the bundled
    # SmolLM2-135M as GGUF Q4_1), not the dequantized tensors in memory
    listed = client.list().models[0]
    assert listed.size > 50_000_000 and listed.details.format == "gguf"
    assert listed.details.parameter_size == "135M" and listed.details.quantization_level == "Q4_1"
    show = client.show(model_name)
    assert show.details == listed.details
    assert show.capabilities == ["completion"] and show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.context_length"] > 0
    assert [m.model for m in client.ps().models] == [model_name]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=FRANCE)
    assert err.value.status_code == 404 and "no-such-model" in err.value.error


async def test_llamacpp_dialect_with_aiohttp(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}) as r:
            tokens = (await r.json())["tokens"]
        assert "".join(t["piece"] for t in tokens) == "Hello world"
        async with http.post("/detokenize", json={"tokens": [t["id"] for t in tokens]}) as r:
            assert (await r.json())["content"] == "Hello world"
        # A surrogate pair escaped in JSON is one character (U+1F389), not an error
        async with http.post("/tokenize", data=b'{"content": "\\ud83c\\udf89"}') as r:
            assert r.status == 200
            ids = (await r.json())["tokens"]
        async with http.post("/detokenize", json={"tokens": ids}) as r:
            assert (await r.json())["content"] == "\U0001f389"

        async with http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 3, "temperature": 0,
                                                  "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 3
        assert events[-1]["stop_type"] == "limit" and events[-1]["stopping_word"] == ""
        # a stop string ends it as llama.cpp reports one: stop_type "word" and the word
        text = "".join(e["content"] for e in events)
        word = text.strip().split()[0]
        async with http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 3, "temperature": 0,
                                                  "stop": [word]}) as r:
            body = await r.json()
        assert body["stop_type"] == "word" and body["stopping_word"] == word and word not in body["content"]
        assert events[-1]["timings"]["predicted_n"] == 3 and set(events[-1]["llmd_timings"]) == TIMING_KEYS
        assert "".join(e["content"] for e in events).strip()

        async with http.post("/infill", json={"input_prefix": "def square(x):\n    return ", "input_suffix": "\n",
                                              "n_predict": 4}) as r:
            body = await r.json()
        assert r.status == 400 and "fill-in-the-middle" in body["error"]["message"]
        async with http.get("/props") as r:
            props = await r.json()
        assert props["default_generation_settings"]["n_ctx"] > 0 and props["has_infill"] is False


def test_curl_tcp_and_unix_socket(daemon, model_name):
    out = subprocess.run(["curl", "-s", "--unix-socket", str(daemon.socket_path), "http://localhost/health"],
                         capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["status"] == "ok"
    # Socket clients put any name in the URL (Docker-style http://d/, requests-unixsocket the quoted path); no browser
    # reaches a Unix socket, so its Host header is not checked (rebinding needs TCP)
    for url, extra in (("http://llmd/v1/models", []), ("http://x/health", ["-H", "Host: %2Ftmp%2Fllmd.sock"])):
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", str(daemon.socket_path), url,
                              *extra], capture_output=True, text=True, timeout=30)
        assert out.stdout.endswith("\n200"), (url, out.stdout)
    out = subprocess.run(["curl", "-s", "--unix-socket", str(daemon.socket_path),
                          "http://localhost/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"messages": FRANCE, "max_tokens": 2, "temperature": 0})],
                         capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert body["usage"]["completion_tokens"] <= 2 and body["choices"][0]["message"]["content"]
    out = subprocess.run(["curl", "-sN", daemon.url + "/api/chat", "-d",
                          json.dumps({"model": model_name, "messages": FRANCE, "options": {"num_predict": 2}})],
                         capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 2
    assert all(line["done"] is False for line in lines[:-1])


def test_cli_ps_and_run_through_the_socket(daemon, model_name):
    out = subprocess.run([llmd_exe(), "ps"], env=daemon.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert model_name in out.stdout and "running" in out.stdout and "KV cache" in out.stdout
    out = subprocess.run([llmd_exe(), "run", model_name, "What is the capital of France?", "-t", "0", "-n", "12"], env=daemon.env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    out = subprocess.run([llmd_exe(), "run", "no-such-model", "hi"], env=daemon.env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "no-such-model" in out.stderr and "Traceback" not in out.stderr
    # A prompt piped in is the prompt; an empty one (`< /dev/null` in a script) is an error, not a random answer
    out = subprocess.run([llmd_exe(), "run", model_name, "-n", "1"], env=daemon.env, input="Say hi.",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    out = subprocess.run([llmd_exe(), "run", model_name], env=daemon.env, input=" \n", capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "prompt" in out.stderr and not out.stdout


def test_served_model_answers_to_its_short_names(daemon, model_name):
    """`llmd serve` on the bundled default, then `llmd run smollm2:135m ...` (the README's example): the alias and
    the repo id name the served model as long as they resolve to its file (until that repo is pulled)."""
    import ollama
    import openai

    from llmd.store import resolve
    from llmd.store.bundled import BUNDLED_REPO_ID

    served = resolve(None).path
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    for name in ("smollm2:135m", BUNDLED_REPO_ID):
        if resolve(name).path != served:
            continue  # this machine has pulled the repo: the name means those files, not the served ones
        resp = client.chat.completions.create(model=name, messages=FRANCE, max_tokens=1)
        assert resp.usage.completion_tokens == 1
        assert client.models.retrieve(name).id == model_name
        resp = ollama.Client(host=daemon.url).generate(model=name + ":latest" if ":" not in name else name,
                                                       prompt="hi", options={"num_predict": 1})
        assert resp.done and resp.eval_count == 1
    out = subprocess.run([llmd_exe(), "run", "smollm2:135m", "hi", "-n", "1"], env=daemon.env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == (0 if resolve("smollm2:135m").path == served else 1), out.stderr


def test_a_chat_too_long_for_the_context_names_messages(daemon, model_name):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    long_chat = [{"role": "user", "content": "the quick brown fox " * 3000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=long_chat, max_tokens=1)
    assert err.value.param == "messages" and "context holds" in err.value.message


async def test_top_k_minus_one_means_off(daemon, model_name):
    """vLLM's and llama.cpp's clients send top_k -1 for "no top-k"; every dialect accepts it (and 0)."""
    requests = [("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 1, "top_k": -1}),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "top_k": -1}),
                ("/api/generate", {"model": model_name, "prompt": "Hi", "stream": False,
                                   "options": {"num_predict": 1, "top_k": -1}}),
                ("/completion", {"prompt": "Hi", "n_predict": 1, "top_k": -1}),
                ("/completion", {"prompt": "Hi", "n_predict": 1, "top_k": 0})]
    async with aiohttp.ClientSession(daemon.url) as http:
        for path, body in requests:
            async with http.post(path, json=body) as r:
                assert r.status == 200, (path, await r.text())
        async with http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "top_k": -2}) as r:
            assert r.status == 400 and "top_k" in (await r.json())["error"]["message"]


async def test_openai_neutral_values_of_unsupported_features_are_accepted(daemon):
    """Clients often send defaults for what they do not use: text output, an empty tool list, no bias, best_of 1."""
    bodies = [("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "text"}, "tools": [],
                                        "logit_bias": {}, "tool_choice": "none"}),
              ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": "none"}),
              ("/v1/completions", {"prompt": "x", "max_tokens": 1, "best_of": 1, "logit_bias": None})]
    async with aiohttp.ClientSession(daemon.url) as http:
        for path, body in bodies:
            async with http.post(path, json=body) as r:
                assert r.status == 200, (body, await r.text())


async def test_llamacpp_n_predict_zero_only_caches_the_prompt(daemon):
    """llama.cpp: n_predict 0 generates nothing but evaluates the prompt into the cache (llama.vim warms its context
    so); -1 is "until done"."""
    prompt = "Warm this context: " + " ".join(f"word{i}" for i in range(40))
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.post("/completion", json={"prompt": prompt, "n_predict": 0}) as r:
            body = await r.json()
        assert r.status == 200 and body["content"] == "" and body["stop"] is True, body
        assert body["tokens_predicted"] == 0 and body["timings"]["predicted_n"] == 0
        async with http.post("/completion", json={"prompt": prompt, "n_predict": 0, "stream": True}) as r:
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        assert [(e["content"], e["stop"]) for e in events] == [("", True)] and events[0]["tokens_predicted"] == 0
        assert events[0]["tokens_cached"] >= 32  # the first request left the prompt in the prefix cache
        async with http.post("/completion", json={"prompt": prompt, "n_predict": 2, "temperature": 0}) as r:
            body = await r.json()
        assert body["tokens_predicted"] == 2 and body["tokens_cached"] >= 32
    assert_no_leak(daemon)


def test_metrics_and_stats(daemon):
    with __import__("urllib.request").request.urlopen(daemon.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("llmd:time_to_first_token_seconds_count", "llmd:inter_token_latency_seconds_bucket",
                 "llmd:request_queue_time_seconds_sum", "llmd:e2e_request_latency_seconds_count",
                 "llmd:num_requests_running", "llmd:kv_cache_usage_perc", "llmd:prefix_cache_hits_total",
                 "llmd:generation_tokens_total", "llmd:request_prefill_time_seconds_count"):
        assert name in text, name
    ttft_count = next(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("llmd:time_to_first_token_seconds_count"))
    assert ttft_count >= 1
    s = daemon.stats()
    assert {"model", "models", "uptime_s", "kv", "requests_running", "latency"} <= set(s)


async def test_stats_sse_pushes_every_second(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.get("/v1/llmd/stats?stream=1") as r:
            assert r.content_type == "text/event-stream"
            started, events = time.monotonic(), []
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 3:
                    break
    assert all(e["kv"]["blocks_total"] > 0 and "uptime_s" in e and e["models"] for e in events)
    assert events[2]["uptime_s"] - events[0]["uptime_s"] >= 1.5
    assert time.monotonic() - started < 10


async def test_disconnect_mid_stream_and_mid_prompt_abort(daemon):
    before = daemon.stats()["server"]["aborts"].get("disconnect", 0)
    async with aiohttp.ClientSession(daemon.url) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 200, "stream": True,
                                                              "ignore_eos": True})
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 3:
                break
        resp.close()  # drop the connection mid-stream
        await asyncio.to_thread(daemon.wait_idle, 60)
        # A non-streaming request whose client gives up while it is being served.
        task = asyncio.create_task(http.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 200,
                                                                            "ignore_eos": True}))
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(daemon.stats))["requests_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    s = daemon.wait_idle(timeout=60)
    assert s["server"]["aborts"].get("disconnect", 0) - before == 2
    assert_no_leak(daemon)


@pytest.mark.timeout(1800)  # batch-32 CPU decode steps are slow on a shared 2-core machine
async def test_load_32_streams_some_disconnecting(daemon):
    errors_before = server_errors(daemon)
    rng = random.Random(0)
    dropping = set(rng.sample(range(32), 4))  # ~10% hang up at their first event (the role chunk, before prefill)
    statuses, finished = [], 0

    async def one(http, i):
        nonlocal finished
        body = {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 2, "stream": True,
                "temperature": 0.7, "seed": i}
        async with http.post("/v1/chat/completions", json=body) as r:
            statuses.append(r.status)
            async for line in r.content:
                if i in dropping and line.startswith(b"data: {"):
                    return
                if line.strip() == b"data: [DONE]":
                    finished += 1

    async with aiohttp.ClientSession(daemon.url, timeout=aiohttp.ClientTimeout(total=1700)) as http:
        await asyncio.gather(*(one(http, i) for i in range(32)))
    assert statuses == [200] * 32
    assert finished == 32 - len(dropping)
    assert_no_leak(daemon)
    assert server_errors(daemon) == errors_before


# --- bad input: every endpoint answers a clear 4xx in its dialect's shape, never a 500 -------------------------------

MSG = [{"role": "user", "content": "hi"}]
OK_CHAT = {"messages": MSG, "max_tokens": 1}
ANT = {"model": "@", "messages": MSG, "max_tokens": 1}
BAD_INPUTS = [
    # (path, body: dict | bytes, content type, status, words the message must contain)
    ("/v1/chat/completions", b"{not json", "application/json", 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": "\xff\xfe"}', "application/json", 400, "UTF-8"),
    ("/v1/chat/completions", b"", "application/json", 400, "empty"),
    ("/v1/chat/completions", b"[1, 2]", "application/json", 400, "JSON object"),
    ("/v1/chat/completions", b'{"messages": [], "temperature": NaN}', "application/json", 400, "NaN"),
    ("/v1/chat/completions", b"[" * 100000, "application/json", 400, "nested too deeply"),
    ("/v1/chat/completions", json.dumps(OK_CHAT).encode(), "image/png", 415, "content type"),
    ("/v1/chat/completions", b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}', "application/json", 413, "limit"),
    ("/v1/chat/completions", {}, None, 400, "messages is required"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages must be an array"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "at least one"),
    ("/v1/chat/completions", {"messages": MSG * 2000}, None, 400, "at most 1024 messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages[0].content[0].image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, None, 400,
     "not supported"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": -1}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": 10**9}, None, 400, "max_tokens must be at most"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": "5"}, None, 400, "max_tokens must be an integer"),
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 0}, None, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "temperature": 5}, None, 400, "temperature"),
    ("/v1/chat/completions", {**OK_CHAT, "temperature": True}, None, 400, "temperature must be a number"),
    ("/v1/chat/completions", {**OK_CHAT, "top_p": 2}, None, 400, "top_p"),
    ("/v1/chat/completions", {**OK_CHAT, "n": 2}, None, 400, "n must be 1"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": ["x"] * 17}, None, 400, "stop may hold at most 16"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": "x" * 300}, None, 400, "stop strings"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": 5}, None, 400, "stop must be"),
    ("/v1/chat/completions", {**OK_CHAT, "seed": "x"}, None, 400, "seed"),
    ("/v1/chat/completions", {**OK_CHAT, "presence_penalty": 3}, None, 400, "presence_penalty"),
    ("/v1/chat/completions", {**OK_CHAT, "frequency_penalty": -3}, None, 400, "frequency_penalty"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, None, 400, "requires logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "stream": "yes"}, None, 400, "stream must be true or false"),
    ("/v1/chat/completions", {**OK_CHAT, "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("/v1/chat/completions", {**OK_CHAT, "model": "no-such-model"}, None, 404, "no-such-model"),
    # Structured output and tools: malformed requests name the field
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "xml"}}, None, 400, "response_format"),
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, None, 400,
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {**OK_CHAT, "response_format": "json"}, None, 400, "response_format"),
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}}, None, 400, "response_format"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"description": "f"}}]}, None,
     400, "tools[0].function.name"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                                      "parameters": 5}}]}, None,
     400, "tools[0].function.parameters"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, 400,
     "tool_choice.function.name"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                   for i in range(129)]}, None, 400, "at most 128 tools"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}], "max_tokens": 1}, None, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, None, 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {**OK_CHAT, "chat_template_kwargs": {"messages": []}}, None, 400,
     "chat_template_kwargs.messages"),
    ("/v1/chat/completions", {**OK_CHAT, "chat_template_kwargs": {"enable_thinking": "no"}}, None, 400,
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {**OK_CHAT, "logit_bias": {"50": 100}}, None, 400, "logit_bias"),
    ("/v1/chat/completions", {**OK_CHAT, "functions": [{"name": "f"}]}, None, 400, "functions (the legacy form"),
    ("/v1/chat/completions", {**OK_CHAT, "modalities": ["text", "audio"]}, None, 400, "modalities"),
    ("/v1/chat/completions", {**OK_CHAT, "reasoning_effort": "ultra"}, None, 400, "reasoning_effort must be"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                                                      "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]}, None, 400,
     "tools[0].function.parameters asks for strict validation"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, None, 400,
     "tools[0].function.parameters is not a JSON schema"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "best_of": 3}, None, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"50": -100}}, None, 400, "logit_bias"),
    ("/v1/completions", {}, None, 400, "prompt is required"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt must be"),
    ("/v1/completions", {"prompt": [99999999]}, None, 400, "token ids"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, None, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": 3}, None, 400, "suffix must be a string"),
    ("/api/chat", {"messages": MSG}, None, 400, "model is required"),
    ("/api/chat", {"model": "nope", "messages": MSG}, None, 404, "nope"),
    ("/api/chat", {"model": "@", "messages": MSG, "options": "x"}, None, 400, "options must be an object"),
    ("/api/chat", {"model": "@", "messages": MSG, "options": {"temperature": "hot"}}, None, 400,
     "options.temperature"),
    ("/api/chat", {"model": "@", "messages": MSG, "options": {"num_predict": -5}}, None, 400, "options.num_predict"),
    ("/api/chat", {"model": "@", "messages": MSG, "options": {"num_ctx": 0}}, None, 400, "options.num_ctx"),
    ("/api/chat", {"model": "@", "messages": MSG, "format": "yaml"}, None, 400, "format"),
    ("/api/chat", {"model": "@", "messages": MSG, "format": {"type": "object", "properties": 3}}, None, 400,
     "format.properties"),
    ("/api/chat", {"model": "@", "messages": MSG, "think": True}, None, 400, "does not support thinking"),
    ("/api/chat", {"model": "@", "messages": MSG, "tools": [{"type": "function", "function": {}}]}, None, 400,
     "tools[0].function.name"),
    ("/completion", {"prompt": "x", "grammar": "root ::= nope"}, None, 400, "grammar"),
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, None, 400, "grammar"),
    ("/completion", {"prompt": "x", "json_schema": []}, None, 400, "json_schema"),
    ("/api/chat", {"model": "@", "messages": MSG, "images": ["aGk="]}, None, 400, "images"),
    ("/api/chat", {"model": "@", "messages": [{"role": "user", "content": "what is this?", "images": ["aGk="]}]}, None,
     400, "messages[0].images"),
    ("/api/chat", {"model": "@"}, None, 400, "messages"),
    ("/api/generate", {"model": "@", "prompt": "x", "options": {"stop": 5}}, None, 400, "options.stop"),
    ("/api/generate", {"model": "@", "prompt": ["x"]}, None, 400, "prompt must be a string"),
    ("/api/generate", {"model": "nope", "prompt": "x"}, None, 404, "nope"),
    ("/api/show", {}, None, 400, "model is required"),
    ("/api/show", {"model": "nope"}, None, 404, "nope"),
    ("/api/pull", {}, None, 400, "model is required"),
    ("/api/pull", {"model": "nope"}, None, 404, "cannot pull it"),
    ("/api/pull", {"model": "../../etc/passwd"}, None, 400, "file path"),
    ("/api/pull", {"model": "@", "stream": "yes"}, None, 400, "stream must be true or false"),
    ("/api/create", {"from": "smollm2:135m"}, None, 400, "model is required"),
    ("/api/create", {"model": "mine"}, None, 400, "from is required"),
    ("/api/create", {"model": "mine", "from": "smollm2:135m", "parameters": {"temperature": "hot"}}, None, 400,
     "parameters.temperature"),
    ("/api/create", {"model": "mine", "from": "smollm2:135m", "parameters": {"num_ctx": 0}}, None, 400,
     "parameters.num_ctx"),
    ("/api/create", {"model": "mine", "modelfile": "FROM @\nPARAMETER mirostat 1"}, None, 400, "mirostat"),
    ("/api/create", {"model": "mine", "from": "smollm2:135m", "files": {"x.gguf": "sha256:00"}}, None, 400, "files"),
    ("/api/create", {"model": "mine", "from": "/etc/passwd"}, None, 400, "file path"),
    ("/api/copy", {"source": "smollm2:135m"}, None, 400, "destination is required"),
    ("/api/copy", {"source": "nope", "destination": "mine"}, None, 404, "nope"),
    ("/completion", {}, None, 400, "prompt is required"),
    ("/completion", {"prompt": "x", "n_predict": "x"}, None, 400, "n_predict"),
    ("/completion", {"prompt": "x", "n_probs": 100}, None, 400, "n_probs"),
    ("/completion", b"{oops", "application/json", 400, "not valid JSON"),
    ("/infill", {"n_predict": 2}, None, 400, "input_prefix or input_suffix"),
    ("/infill", {"input_prefix": "x", "input_extra": "x"}, None, 400, "input_extra must be an array"),
    ("/infill", {"input_prefix": "x", "input_extra": [{"text": 5}]}, None, 400, "input_extra[0].text"),
    ("/tokenize", {}, None, 400, "content is required"),
    ("/tokenize", {"content": 5}, None, 400, "content must be a string"),
    ("/detokenize", {"tokens": [-1]}, None, 400, "tokens"),
    ("/detokenize", {"tokens": "x"}, None, 400, "tokens"),
    # JSON may escape a lone UTF-16 surrogate, which is no Unicode text: the tokenizer must never see one
    ("/tokenize", b'{"content": "a\\ud800"}', "application/json", 400, "unpaired surrogate"),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 1}', "application/json", 400, "unpaired surrogate"),
    ("/completion", b'{"prompt": "x\\udc00y"}', "application/json", 400, "unpaired surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83c"}]}', "application/json", 400,
     "unpaired surrogate"),
    ("/api/generate", b'{"model": "x", "prompt": "\\ud800", "raw": true}', "application/json", 400,
     "unpaired surrogate"),
    # Anthropic Messages: Anthropic's error shape, the message naming the field
    ("/v1/messages", b"{nope", "application/json", 400, "not valid JSON"),
    ("/v1/messages", {"model": "@", "messages": MSG}, None, 400, "max_tokens is required"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG}, None, 400, "model is required"),
    ("/v1/messages", {"model": "nope", "max_tokens": 4, "messages": MSG}, None, 404, "nope"),
    ("/v1/messages", {**ANT, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, None,
     400, "messages[0].content[0].source"),
    ("/v1/messages", {**ANT, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, None,
     400, "messages[0].content[0].type"),
    ("/v1/messages", {**ANT, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]}, None, 400,
     "messages[0].content[0].tool_use_id"),
    ("/v1/messages", {**ANT, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "42"}]}]}, None, 400,
     "messages[2].content[0].tool_use_id"),
    ("/v1/messages", {**ANT, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "w", "input": "x"}]}, *MSG]}, None, 400,
     "messages[0].content[0].input"),
    ("/v1/messages", {**ANT, "messages": [*MSG, {"role": "assistant", "content": "Sure"}]}, None, 400, "prefill"),
    ("/v1/messages", {**ANT, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}]}, None,
     400, "messages[2].content[0].content[0].type"),
    ("/v1/messages", {**ANT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages[0].role"),
    ("/v1/messages", {**ANT, "messages": MSG * 1025}, None, 400, "at most 1024 messages"),
    ("/v1/messages", {**ANT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]},
     None, 400, "at most 1024 blocks"),
    ("/v1/messages", {**ANT, "system": [{"type": "image"}]}, None, 400, "system[0].type"),
    ("/v1/messages", {**ANT, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, None, 400,
     "tools[0].type"),
    ("/v1/messages", {**ANT, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, None, 400,
     "tools[0].input_schema"),
    ("/v1/messages", {**ANT, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "tool", "name": "g"}}, None, 400, "tool_choice.name"),
    ("/v1/messages", {**ANT, "tool_choice": {"type": "any"}}, None, 400, "tool_choice any needs tools"),
    ("/v1/messages", {**ANT, "thinking": {"type": "enabled", "budget_tokens": 1024}}, None, 400,
     "thinking: model"),
    ("/v1/messages", {**ANT, "thinking": {"type": "sometimes"}}, None, 400, "thinking.type"),
    ("/v1/messages", {**ANT, "container": "c1"}, None, 400, "container"),
    ("/v1/messages", {**ANT, "mcp_servers": [{"type": "url", "url": "http://x"}]}, None, 400, "mcp_servers"),
    ("/v1/messages", {**ANT, "temperature": 1.5}, None, 400, "temperature must be at most 1"),
    ("/v1/messages", {**ANT, "max_tokens": 0}, None, 400, "max_tokens must be at least 1"),
    ("/v1/messages", {**ANT, "stop_sequences": ["x"] * 17}, None, 400, "stop_sequences may hold at most 16"),
    ("/v1/messages", {**ANT, "output_config": {"format": {"type": "xml"}}}, None, 400, "output_config.format"),
    ("/v1/messages", {**ANT, "output_config": {"effort": "extreme"}}, None, 400, "output_config.effort"),
    ("/v1/messages", {**ANT, "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(129)]},
     None, 400, "tools may hold at most 128 tools"),
    ("/v1/messages", b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}', "application/json", 413, "limit"),
    ("/v1/responses", b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}', "application/json", 413, "limit"),
    ("/v1/messages/count_tokens", {"model": "@"}, None, 400, "messages is required"),
    ("/v1/messages/count_tokens", {"model": "@", "messages": [{"role": "user", "content": 5}]}, None, 400,
     "messages[0].content"),
    # OpenAI Responses
    ("/v1/responses", {}, None, 400, "input is required"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, None, 400,
     "previous_response_id names no stored response"),
    ("/v1/responses", {"input": "x", "previous_response_id": 5}, None, 400, "previous_response_id must be a string"),
    ("/v1/responses", {"input": "x", "store": "yes"}, None, 400, "store must be true or false"),
    ("/v1/responses", {"input": "x", "conversation": "conv_1"}, None, 400, "conversation"),
    ("/v1/responses", {"input": "x", "background": True}, None, 400, "background"),
    ("/v1/responses", {"input": "x", "truncation": "auto"}, None, 400, "truncation"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c1", "output": "1"}]}, None, 400,
     "input[0].call_id"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, None, 400, "input[0].type"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None,
     400, "input[0].content[0].image_url"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, None,
     400, "input[0].content[0].type"),
    ("/v1/responses", {"input": [{"role": "robot", "content": "x"}]}, None, 400, "input[0].role"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{x"}]}, None,
     400, "input[0].arguments"),
    ("/v1/responses", {"input": [{"role": "user", "content": "x"}] * 1025}, None, 400, "at most 1024 items"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "array"}}]}]}, None, 400,
     "tools[0].tools[0].parameters"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     None, 400, "tools[0].parameters"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "g"}}, None, 400, "tool_choice.name"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, None, 400,
     "text.format.name"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, None, 400, "text.format.schema asks for strict validation"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "ultra"}}, None, 400, "reasoning.effort must be"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, None, 400, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "model": "nope"}, None, 404, "nope"),
]


def error_message(path: str, body: dict) -> str:
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["type"], str)  # Anthropic's shape
        return body["error"]["message"]
    if path.startswith("/api/"):
        assert isinstance(body["error"], str)  # Ollama's shape
        return body["error"]
    err = body["error"]
    assert isinstance(err, dict) and isinstance(err["message"], str)  # OpenAI's and llama.cpp's shape
    if path.startswith("/v1/"):
        assert {"message", "type", "param", "code"} <= set(err)
    return err["message"]


async def test_bad_inputs_every_endpoint(daemon, model_name):
    errors_before = server_errors(daemon)
    async with aiohttp.ClientSession(daemon.url) as http:
        for path, body, ctype, status, words in BAD_INPUTS:
            if isinstance(body, dict) and body.get("model") == "@":
                body = {**body, "model": model_name}
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with http.post(path, data=data, headers={"Content-Type": ctype or "application/json"}) as r:
                payload = await r.json(content_type=None)
                assert r.status == status, (path, body if len(data) < 300 else "...", r.status, payload)
                assert words in error_message(path, payload), (path, words, payload)
        for method, path, status in (("GET", "/v1/nope", 404), ("DELETE", "/v1/models", 405), ("GET", "/api/nope", 404),
                                     ("GET", "/chat/completions", 404), ("PUT", "/completion", 405),
                                     ("GET", "/v1/messages", 405), ("GET", "/v1/messages/nope", 404),
                                     ("GET", "/v1/responses/resp_nope", 404), ("DELETE", "/v1/responses/x", 404),
                                     ("GET", "/api/pull", 405), ("POST", "/api/delete", 405)):
            async with http.request(method, path) as r:
                assert r.status == status
                error_message(path, await r.json())
    status, body = daemon.get_json("/health")  # still serving
    assert status == 200
    assert server_errors(daemon) == errors_before


# --- local-only security on every route ------------------------------------------------------------------------------

ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/llmd/stats"), ("GET", "/v1/models"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/api/chat"),
          ("POST", "/api/generate"), ("GET", "/api/tags"), ("POST", "/api/show"), ("GET", "/api/ps"),
          ("GET", "/api/version"), ("GET", "/"), ("POST", "/completion"), ("POST", "/infill"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/props"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
          ("POST", "/v1/embeddings"), ("POST", "/api/embed"), ("POST", "/api/embeddings"), ("POST", "/embedding"),
          ("POST", "/embeddings"), ("POST", "/api/pull"), ("POST", "/api/create"), ("POST", "/api/copy"),
          ("DELETE", "/api/delete")]


async def test_host_and_origin_checked_on_every_route(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        for method, path in ROUTES:
            for headers in ({"Host": "evil.example.com"}, {"Host": "evil.example.com:8471"},
                            {"Origin": "https://evil.example.com"}, {"Origin": "null"},
                            {"Origin": "http://localhost.evil.com"}):
                async with http.request(method, path, headers=headers, data=b"{}") as r:
                    assert r.status == 403, (method, path, headers, r.status)
                    assert "Access-Control-Allow-Origin" not in r.headers
            # Allowed: loopback Host names and editor / localhost origins (echoed, never "*").
            for headers in ({"Host": "localhost:1234"}, {"Host": "[::1]"}, {"Origin": "vscode-webview://abc"},
                            {"Origin": "http://127.0.0.1:3000"}):
                async with http.request(method, path, headers=headers, data=b"{}") as r:
                    assert r.status != 403, (method, path, headers)
                    if "Origin" in headers:
                        assert r.headers.get("Access-Control-Allow-Origin") == headers["Origin"]
        async with http.options("/v1/chat/completions", headers={"Origin": "vscode-webview://abc",
                                                                  "Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "vscode-webview://abc"
            assert "x-api-key" in r.headers["Access-Control-Allow-Headers"]  # browser Anthropic clients send it
        async with http.options("/v1/chat/completions", headers={"Origin": "https://evil.example.com"}) as r:
            assert r.status == 403


def test_refuses_public_bind_without_token(tmp_path):
    from llmd_daemon_proc import llmd_exe

    env = {"XDG_RUNTIME_DIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([llmd_exe(), "serve", "--host", "0.0.0.0", "--socket", "off"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "without an API key" in out.stderr and "Traceback" not in out.stderr
