"""Ollama's model identity and verbs through the official `ollama` client against a real daemon: the bundled SmolLM2
(pinned), a tiny random model in the daemon's own Hugging Face cache (`someone/tiny-qwen2`, as `llmd pull` leaves
one) and a fake Ollama store holding `smol`. Digests tell models apart and match the files; every name a model
answers to is listed; /api/show's capabilities; /api/pull of a present model and of an unknown name; /api/create
(structured fields and the Modelfile text) then chats whose SYSTEM and PARAMETER apply; /api/copy; /api/delete and
what it refuses."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path

import aiohttp
import ollama
import openai
import pytest
from test_model_manager import write_ollama_store
from test_store import add_to_hub_cache

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow

BUNDLED = "smollm2:135m-instruct-q4_1"
TINY = "someone/tiny-qwen2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You are a geography teacher. Answer in one short sentence."
MIB = 2**20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_qwen2, smollm2_gguf):
    base = tmp_path_factory.mktemp("llmd_ollama_models")
    add_to_hub_cache(base / "hf", TINY, tiny_qwen2)
    store = write_ollama_store(base / "ollama" / "models", smollm2_gguf)
    d = start_daemon(base, "--kv-cache-bytes", str(48 * MIB),
                     env={"OLLAMA_MODELS": str(store), "HF_HOME": str(base / "hf"),
                          "HF_HUB_CACHE": str(base / "hf" / "hub")})
    d.extra["base"] = base
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url)


def server_errors(d) -> int:
    return sum(n for code, n in d.stats()["server"]["http_responses"].items() if code.startswith("5"))


def tags(client) -> dict[str, str]:
    return {m.model: m.digest for m in client.list().models}


def show(d, name: str) -> dict:
    """/api/show's whole answer (the ollama client keeps only the fields it knows)."""
    req = urllib.request.Request(d.url + "/api/show", data=json.dumps({"model": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def folder_digest(folder: Path) -> str:
    """An HF folder's content digest: its safetensors shards' hashes, by name (llmd.store.digest)."""
    lines = "".join(f"{sha256(p.read_bytes())}  {p.name}\n" for p in sorted(folder.glob("*.safetensors")))
    return sha256(lines.encode())


def test_digests_tell_loaded_models_apart_and_match_the_files(daemon, client, smollm2_gguf, tiny_qwen2):
    client.generate(model=TINY, prompt="", keep_alive=-1)  # a second model loaded beside the pinned SmolLM2
    ps = {m.model: m.digest for m in client.ps().models}
    assert set(ps) == {BUNDLED, TINY} and ps[BUNDLED] != ps[TINY], ps
    assert all(len(d) == 64 and set(d) <= set("0123456789abcdef") for d in ps.values())
    # Until its weights are hashed (once, in the background) a model's digest is a stand-in; then the content's
    want = {BUNDLED: sha256(smollm2_gguf.read_bytes()), TINY: folder_digest(tiny_qwen2)}
    deadline = time.monotonic() + 120
    while {name: tags(client).get(name) for name in want} != want:
        assert time.monotonic() < deadline, tags(client)
        time.sleep(0.5)
    listed = tags(client)
    assert listed["smollm2:135m"] == listed[BUNDLED]  # the README's name for the bundled model, the same model
    manifest = Path(daemon.extra["base"]) / "ollama/models/manifests/registry.ollama.ai/library/smol/latest"
    assert listed["smol:latest"] == sha256(manifest.read_bytes())  # Ollama's own, though its blob is the same file
    assert {m.model: m.digest for m in client.ps().models} == want
    assert show(daemon, "smollm2:135m")["digest"] == want[BUNDLED]
    cards = {m.id: m.llmd for m in openai.OpenAI(base_url=daemon.url + "/v1", api_key="x").models.list().data}
    assert cards["smollm2:135m"]["digest"] == want[BUNDLED] and cards[TINY]["digest"] == want[TINY]
    version = daemon.get_json("/api/version")[1]["version"]
    assert tuple(map(int, version.split("."))) >= (0, 13, 4)  # what `codex --oss` asks for
    client.generate(model=TINY, prompt="", keep_alive=0)


def test_pull_a_present_model_and_an_unknown_name(client, daemon):
    assert client.pull("smollm2:135m").status == "success"
    lines = list(client.pull("smollm2:135m", stream=True))
    assert [p.status for p in lines][0] == "pulling manifest" and lines[-1].status == "success"
    layer = lines[1]
    assert layer.digest == "sha256:" + tags(client)["smollm2:135m"] and layer.completed == layer.total > 50 * MIB
    assert client.pull(TINY).status == "success" and client.pull("smol").status == "success"
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as err:
            list(client.pull("no-such-model", stream=True)) if stream else client.pull("no-such-model")
        assert err.value.status_code == 404 and "no-such-model" in err.value.error and "Hugging Face" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("../../etc/passwd")
    assert err.value.status_code == 400


def test_show_capabilities_follow_the_template(client):
    assert client.show("smollm2:135m").capabilities == ["completion"]  # SmolLM2's template takes no tools
    tools_and_thinking = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is false %}<think></think>"
                          "{% endif %}")
    client.create(model="hermes-like", from_="smollm2:135m", template=tools_and_thinking)
    shown = client.show("hermes-like")
    assert shown.capabilities == ["completion", "tools", "thinking"] and shown.template == tools_and_thinking
    reply = client.chat(model="hermes-like", messages=FRANCE, options={"num_predict": 2})
    assert reply.prompt_eval_count != client.chat(model="smollm2:135m", messages=FRANCE,
                                                  options={"num_predict": 2}).prompt_eval_count
    client.delete("hermes-like")


async def test_create_then_chat_with_its_system_and_parameters(client, daemon):
    errors = server_errors(daemon)
    assert client.create(model="teacher", from_="smollm2:135m", system=SYSTEM,
                         parameters={"temperature": 0, "stop": ["Paris"]}).status == "success"
    made = client.chat(model="teacher", messages=FRANCE, options={"num_predict": 24})
    # the same as the base model asked with that system message and those options
    base = client.chat(model="smollm2:135m", messages=[{"role": "system", "content": SYSTEM}, *FRANCE],
                       options={"num_predict": 24, "temperature": 0, "stop": ["Paris"]})
    assert made.message.content == base.message.content and made.prompt_eval_count == base.prompt_eval_count
    assert "Paris" not in made.message.content and made.done_reason == "stop", made
    plain = client.chat(model="smollm2:135m", messages=FRANCE, options={"num_predict": 24, "temperature": 0})
    assert plain.prompt_eval_count != made.prompt_eval_count and "Paris" in plain.message.content
    # every route: the OpenAI one too
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x")
    assert oai.chat.completions.create(model="teacher", messages=FRANCE, max_tokens=24).choices[0].message.content \
        == made.message.content
    shown = show(daemon, "teacher")
    assert shown["details"]["parent_model"] == "smollm2:135m" and shown["system"] == SYSTEM
    assert "stop" in shown["parameters"] and "FROM smollm2:135m" in shown["modelfile"]
    # the older clients' Modelfile text, streamed: the same settings make the same model (the same digest)
    modelfile = f'FROM smollm2:135m\nPARAMETER temperature 0\nPARAMETER stop Paris\nSYSTEM """{SYSTEM}"""\n'
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.post("/api/create", json={"model": "teacher-text", "modelfile": modelfile}) as r:
            assert r.status == 200 and r.content_type == "application/x-ndjson"
            statuses = [json.loads(line)["status"] async for line in r.content if line.strip()]
    assert statuses[-1] == "success"
    listed = tags(client)
    assert listed["teacher-text:latest"] == listed["teacher:latest"] != listed["smollm2:135m"]
    assert "teacher:latest" in {m.id for m in oai.models.list().data}
    assert server_errors(daemon) == errors


async def test_copy_delete_and_what_is_refused(client, daemon):
    errors = server_errors(daemon)
    client.create(model="teacher2", from_="smollm2:135m", system=SYSTEM, parameters={"temperature": 0})
    assert client.copy("teacher2", "teacher3").status == "success"
    listed = tags(client)
    assert listed["teacher3:latest"] == listed["teacher2:latest"]  # a copy is the same model
    want = client.chat(model="teacher2", messages=FRANCE, options={"num_predict": 6}).message.content
    assert client.chat(model="teacher3", messages=FRANCE, options={"num_predict": 6}).message.content == want
    assert client.delete("teacher3").status == "success"
    assert "teacher3:latest" not in tags(client) and "teacher2:latest" in tags(client)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="teacher3", messages=FRANCE)
    assert err.value.status_code == 404

    for name, status, words in (("smol", 400, "ollama rm"), (BUNDLED, 400, "bundled"),
                                ("smollm2:135m", 400, "bundled"), ("no-such-model", 404, "no-such-model")):
        with pytest.raises(ollama.ResponseError) as err:
            client.delete(name)
        assert err.value.status_code == status and words in err.value.error, (name, err.value.error)
    assert client.chat(model="smol", messages=FRANCE, options={"num_predict": 1}).done  # still there

    for fields, status, words in (
            ({"adapters": {"lora.gguf": "sha256:" + "0" * 64}}, 400, "adapters"),
            ({"template": "{{ .System }} {{ .Prompt }}"}, 400, "Go template"),
            ({"from_": "/etc/passwd"}, 400, "file path"), ({"from_": "no-such-model"}, 404, "no-such-model")):
        with pytest.raises(ollama.ResponseError) as err:
            client.create(model="bad", **{"from_": "smollm2:135m", **fields})
        assert err.value.status_code == status and words in err.value.error, (fields, err.value.error)
    async with aiohttp.ClientSession(daemon.url) as http:  # the Modelfile text, as older clients send it
        body = {"model": "bad", "stream": False, "modelfile": "FROM smollm2:135m\nADAPTER ./lora.gguf"}
        async with http.post("/api/create", json=body) as r:
            assert r.status == 400 and "ADAPTER" in (await r.json())["error"]
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="smollm2:135m", from_="smol")
    assert err.value.status_code == 400 and "already the name" in err.value.error
    assert "bad:latest" not in tags(client)

    # a model llmd pulled into the HF cache is deleted from it (unloaded first when loaded)
    client.generate(model=TINY, prompt="", keep_alive=-1)
    assert client.delete(TINY).status == "success"
    assert not (Path(daemon.extra["base"]) / "hf" / "hub" / "models--someone--tiny-qwen2").exists()
    assert TINY not in tags(client)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=TINY, messages=FRANCE)
    assert err.value.status_code == 404
    assert server_errors(daemon) == errors
