"""Names made with /api/create and /api/copy (llmd.store.created, .modelfile) and model digests (llmd.store.digest):
fast checks on the real bundled model and small files written here; tests/test_ollama_models.py drives the same
through a real daemon with the official `ollama` client."""

from __future__ import annotations

import hashlib
import json

import pytest

from llmd.errors import ModelNotFound
from llmd.store import BUNDLED_NAME, ModelFiles, list_models, resolve_name
from llmd.store.created import Created, copy, create, created_file, remove_created
from llmd.store.digest import Digests
from llmd.store.modelfile import Modelfile, ModelfileError, format_modelfile, parse_modelfile

MODELFILE = '''# a pirate
FROM smollm2:135m
parameter temperature 0
PARAMETER stop "<|im_end|>"
PARAMETER stop END
SYSTEM """You are a pirate.
Answer in one line."""
'''


@pytest.fixture
def env(tmp_path, monkeypatch, smollm2_gguf):
    """Empty stores and llmd dirs under tmp_path; the bundled model is the one model of the stores."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


def test_modelfile_instructions_round_trip_and_refusals():
    spec = parse_modelfile(MODELFILE)
    assert spec.base == "smollm2:135m" and spec.system == "You are a pirate.\nAnswer in one line."
    assert spec.parameters == {"temperature": 0.0, "stop": ["<|im_end|>", "END"]}
    again = parse_modelfile(format_modelfile(spec.base, spec.parameters, spec.template, spec.system))
    assert (again.base, again.parameters, again.system) == (spec.base, spec.parameters, spec.system)
    for text, words in (("FROM x\nADAPTER ./lora.gguf", "line 2: ADAPTER"), ("MESSAGE user hi", "MESSAGE"),
                        ("PARAMETER mirostat 1", "mirostat: llmd does not apply"),
                        ("PARAMETER num_ctx big", "num_ctx must be an integer"), ('SYSTEM """open', "never closes"),
                        ("FOO bar", "unknown instruction FOO"), ("{{ .Prompt }}", "expected an instruction")):
        with pytest.raises(ModelfileError, match=words):
            parse_modelfile(text)


def test_create_copy_remove_through_name_resolution(env, smollm2_gguf):
    spec = parse_modelfile(MODELFILE)
    made = create("Pirate", spec, now=1.0)
    assert made.name == "pirate:latest" and made.base == "smollm2:135m"
    files = resolve_name("pirate")  # the bundled file, carrying the name's own defaults
    assert files.path.resolve() == smollm2_gguf.resolve() and files.created == made
    assert resolve_name("pirate:latest").created == made
    # FROM a created name: flattened, so deleting that one leaves this one whole
    child = create("pirate-cold", Modelfile(base="pirate", parameters={"temperature": 0.5}), now=2.0)
    assert child.base == "smollm2:135m" and child.system == made.system
    assert child.parameters == {"temperature": 0.5, "stop": ["<|im_end|>", "END"]}
    twin = copy("pirate", "pirate2", now=3.0)
    assert (twin.name, twin.base, twin.settings()) == ("pirate2:latest", made.base, made.settings())
    listed = {m.name: m for m in list_models()}
    assert listed["pirate:latest"].source == "created" and listed["pirate:latest"].info.quantization == "Q4_1"
    assert listed[BUNDLED_NAME].names == [BUNDLED_NAME, "smollm2:135m"]  # the alias, while that repo is not pulled
    saved = json.loads(created_file().read_text())["models"]
    assert set(saved) == {"pirate:latest", "pirate-cold:latest", "pirate2:latest"}
    assert remove_created("pirate") and not remove_created("pirate")
    with pytest.raises(ModelNotFound):
        resolve_name("pirate")
    assert resolve_name("pirate-cold").created.system == made.system


