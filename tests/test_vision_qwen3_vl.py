"""Qwen3-VL images against transformers on a tiny random Qwen3VLForConditionalGeneration (tests/tiny_qwen3_5_vl.py),
CPU fp32. The tower (llmd.model.vision.qwen3_5, Qwen3.5's with DeepStack): an image's embeddings and its DeepStack
features equal get_image_features' (1e-4). The text model (llmd.model.qwen3_vl: Qwen3's layers, interleaved
multimodal RoPE, the DeepStack features added after its first layers): the engine's greedy answer about an image
and its log-probabilities equal transformers' generate (1e-4), and differ without the DeepStack features (text
alone too, and Qwen3VLMoeForConditionalGeneration's, its experts in either layout); prefill chunks that cut the
images, a prefix hit over them, a batch and preemption answer as alone. Bad files are refused by name. Served: a daemon answers a question about an image through the openai client as generate does and shows the
vision capability.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams
from llmd.engine.types import ImageSpan
from llmd.errors import ModelFileError
from llmd.model.loader import load_model
from llmd.model.vision.qwen3_5 import load_qwen3_5_vision
from llmd_daemon_proc import start_daemon
from PIL import Image
from test_engine import GREEDY
from test_vision_gemma3 import _image_bytes, _relabelled
from test_vision_qwen3_5 import NO_THINKING, TOKENS, expected_answer, reference_processor
from test_vision_served import picture
from tiny_qwen3_5_vl import write_mmproj, write_text_gguf, write_tiny_qwen3_5_vl, write_tiny_qwen3_vl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_PAD, VISION_START, VISION_END = 5, 3, 4  # in the tiny vocabulary
IMAGES = [Image.open(io.BytesIO(_image_bytes(fmt, size, seed=seed)))
          for fmt, size, seed in (("PNG", (100, 60), 0), ("JPEG", (37, 250), 1), ("PNG", (70, 70), 4))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "vl")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(folder):
    return reference_processor(folder)


@pytest.fixture(scope="module")
def lm(folder):
    return load_model(folder, dtype=torch.float32, device="cpu")


def test_embeddings_and_deepstack_equal_transformers(lm, processor, reference):
    assert lm.config.deepstack_layers == 2 and lm.config.mrope_section == [3, 3, 2]
    for image in IMAGES:
        pixels = lm.vision.preprocess(image)
        expected = processor.image_processor(image, return_tensors="pt")
        _, rows, cols = expected["image_grid_thw"][0].tolist()
        assert lm.vision.token_grid(pixels) == (rows // 2, cols // 2)
        with torch.no_grad():
            want = reference.model.get_image_features(expected["pixel_values"], expected["image_grid_thw"])
        got = lm.vision.encode(pixels)
        assert got.shape == (rows * cols // 4, 3 * 64)
        for k, part in enumerate([want.pooler_output[0]] + [f[0] for f in want.deepstack_features]):
            assert (got[:, 64 * k : 64 * (k + 1)] - part).abs().max().item() < 1e-4, k


def encoded_prompt(lm, pieces: list) -> tuple[list[int], list[ImageSpan]]:
    """Token lists and images in order -> the prompt's ids (each image between its start and end) and its spans."""
    ids: list[int] = []
    spans = []
    for piece in pieces:
        if isinstance(piece, Image.Image):
            pixels = lm.vision.preprocess(piece)
            embeds = lm.vision.encode(pixels)
            ids.append(VISION_START)
            spans.append(ImageSpan(len(ids), embeds.shape[0], hashlib.sha256(piece.tobytes()).digest(), embeds,
                                   grid=lm.vision.token_grid(pixels)))
            ids += [IMAGE_PAD] * embeds.shape[0] + [VISION_END]
        else:
            ids += piece
    return ids, spans


