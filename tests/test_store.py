"""The model store on real files: local folders, .gguf files, a correctly laid-out hub cache, the bundled default."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmd.errors import LlmdError, ModelFileError, ModelNotFound
from llmd.store import (
    ALIASES,
    BUNDLED_NAME,
    DRAFT_PAIRS,
    describe,
    draft_for,
    hub_cache_dir,
    list_models,
    pull,
    remove_model,
    resolve,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty HF_HOME; nothing from the machine's cache leaks in."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def write_hf_folder(folder: Path, *, chat_template: bool = True, shards: int = 1) -> Path:
    """A small but real HF-layout model: config.json, safetensors (optionally sharded with an index), tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048,
              "hidden_size": 8, "vocab_size": 16, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": torch.zeros(16, 8), "model.norm.weight": torch.ones(8),
               "lm_head.weight": torch.zeros(16, 8, dtype=torch.bfloat16)}
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
    else:
        weight_map = {}
        for i, (name, t) in enumerate(tensors.items()):
            shard = f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors"
            weight_map[name] = shard
            existing = {}
            if (folder / shard).exists():
                from safetensors.torch import load_file

                existing = load_file(folder / shard)
            save_file({**existing, name: t}, folder / shard)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tok_config = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"} if chat_template else {}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def add_to_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay out `source`'s files as huggingface_hub does: blobs by hash, snapshot symlinks, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def write_gguf(path: Path) -> Path:
    """A valid, empty GGUF (magic, version 3, no tensors, no metadata): enough for resolution."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    return path


# --- resolution order ---


def test_no_argument_is_the_bundled_default(smollm2_gguf):
    files = resolve(None)
    assert (files.name, files.kind, files.path, files.repo_id) == (BUNDLED_NAME, "gguf", smollm2_gguf, None)
    assert resolve("") == files and resolve(BUNDLED_NAME) == files


def test_local_hf_folder(tmp_path):
    folder = write_hf_folder(tmp_path / "my-model")
    files = resolve(str(folder))
    assert (files.kind, files.path, files.name, files.repo_id) == ("hf", folder, "my-model", None)


def test_local_folder_wins_over_hub_cache(tmp_path, hf_home, monkeypatch):
    # A folder named like a repo id in the working directory is taken before the cached repo of that id.
    add_to_hub_cache(hf_home, "org/model", write_hf_folder(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)
    local = write_hf_folder(tmp_path / "org" / "model")
    assert resolve("org/model").path.resolve() == local.resolve()
    assert resolve("org/model").repo_id is None


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="config.json is missing") as err:
        resolve(str(tmp_path / "empty"))
    assert err.value.path == str(tmp_path / "empty")


def test_gguf_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    files = resolve(str(path))
    assert (files.kind, files.path, files.name) == ("gguf", path, "m")


def test_not_a_gguf_file_names_it(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file") as err:
        resolve(str(bad))
    assert str(bad) in str(err.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty file"):
        resolve(str(empty))


def test_missing_path_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve("./not/here")


def test_alias_found_in_hub_cache(tmp_path, hf_home):
    snapshot = add_to_hub_cache(hf_home, ALIASES["qwen2.5:0.5b"], write_hf_folder(tmp_path / "src"))
    files = resolve("qwen2.5:0.5b")
    assert (files.kind, files.path, files.repo_id, files.name) == ("hf", snapshot, "Qwen/Qwen2.5-0.5B-Instruct",
                                                                   "qwen2.5:0.5b")
    assert resolve("QWEN2.5:0.5B").path == snapshot  # aliases are case-insensitive
    # The snapshot holds links into blobs/: nothing was copied out of the cache.
    assert (snapshot / "model.safetensors").is_symlink()


def test_repo_id_found_in_hub_cache(tmp_path, hf_home):
    snapshot = add_to_hub_cache(hf_home, "someone/tiny-llama", write_hf_folder(tmp_path / "src"))
    files = resolve("someone/tiny-llama")
    assert (files.kind, files.path, files.repo_id) == ("hf", snapshot, "someone/tiny-llama")


def test_hf_hub_cache_overrides_hf_home(tmp_path, monkeypatch):
    other_home = tmp_path / "other"
    snapshot = add_to_hub_cache(other_home, "someone/m", write_hf_folder(tmp_path / "src"))
    monkeypatch.setenv("HF_HUB_CACHE", str(other_home / "hub"))
    assert hub_cache_dir() == other_home / "hub"
    assert resolve("someone/m").path == snapshot


def test_gguf_repo_in_hub_cache(tmp_path, hf_home):
    src = tmp_path / "gguf_src"
    write_gguf(src / "model-Q4_0.gguf")
    write_gguf(src / "model-Q8_0.gguf")
    snapshot = add_to_hub_cache(hf_home, "someone/m-GGUF", src)
    files = resolve("someone/m-GGUF:Q8_0")
    assert (files.kind, files.path, files.repo_id) == ("gguf", snapshot / "model-Q8_0.gguf", "someone/m-GGUF")
    assert resolve("someone/m-GGUF:model-Q4_0.gguf").path == snapshot / "model-Q4_0.gguf"
    with pytest.raises(ModelNotFound, match="several GGUF files"):
        resolve("someone/m-GGUF")
    with pytest.raises(ModelNotFound, match="llmd pull someone/m-GGUF:Q6_K"):
        resolve("someone/m-GGUF:Q6_K")


def test_interrupted_sharded_download_is_named(tmp_path, hf_home):
    src = write_hf_folder(tmp_path / "src", shards=2)
    snapshot = add_to_hub_cache(hf_home, "someone/sharded", src)
    assert resolve("someone/sharded").path == snapshot
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError, match="missing weight shards model-00002-of-00002.safetensors.*llmd pull"):
        resolve("someone/sharded")


def test_not_cached_says_how_to_pull():
    with pytest.raises(ModelNotFound) as err:
        resolve("llama3.2:1b")
    message = str(err.value)
    assert "llmd pull llama3.2:1b" in message and "meta-llama/Llama-3.2-1B-Instruct" in message
    assert "\n" not in message


def test_bundled_model_answers_to_its_alias_until_pulled(smollm2_gguf, hf_home, tmp_path):
    for name in ("smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        files = resolve(name)
        assert (files.kind, files.path) == ("gguf", smollm2_gguf)
    add_to_hub_cache(hf_home, ALIASES["smollm2:135m"], write_hf_folder(tmp_path / "pulled"))
    assert resolve("smollm2:135m").kind == "hf"  # a pulled copy takes precedence


def test_offline_not_found_says_offline_and_how_to_pull(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match=r"not found offline.*llmd pull qwen3:0\.6b"):
        resolve("qwen3:0.6b")


def test_unknown_names():
    with pytest.raises(ModelNotFound, match="unknown model 'gpt-17'.*llmd pull"):
        resolve("gpt-17")
    with pytest.raises(ModelNotFound, match="give a size, one of qwen2.5:0.5b"):
        resolve("qwen2.5")


def test_aliases_and_draft_pairs():
    for alias in ("smollm2:135m", "smollm2:360m", "smollm2:1.7b", "qwen2.5:0.5b", "qwen2.5:1.5b", "qwen2.5:3b",
                  "qwen2.5:7b", "qwen2.5-coder:1.5b", "qwen2.5-coder:7b", "qwen3:0.6b", "qwen3:1.7b", "qwen3:4b",
                  "qwen3:8b", "llama3.2:1b", "llama3.2:3b", "llama3.1:8b", "mistral:7b"):
        assert "/" in ALIASES[alias]
    assert ALIASES["qwen2.5:7b"] == "Qwen/Qwen2.5-7B-Instruct"
    for target, draft in DRAFT_PAIRS.items():
        assert target in ALIASES and draft in ALIASES
    assert draft_for("llama3.1:8b") == "llama3.2:1b"
    assert draft_for("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5:0.5b"
    assert draft_for("qwen3:8b") is None


# --- show / list / rm / pull ---


def test_describe_hf_folder_from_headers(tmp_path):
    info = describe(resolve(str(write_hf_folder(tmp_path / "m", shards=2))))
    assert info.architecture == "LlamaForCausalLM"
    assert info.parameters == 16 * 8 + 8 + 16 * 8
    assert info.dtype == "fp32 (+bf16)"  # by parameter count: 136 fp32, 128 bf16
    assert info.quantization is None and info.context_length == 2048 and info.chat_template is True
    names = [name for name, _ in info.file_sizes]
    assert "model.safetensors.index.json" in names and "model-00001-of-00002.safetensors" in names
    assert info.size_bytes == sum((tmp_path / "m" / n).stat().st_size for n in names)


def test_describe_without_chat_template(tmp_path):
    assert describe(resolve(str(write_hf_folder(tmp_path / "m", chat_template=False)))).chat_template is False


def test_describe_corrupt_safetensors_names_the_file(tmp_path):
    folder = write_hf_folder(tmp_path / "m")
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="model.safetensors: bad safetensors header length"):
        describe(resolve(str(folder)))


def test_describe_bundled_default():
    info = describe(resolve(None))
    assert info.architecture == "llama" and info.context_length == 8192 and info.chat_template
    assert info.quantization == "Q4_1"
    assert 130e6 < info.parameters < 140e6  # SmolLM2-135M, counted from the tensor shapes


def test_list_shows_bundled_and_cached(tmp_path, hf_home):
    add_to_hub_cache(hf_home, ALIASES["smollm2:135m"], write_hf_folder(tmp_path / "a"))
    src = tmp_path / "g"
    # A truncated GGUF: the header promises 5 tensors that the file does not hold.
    (src).mkdir()
    (src / "x-Q8_0.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") + bytes(8))
    add_to_hub_cache(hf_home, "someone/x-GGUF", src)
    listed = {m.name: m for m in list_models()}
    assert BUNDLED_NAME in listed and listed[BUNDLED_NAME].info.quantization == "Q4_1"
    hf = listed["smollm2:135m"]  # shown by its alias
    assert hf.info.architecture == "LlamaForCausalLM" and hf.size_bytes > 0
    # The corrupt file is listed with its problem instead of breaking the whole list.
    broken = listed["someone/x-GGUF:x-Q8_0.gguf"]
    assert broken.info is None and "x-Q8_0.gguf" in broken.problem


def test_rm_removes_a_pulled_repo(tmp_path, hf_home):
    add_to_hub_cache(hf_home, ALIASES["qwen3:0.6b"], write_hf_folder(tmp_path / "a"))
    repo_dir = hf_home / "hub" / "models--Qwen--Qwen3-0.6B"
    assert resolve("qwen3:0.6b").repo_id == "Qwen/Qwen3-0.6B"
    repo_id, freed = remove_model("qwen3:0.6b")
    assert repo_id == "Qwen/Qwen3-0.6B" and freed > 0
    assert not repo_dir.exists()
    with pytest.raises(ModelNotFound, match="llmd pull qwen3:0.6b"):
        resolve("qwen3:0.6b")
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        remove_model("qwen3:0.6b")


def test_rm_refuses_bundled_default_and_local_paths(tmp_path, smollm2_gguf):
    for name in (BUNDLED_NAME, ""):
        with pytest.raises(LlmdError, match="bundled default"):
            remove_model(name)
    folder = write_hf_folder(tmp_path / "mine")
    with pytest.raises(LlmdError, match="local path"):
        remove_model(str(folder))
    assert (folder / "model.safetensors").exists() and smollm2_gguf.exists()


def test_pull_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LlmdError, match="HF_HUB_OFFLINE"):
        pull("qwen2.5:0.5b")
    with pytest.raises(ModelNotFound, match="unknown model"):
        pull("not a model")


def test_pull_fetches_only_weights_and_tokenizer_files():
    from llmd.store.pull import HF_PATTERNS, IGNORE_PATTERNS, _patterns
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "pytorch_model.bin", "original/consolidated.00.pth", "README.md",
            "onnx/model.onnx", "modeling_custom.py"]
    chosen = set(filter_repo_objects(repo, allow_patterns=_patterns("x", "o/x", None, repo),
                                     ignore_patterns=IGNORE_PATTERNS))
    assert chosen == {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json"}
    assert _patterns("x", "o/x", None, repo) == HF_PATTERNS

    ggufs = ["README.md", "m-Q4_0.gguf", "m-Q8_0.gguf", "m-F16.gguf"]
    assert _patterns("o/m-GGUF:Q8_0", "o/m-GGUF", "Q8_0", ggufs) == ["m-Q8_0.gguf"]
    assert _patterns("o/m-GGUF:m-F16.gguf", "o/m-GGUF", "m-F16.gguf", ggufs) == ["m-F16.gguf"]
    with pytest.raises(LlmdError, match="several GGUF files; name one, e.g. llmd pull o/m-GGUF:m-Q4_0.gguf"):
        _patterns("o/m-GGUF", "o/m-GGUF", None, ggufs)
    with pytest.raises(LlmdError, match="no single GGUF file matching 'Q6_K'"):
        _patterns("o/m-GGUF:Q6_K", "o/m-GGUF", "Q6_K", ggufs)
    with pytest.raises(LlmdError, match="no safetensors or GGUF weights"):
        _patterns("o/old", "o/old", None, ["pytorch_model.bin", "config.json"])


def test_describe_tiny_qwen3_matches_its_tensors(tiny_qwen3):
    from safetensors import safe_open

    total = 0
    for shard in tiny_qwen3.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    info = describe(resolve(str(tiny_qwen3)))
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.parameters == total
    assert info.context_length == config["max_position_embeddings"]
