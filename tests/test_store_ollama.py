"""Ollama's store read in place (llmd.store.ollama), request-name checks (llmd.store.names) and keep_alive parsing:
fast checks on a fake store written here; tests/test_model_manager.py serves from one through a real daemon."""

from __future__ import annotations

import hashlib
import json

import pytest

from llmd.config import parse_keep_alive
from llmd.errors import ModelFileError, ModelNotFound
from llmd.store import BadModelName, OllamaStore, check_name, resolve, resolve_name
from llmd.store.ollama import parse_name

HEX = "0123456789abcdef" * 4


def manifest(root, name, tag, layers, host="registry.ollama.ai", namespace="library"):
    folder = root / "manifests" / host / namespace / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tag).write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def model_layer(hexdigest=HEX):
    return {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{hexdigest}", "size": 8}


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "models"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{HEX}").write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


def test_names_parse_like_ollamas():
    n = parse_name("llama3.2:3b")
    assert (n.host, n.namespace, n.model, n.tag, n.short) == ("registry.ollama.ai", "library", "llama3.2", "3b",
                                                              "llama3.2:3b")
    assert parse_name("qwen2.5-coder").tag == "latest"
    n = parse_name("hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M")
    assert (n.host, n.namespace, n.model, n.tag) == ("hf.co", "bartowski", "llama-3.2-1b-gguf", "Q4_K_M")
    assert parse_name("user/model:v1").short == "user/model:v1"
    for bad in ("../x", "a/../b", "a/b/c/d", "x:../y", "a\\b", "a\x00b", "", ".hidden", "a:b/c"):
        assert parse_name(bad) is None, bad


def test_manifest_resolves_to_its_blob_read_only(store):
    params = {"stop": ["<|eot|>"], "num_ctx": 4096, "temperature": 0.2, "mirostat": 1}
    raw = json.dumps(params).encode()
    pdigest = "f" * 64
    (store / "blobs" / f"sha256-{pdigest}").write_bytes(raw)
    manifest(store, "llama3.2", "3b", [model_layer(), {"mediaType": "application/vnd.ollama.image.template",
                                                       "digest": "sha256:" + "e" * 64, "size": 3},
                                       {"mediaType": "application/vnd.ollama.image.params",
                                        "digest": f"sha256:{pdigest}", "size": len(raw)}])
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    files = resolve_name("llama3.2:3b")
    assert files.kind == "gguf" and files.source == "ollama" and files.name == "llama3.2:3b"
    assert files.path == (store / "blobs" / f"sha256-{HEX}").resolve()
    assert files.options == {"stop": ["<|eot|>"], "num_ctx": 4096, "temperature": 0.2}  # mirostat is not applied
    written = (store / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "3b").read_bytes()
    assert files.digest == hashlib.sha256(written).hexdigest()  # the manifest's, as `ollama list` shows it
    assert resolve("llama3.2:3b").path == files.path  # the command line finds it too
    assert [m.name.short for m in OllamaStore().list()] == ["llama3.2:3b"]
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == before  # nothing written


def test_bad_store_entries_are_refused_with_the_file_named(store, tmp_path):
    manifest(store, "nomodel", "latest", [{"mediaType": "application/vnd.ollama.image.template",
                                           "digest": "sha256:" + "e" * 64}])
    with pytest.raises(ModelFileError, match="no GGUF model layer"):
        resolve_name("nomodel")
    manifest(store, "dots", "latest", [model_layer("../../../../etc/passwd")])
    with pytest.raises(ModelFileError, match="bad layer digest"):
        resolve_name("dots")
    manifest(store, "short", "latest", [model_layer("abc")])
    with pytest.raises(ModelFileError, match="64 hex digits"):
        resolve_name("short")
    manifest(store, "missing", "latest", [model_layer("1" * 64)])
    with pytest.raises(ModelFileError, match="missing"):
        resolve_name("missing")
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    (store / "blobs" / f"sha256-{'2' * 64}").symlink_to(outside)
    manifest(store, "escape", "latest", [model_layer("2" * 64)])
    with pytest.raises(ModelFileError, match="outside Ollama's store"):
        resolve_name("escape")
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"layers": [model_layer()]}))
    folder = store / "manifests" / "registry.ollama.ai" / "library" / "linked"
    folder.mkdir(parents=True)
    (folder / "latest").symlink_to(secret)  # a manifest that is a symlink out of the store
    with pytest.raises(ModelFileError, match="outside Ollama's store"):
        resolve_name("linked")
    pdigest = "3" * 64
    (store / "blobs" / f"sha256-{pdigest}").write_text(json.dumps({"stop": "not a list"}))
    manifest(store, "badparams", "latest", [model_layer(), {"mediaType": "application/vnd.ollama.image.params",
                                                            "digest": f"sha256:{pdigest}"}])
    with pytest.raises(ModelFileError, match="stop"):
        resolve_name("badparams")
    assert [m.name.short for m in OllamaStore().list()] == []  # every entry above is unreadable: none listed


@pytest.mark.parametrize("name", ["/etc/passwd", "../../x", "file:///etc/passwd", "a\x00b", "x\\y", "~/x", "./m",
                                  "a/../b", "a//b", "m.gguf", "a/b/c/d", "x/", "tab\there"])
def test_request_names_that_look_like_paths_are_refused(name, store):
    with pytest.raises(BadModelName, match="model"):
        check_name(name)
    with pytest.raises(BadModelName):
        resolve_name(name)


def test_unknown_names_say_how_to_get_one(store):
    with pytest.raises(ModelNotFound, match="'nothing:here' not found"):
        resolve_name("nothing:here")
    assert check_name(" owner/repo:file.Q4_0.gguf ") == "owner/repo:file.Q4_0.gguf"  # a GGUF selector is a name


@pytest.mark.parametrize("value,seconds", [("5m", 300), ("1h30m", 5400), ("90s", 90), ("300", 300), (300, 300),
                                           (2.5, 2.5), ("0", 0), (0, 0), ("-1", None), (-1, None), ("-5m", None),
                                           ("1.5h", 5400), ("250ms", 0.25)])
def test_keep_alive_like_ollama(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "m", "", "5x", True, None, [1], float("inf")])
def test_bad_keep_alive(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_a_vision_models_projector_layer_comes_with_its_files(store):
    pdigest = "c" * 64
    (store / "blobs" / f"sha256-{pdigest}").write_bytes(b"GGUF" + b"\0" * 60)
    manifest(store, "gemma3", "4b", [model_layer(), {"mediaType": "application/vnd.ollama.image.projector",
                                                     "digest": f"sha256:{pdigest}", "size": 64}])
    files = resolve_name("gemma3:4b")
    assert files.projector == (store / "blobs" / f"sha256-{pdigest}").resolve()
    manifest(store, "text", "latest", [model_layer()])
    assert resolve_name("text").projector is None