def engine_answer(lm, ids: list[int], spans: list[ImageSpan], steps: int) -> tuple[list[int], list[float]]:
    engine = make_engine(lm, kv_cache_dtype="fp32")  # log-probs as transformers' to 1e-4
    engine.add_request("a", ids, SamplingParams(max_tokens=steps, logprobs=0, **GREEDY), images=spans)
    outs = []
    while engine.has_work():
        outs += engine.step()
    return [t for o in outs for t in o.new_token_ids], [lp.logprob for o in outs for lp in o.logprobs]


def generated(reference, ids: list[int], image: Image.Image | None, steps: int) -> tuple[list[int], list[float]]:
    """transformers' generate (3-D positions from get_rope_index, then the rope delta): its greedy tokens after `ids`
    (holding this one image's placeholders, if any) and their log-probabilities."""
    with torch.no_grad():
        out = reference.generate(**reference_inputs(reference, image, ids), max_new_tokens=steps, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [float(torch.log_softmax(s[0].float(), -1).max()) for s in out.scores]


def reference_inputs(reference, image: Image.Image | None, ids: list[int]) -> dict:
    """generate's inputs for these ids: the image's patches and grid from the image processor."""
    import transformers as tf

    t = torch.tensor([ids])
    inputs = {"input_ids": t, "attention_mask": torch.ones_like(t)}
    if image is not None:
        processor = tf.Qwen2VLImageProcessorPil.from_pretrained(reference.name_or_path)
        inputs.update(mm_token_type_ids=(t == IMAGE_PAD).int(), **processor(image.convert("RGB"), return_tensors="pt"))
    return inputs


def test_engine_answer_with_an_image_equals_transformers_generate(lm, reference):
    ids, spans = encoded_prompt(lm, [[9, 30, 31], IMAGES[0], [40, 41, 42, 43]])
    want_tokens, want_logprobs = generated(reference, ids, IMAGES[0], 8)
    tokens, logprobs = engine_answer(lm, ids, spans, 8)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
    # without its DeepStack features the answer is another: they are what matched
    flat = [ImageSpan(s.start, s.length, s.digest, torch.cat([s.embeds[:, :64], torch.zeros_like(s.embeds[:, 64:])],
                                                              -1), grid=s.grid) for s in spans]
    _, plain = engine_answer(lm, ids, flat, 8)
    assert max(abs(a - b) for a, b in zip(plain, want_logprobs, strict=True)) > 1e-3


def test_text_only_answer_equals_transformers_generate(lm, reference):
    ids = [9, 30, 31, 32, 40, 41, 42, 50, 51, 52, 53]
    tokens, logprobs = engine_answer(lm, ids, [], 6)
    want_tokens, want_logprobs = generated(reference, ids, None, 6)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_moe_checkpoint_answers_an_image_as_transformers(tmp_path):
    """Qwen3VLMoeForConditionalGeneration: the same tower and RoPE over Qwen3-MoE's layers; its experts as transformers
    5 writes them and as the hub stores them ([experts, in, out]) load alike."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    folder = write_tiny_qwen3_vl(tmp_path / "moe", seed=1, moe=True)
    reference = Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    assert lm.config.moe is not None and lm.config.moe.num_experts == 8 and lm.vision is not None
    ids, spans = encoded_prompt(lm, [[9, 30, 31], IMAGES[1], [40, 41, 42, 43]])
    want_tokens, want_logprobs = generated(reference, ids, IMAGES[1], 6)
    tokens, logprobs = engine_answer(lm, ids, spans, 6)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
    tensors = load_file(folder / "model.safetensors")
    hub = {n: t.transpose(1, 2).contiguous() if ".experts." in n else t for n, t in tensors.items()}
    assert any(t.shape != tensors[n].shape for n, t in hub.items())
    save_file(hub, folder / "model.safetensors")
    assert engine_answer(load_model(folder, dtype=torch.float32, device="cpu"), ids, spans, 6) == (tokens, logprobs)


def answers(engine, prompts: list[tuple[list[int], list[ImageSpan]]]) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy (token, log-probability) pairs, the prompts submitted together."""
    params = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    for i, (ids, spans) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params, images=spans)
    out: dict[str, list[tuple[int, float]]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, o.logprobs, strict=True)]
    return [out[f"r{i}"] for i in range(len(prompts))]


