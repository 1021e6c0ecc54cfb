"""Embeddings in the engine: prefill-only sequences in the ordinary schedule, pooled as the model's files say.

Equal to transformers' pooled hidden states (SmolLM2, fp32 CPU), bit-identical alone or in a batch of 32 (chunked
prefill included), sharing steps with generation without changing its tokens, and leaving no KV behind."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
import torch.nn.functional as F

from llmd.engine import AsyncEngine, SamplingParams, generate
from llmd.engine.types import EmbedParams
from llmd.errors import InvalidRequest
from llmd.model.config import ModelConfig
from llmd.model.loader import load_model
from llmd.model.pooling import gguf_pooling, hf_folder_pooling, matryoshka_dimensions

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.float32, device="cpu", quant="none")  # fp32, as transformers


def embed_sync(engine, prompts: list[list[int]], params: EmbedParams = EmbedParams()) -> list[list[float]]:
    """Embed prompts together on a synchronous engine; vectors in prompt order."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"e{i}", ids, SamplingParams(), embed=params)
    vectors: dict[str, list[float]] = {}
    while len(vectors) < len(prompts):
        for out in engine.step():
            assert out.error is None
            if out.finished:
                vectors[out.request_id] = out.embedding
    return [vectors[f"e{i}"] for i in range(len(prompts))]


def test_equal_to_transformers_mean_and_last_token_pooling(smol, smollm2_gguf):
    from transformers import AutoModel

    ref = AutoModel.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n", "Hello"]
    prompts = [smol.tokenizer.encode(t) for t in texts]
    engine = make_engine(smol, max_num_batched_tokens=8)  # every input but the last is chunked
    assert smol.config.pooling == "mean"  # a chat model's files declare no pooling
    means = embed_sync(engine, prompts)
    lasts = embed_sync(engine, prompts, EmbedParams(pooling="last"))
    with torch.inference_mode():
        for ids, mean, last in zip(prompts, means, lasts):
            hidden = ref(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
            for ours, want in ((mean, hidden.mean(0)), (last, hidden[-1])):
                cos = F.cosine_similarity(torch.tensor(ours), want, dim=0).item()
                assert cos > 0.9999, f"cosine {cos}"
                assert abs(torch.tensor(ours).norm().item() - 1.0) < 1e-5


def test_an_input_alone_equals_it_inside_a_batch_of_32_bit_for_bit(smol):
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 49152) for _ in range(rng.randrange(1, 40))] for _ in range(32)]
    engine = make_engine(smol, max_num_batched_tokens=96)  # the batch is cut into chunks across steps
    batched = embed_sync(engine, prompts)
    alone = [embed_sync(engine, [p])[0] for p in prompts[:8]] + [embed_sync(engine, [prompts[-1]])[0]]
    assert alone == batched[:8] + [batched[-1]]


def test_unnormalized_and_cut_to_dimensions(tiny_llama_loaded):
    engine = make_engine(tiny_llama_loaded)
    ids = [5, 6, 7, 8, 9]
    raw = torch.tensor(embed_sync(engine, [ids], EmbedParams(normalize=False))[0])
    unit = torch.tensor(embed_sync(engine, [ids])[0])
    cut = torch.tensor(embed_sync(engine, [ids], EmbedParams(dimensions=8))[0])
    assert abs(raw.norm().item() - 1.0) > 1e-3
    assert torch.allclose(unit, F.normalize(raw, dim=0), atol=1e-6)
    assert cut.shape == (8,) and torch.allclose(cut, F.normalize(raw[:8], dim=0), atol=1e-6)


def test_embeddings_share_steps_with_generation_and_keep_no_kv(tiny_llama_loaded):
    engine = make_engine(tiny_llama_loaded, max_num_batched_tokens=32)
    prompt = [5, 6, 7, 8]
    want = generate(engine, [prompt], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    hits, cached = engine.block_manager.hits_tokens, engine.block_manager.num_cached_blocks
    engine.add_request("gen", prompt, SamplingParams(max_tokens=12, **GREEDY))
    engine.add_request("emb", list(range(5, 205)), SamplingParams(), embed=EmbedParams())  # 200 tokens: 7 chunks
    tokens, shared, vector = [], 0, None
    while vector is None or len(tokens) < 12:
        outs = engine.step()
        shared += engine.last_batch_size == 2
        for out in outs:
            if out.request_id == "gen":
                tokens += out.new_token_ids
            elif out.finished:
                vector = out.embedding
    assert shared >= 6  # the long input never held the decode back: both ran in the same steps
    assert tokens == want and len(vector) == tiny_llama_loaded.config.hidden_size
    # the embedding neither read nor filled the prefix cache (its blocks went straight back)
    assert engine.block_manager.hits_tokens == hits + len(prompt) // 16 * 16
    assert engine.block_manager.num_cached_blocks == cached


def test_a_repeated_input_is_computed_again_not_served_from_the_prefix_cache(tiny_llama_loaded):
    engine = make_engine(tiny_llama_loaded)
    ids = list(range(5, 70))
    first = embed_sync(engine, [ids])[0]
    assert embed_sync(engine, [ids])[0] == first
    assert engine.block_manager.hits_tokens == 0 and engine.block_manager.num_cached_blocks == 0


def test_bad_embedding_requests_name_the_field(tiny_llama_loaded):
    engine = make_engine(tiny_llama_loaded, max_model_len=64)
    hidden = tiny_llama_loaded.config.hidden_size
    cases = [([], EmbedParams(), "prompt"), ([10**9], EmbedParams(), "prompt"), (list(range(5, 70)), EmbedParams(),
             "input"), ([5], EmbedParams(pooling="max"), "pooling"), ([5], EmbedParams(dimensions=hidden + 1),
             "dimensions"), ([5], EmbedParams(dimensions=0), "dimensions")]
    for ids, params, field in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.add_request("bad", ids, SamplingParams(), embed=params)
        assert err.value.field == field
    assert embed_sync(engine, [list(range(5, 69))])  # exactly max_model_len tokens: no room for output is needed


async def test_async_embed_and_cancel_leave_nothing_behind(tiny_llama_loaded):
    engine = make_engine(tiny_llama_loaded)
    front = AsyncEngine(engine)
    front.start()
    try:
        vectors = await asyncio.gather(*(front.embed([5 + i, 6, 7]) for i in range(4)))
        assert all(len(v) == tiny_llama_loaded.config.hidden_size for v in vectors)
        task = asyncio.ensure_future(front.embed(list(range(5, 200))))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not engine.requests:
                break
            await asyncio.sleep(0.05)
    finally:
        await front.shutdown()


def test_pooling_is_read_from_the_model_files(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_lasttoken": True}))
    assert hf_folder_pooling(tmp_path) == "last"  # Qwen3-Embedding's layout
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "../../etc", "type": "x.Pooling"}]))
    assert hf_folder_pooling(tmp_path) == "mean"  # a module path never leaves the folder
    assert hf_folder_pooling(tmp_path / "missing") == "mean"
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 3}) == "last"
    assert gguf_pooling({"general.architecture": "llama"}) == "mean"
    assert matryoshka_dimensions({"is_matryoshka": True, "matryoshka_dimensions": [64, 32]}, 128) == [32, 64]
    assert matryoshka_dimensions({}, 128) is None


def test_hf_folder_with_last_token_pooling_loads_it(tiny_llama, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    (folder / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert ModelConfig.from_hf_folder(folder).pooling == "last"
    assert ModelConfig.from_hf_folder(tiny_llama).pooling == "mean"