def test_created_names_and_froms_are_checked(env):
    good = Modelfile(base="smollm2:135m")
    for name in ("/etc/passwd", "../x", "a\\b", "x.gguf"):
        with pytest.raises(ModelfileError, match="file path") as err:
            create(name, good, now=0)
        assert err.value.field == "model"
    for name, words in (("a b", "not a model name"), (BUNDLED_NAME, "already the name"),
                        ("smollm2:135m", "already the name"), ("qwen3:0.6b", "already the name")):
        with pytest.raises(ModelfileError, match=words):
            create(name, good, now=0)
    with pytest.raises(ModelfileError, match="from:.*file path") as err:
        create("mine", Modelfile(base="/models/x.gguf"), now=0)
    assert err.value.field == "from"
    with pytest.raises(ModelNotFound, match="from:.*nothing-here"):
        create("mine", Modelfile(base="nothing-here"), now=0)
    with pytest.raises(ModelfileError, match="Go template") as err:
        create("mine", Modelfile(base="smollm2:135m", template="{{ .System }} {{ .Prompt }}"), now=0)
    assert err.value.field == "template"
    with pytest.raises(ModelfileError, match="renders `messages`"):
        create("mine", Modelfile(base="smollm2:135m", template="{{ prompt }}"), now=0)
    assert not created_file().exists()  # nothing was written for any of them


def test_digests_content_stand_in_cache_and_created(tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    two.write_bytes(b"GGUF" + bytes(256) * 64)
    gguf = ModelFiles("one", "gguf", one)
    # the first answer for a file never waits for its hash: a stand-in, the same from any fresh cache
    stand_in = Digests(tmp_path / "elsewhere.json").of(gguf)
    digests = Digests(tmp_path / "digests.json")
    assert digests.of(gguf) == stand_in and len(stand_in) == 64
    assert digests.settle(30)
    content = hashlib.sha256(one.read_bytes()).hexdigest()
    assert digests.of(gguf) == content != stand_in  # what sha256sum prints
    assert digests.of(ModelFiles("two", "gguf", two)) != content
    # a fresh daemon reads the hash from the cache file: nothing is queued to hash again
    cached = Digests(tmp_path / "digests.json")
    assert cached.of(gguf) == content and cached._queue.unfinished_tasks == 0
    with open(one, "ab") as fh:  # a changed file is hashed again
        fh.write(b"more")
    assert cached.of(gguf) != content and cached.settle(30)
    assert cached.of(gguf) == hashlib.sha256(one.read_bytes()).hexdigest()
    # an HF folder: its weight shards, by name
    folder = tmp_path / "hf"
    folder.mkdir()
    for shard, data in (("b.safetensors", b"bb"), ("a.safetensors", b"a")):
        (folder / shard).write_bytes(data)
    (folder / "config.json").write_text("{}")
    hf = ModelFiles("hf", "hf", folder)
    digests.of(hf)
    assert digests.settle(30)
    lines = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in (("a.safetensors", b"a"),
                                                                          ("b.safetensors", b"bb")))
    assert digests.of(hf) == hashlib.sha256(lines.encode()).hexdigest()
    # a store's own digest wins; a created name: the base's when it adds nothing (a copy), else its own
    assert digests.of(ModelFiles("o", "gguf", one, digest="e" * 64)) == "e" * 64
    digests.of(gguf)  # (the changed file: this instance hashes it again, then answers with its content)
    assert digests.settle(30)
    base = digests.of(gguf)
    assert digests.of(ModelFiles("c", "gguf", one, created=Created("c:latest", "one"))) == base
    pirate = Created("p:latest", "one", system="You are a pirate.")
    assert digests.of(ModelFiles("p", "gguf", one, created=pirate)) not in (base, stand_in)


def test_embedding_models_are_told_apart(tmp_path, smollm2_gguf):
    """/api/show's `embedding` capability: a GGUF that declares its pooling, or a sentence-transformers folder."""
    import gguf
    import numpy as np

    from llmd.store import describe, resolve

    assert not describe(resolve(str(smollm2_gguf))).embedding  # a chat model
    for pooled in (False, True):
        path = tmp_path / f"m{int(pooled)}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        if pooled:
            w.add_pooling_type(gguf.PoolingType.MEAN)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert describe(resolve(str(path))).embedding is pooled
    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert not describe(resolve(str(folder))).embedding
    (folder / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                      "type": "sentence_transformers.models.Pooling"}]))
    assert describe(resolve(str(folder))).embedding