def same(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]) -> bool:
    return all([t for t, _ in g] == [t for t, _ in w] and max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-5
               for g, w in zip(got, want, strict=True))


def test_chunked_prefix_hit_batched_and_preempted_equal_alone(lm):
    """Chunks of 5 cut both images (and their DeepStack rows); the other prompts, sharing the first 41 tokens (both
    images in the first 32), hit the prefix cache; a batch of three and preemption answer as each alone (tokens, and
    log-probabilities to 1e-5)."""
    shared = [[9, 30, 31, 32], IMAGES[0], [40, 41, 42], IMAGES[1], [50 + i for i in range(16)]]
    prompts = [encoded_prompt(lm, shared + [tail]) for tail in ([80, 81, 82], [90, 91], [100, 101, 102, 103])]
    assert len(prompts[0][0]) == 44 and prompts[0][1][1].end < 32
    alone = [answers(make_engine(lm, kv_cache_dtype="fp32"), [p])[0] for p in prompts]
    assert len({a[0][1] for a in alone}) == 3  # the prompts' answers differ
    assert same(answers(make_engine(lm, kv_cache_dtype="fp32", max_num_batched_tokens=5), prompts), alone)
    engine = make_engine(lm, kv_cache_dtype="fp32")
    first = answers(engine, prompts[:1])
    assert same(first + answers(engine, prompts[1:]), alone)
    assert engine.stats().kv.prefix_hits_tokens >= 2 * 32
    engine = make_engine(lm, kv_cache_dtype="fp32", num_kv_blocks=6)
    assert same(answers(engine, prompts), alone)
    assert engine.stats().num_preemptions > 0


def test_bad_files_are_refused_by_name(folder, tmp_path):
    drop = _relabelled(folder, tmp_path / "drop",
                       lambda n: None if n.endswith("deepstack_merger_list.1.linear_fc2.weight") else n)
    with pytest.raises(ModelFileError, match=r"'model\.visual\.deepstack_merger_list\.1\.linear_fc2\.weight'.*missing"):
        load_qwen3_5_vision(drop, torch.float32, "cpu")
    cfg = json.loads((folder / "config.json").read_text())
    for n, indexes, match in ((1, [0, 3], r"deepstack_visual_indexes \[0, 3\] are not distinct blocks of the 3-block"),
                              (2, [1, 1], r"deepstack_visual_indexes \[1, 1\] are not distinct"),
                              (3, [0, 1, 2, 2, 2], "5 DeepStack layers")):
        bad = _relabelled(folder, tmp_path / f"bad{n}", lambda name: name)
        (bad / "config.json").write_text(json.dumps(
            {**cfg, "vision_config": {**cfg["vision_config"], "deepstack_visual_indexes": indexes}}))
        with pytest.raises(ModelFileError, match=match) as err:
            load_model(bad, dtype=torch.float32, device="cpu")
        assert err.value.path == str(bad / "config.json")


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's files: the text model's GGUF with the tower's mmproj GGUF beside it


def gguf_pair(folder: Path, root: Path, **mmproj) -> Path:
    """The folder as llama.cpp's converter writes it: the text GGUF and its mmproj beside it; the text file's path."""
    root.mkdir()
    write_mmproj(folder, root / "mmproj-tiny.gguf", **mmproj)
    return write_text_gguf(folder, root / "tiny.gguf")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_gguf_and_mmproj_answer_an_image_as_transformers(family, folder, reference, processor, tmp_path):
    """Qwen3-VL's (qwen3vl text, DeepStack mergers in the mmproj), Qwen3-VL-MoE's (qwen3vlmoe: stacked experts) and
    Qwen3.5's (qwen35 text, no DeepStack): the mmproj's embeddings are get_image_features' (1e-4), and the pair
    answers as transformers' generate."""
    import transformers as tf

    if family != "qwen3_vl":
        folder = (write_tiny_qwen3_5_vl if family == "qwen3_5" else write_tiny_qwen3_vl)(
            tmp_path / family, **({"moe": True, "seed": 1} if family == "qwen3_vl_moe" else {}))
        model_class = tf.Qwen3_5ForConditionalGeneration if family == "qwen3_5" else \
            tf.Qwen3VLMoeForConditionalGeneration
        reference = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    lm = load_model(gguf_pair(folder, tmp_path / "gguf"), dtype=torch.float32, device="cpu")
    assert lm.vision is not None and lm.config.deepstack_layers == (0 if family == "qwen3_5" else 2)
    assert (lm.config.moe is not None) == (family == "qwen3_vl_moe")
    image = IMAGES[0]
    expected = processor.image_processor(image, return_tensors="pt")
    with torch.no_grad():
        want = reference.model.get_image_features(expected["pixel_values"], expected["image_grid_thw"])
    want = torch.cat([want.pooler_output[0]] + [f[0] for f in getattr(want, "deepstack_features", None) or []], -1)
    got = lm.vision.encode(lm.vision.preprocess(image))
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4
    ids, spans = encoded_prompt(lm, [[9, 30, 31], image, [40, 41, 42, 43]])
    want_tokens, want_logprobs = generated(reference, ids, image, 6)
    tokens, logprobs = engine_answer(lm, ids, spans, 6)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_bad_mmproj_files_are_refused_by_name(folder, tmp_path):
    missing = gguf_pair(folder, tmp_path / "missing", drop=("v.deepstack.1.fc2.weight",))
    with pytest.raises(ModelFileError, match=r"'v\.deepstack\.1\.fc2\.weight' of the vision encoder is missing") as err:
        load_model(missing, dtype=torch.float32, device="cpu")
    assert err.value.path == str(missing.parent / "mmproj-tiny.gguf")
    # a Qwen3.5 text model (no DeepStack) beside Qwen3-VL's projector
    qwen3_5 = write_tiny_qwen3_5_vl(tmp_path / "qwen3_5")
    (tmp_path / "mixed").mkdir()
    write_mmproj(folder, tmp_path / "mixed" / "mmproj-tiny.gguf")
    text = write_text_gguf(qwen3_5, tmp_path / "mixed" / "tiny.gguf")
    with pytest.raises(ModelFileError, match="2 DeepStack features per image token; the text model takes 0"):
        load_model(text, dtype=torch.float32, device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# Served


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("vision-qwen3_vl-daemon") / "llmd", "--model", str(folder),
                     "--kv-cache-dtype", "fp32")  # log-probs as transformers' to 1e-4
    yield d
    assert d.stop() == 0, d.log()


def test_served_answers_equal_transformers_generate(daemon, folder, reference, processor):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    answers = {}
    for fmt, color, size in (("png", (220, 40, 40), (120, 70)), ("jpeg", (40, 60, 230), (64, 150))):
        data = picture(fmt.upper(), color, size)
        url = f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"
        reply = client.chat.completions.create(
            model=folder.name, max_tokens=TOKENS, temperature=0, logprobs=True,
            extra_body={"chat_template_kwargs": NO_THINKING},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is this?"}]}])
        answers[fmt] = reply.choices[0].message.content
        text, logprobs = expected_answer(reference, processor, data, "What is this?")
        assert answers[fmt] == text, fmt
        got = [t.logprob for t in reply.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4, fmt
    assert len(set(answers.values())) > 1 and all(answers.values())  # the answer depends on the image
    with urllib.request.urlopen(urllib.request.Request(
            daemon.url + "/api/show", json.dumps({"model": folder.name}).encode(),
            {"Content-Type": "application/json"}), timeout=30) as resp:
        assert "vision" in json.loads(resp.read())["capabilities"]
