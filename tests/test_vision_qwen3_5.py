"""Qwen3.5 images against transformers on a tiny random Qwen3_5ForConditionalGeneration (tests/tiny_qwen3_5_vl.py),
CPU fp32: the multimodal RoPE positions (llmd.engine.sequence.rope_positions) equal get_rope_index's; the engine's
greedy answer with an image's embeddings on its grid equals transformers' text model fed the same embeddings at its
3-D positions, whole or in prefill chunks that cut the image, after a prefix hit and after preemption, and without
an image the text model's answer is transformers' (Qwen3_5MoeForConditionalGeneration's too, image and all). The tower
(llmd.model.vision.qwen3_5): preprocessing equals Qwen2VLImageProcessorPil's patches and grid (non-square images,
upscaled, downscaled, RGBA), the embeddings get_image_features' (1e-4), the expanded prompt Qwen3VLProcessor's
tokens; bad files and images are refused by name. Served: a daemon answers a question about an image as
transformers' generate does (its multimodal RoPE included) and shows the vision capability.
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
from llmd.engine.sequence import rope_positions
from llmd.engine.types import ImageSpan
from llmd.errors import InvalidRequest, ModelFileError
from llmd.model.loader import load_model
from llmd.model.tokenizer import Tokenizer
from llmd.model.vision.images import InvalidImage
from llmd.model.vision.qwen3_5 import MAX_IMAGE_TOKENS, Qwen35Vision, load_qwen3_5_vision
from llmd_daemon_proc import start_daemon
from PIL import Image
from test_engine import GREEDY
from test_vision_gemma3 import _image_bytes, _relabelled
from test_vision_served import picture
from tiny_qwen3_5_vl import write_tiny_qwen3_5_vl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_PAD = 5  # <|image_pad|> in the tiny vocabulary


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl") / "vl")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm(folder):
    return load_model(folder, dtype=torch.float32, device="cpu")


def image_span(seed: int, start: int, grid: tuple[int, int], hidden: int = 64) -> ImageSpan:
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    return ImageSpan(start, n, hashlib.sha256(str(seed).encode()).digest(), torch.randn(n, hidden, generator=g),
                     grid=grid)


def with_images(pieces: list) -> tuple[list[int], list[ImageSpan]]:
    """Token lists and (seed, grid) images in order -> the prompt's ids and its spans."""
    ids: list[int] = []
    spans = []
    for piece in pieces:
        if isinstance(piece, tuple):
            spans.append(image_span(piece[0], len(ids), piece[1]))
            ids += [IMAGE_PAD] * spans[-1].length
        else:
            ids += piece
    return ids, spans


def hf_rope_index(reference, ids: list[int], spans: list[ImageSpan]) -> torch.Tensor:
    """transformers' 3-D positions [3, len(ids)] for these ids (each span's grid in patches: merged rows x 2)."""
    t = torch.tensor([ids])
    grids = torch.tensor([[1, 2 * s.grid[0], 2 * s.grid[1]] for s in spans]) if spans else None
    types = torch.zeros_like(t, dtype=torch.int)
    for s in spans:
        types[0, s.start : s.end] = 1
    positions, _ = reference.model.get_rope_index(t, mm_token_type_ids=types, image_grid_thw=grids)
    return positions[:, 0]


PROMPT = [[9, 30, 31, 32], (1, (2, 3)), [40, 41, 42], (2, (4, 2)), [50, 51, 52, 53, 54, 55]]


def test_rope_positions_equal_get_rope_index(reference):
    ids, spans = with_images(PROMPT + [[60, 61, 62]])  # the tail stands in for decoded tokens
    expected = hf_rope_index(reference, ids, spans)
    assert torch.equal(torch.tensor(rope_positions(spans, 0, len(ids))), expected)
    for start, n in [(5, 9), (13, 1), (len(ids) - 1, 1), (0, 3)]:  # any chunk: its slice of the whole
        assert torch.equal(torch.tensor(rope_positions(spans, start, n)), expected[:, start : start + n])
    assert rope_positions([], 7, 3) == ([7, 8, 9],) * 3


def reference_greedy(reference, ids: list[int], spans: list[ImageSpan], steps: int,
                     mrope: bool = True) -> tuple[list[int], list[float]]:
    """transformers' text model fed the images' embeddings at their positions, re-run whole for each new token at
    get_rope_index's positions (which continue past the prompt by the rope delta, as generate's do; mrope False:
    consecutive positions): the greedy tokens and their log-probabilities."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(steps):
            full = ids + tokens
            x = reference.model.language_model.embed_tokens(torch.tensor([full]))
            for s in spans:
                x[0, s.start : s.end] = s.embeds
            positions = hf_rope_index(reference, full, spans) if mrope else torch.arange(len(full)).expand(3, -1)
            hidden = reference.model.language_model(inputs_embeds=x, position_ids=positions[:, None])
            logits = torch.log_softmax(reference.lm_head(hidden.last_hidden_state[0, -1]), -1)
            tokens.append(int(logits.argmax()))
            logprobs.append(float(logits.max()))
    return tokens, logprobs


def test_engine_answer_with_images_on_a_grid_equals_transformers(reference, lm):
    ids, spans = with_images(PROMPT)
    tokens, logprobs = reference_greedy(reference, ids, spans, 8)
    engine = make_engine(lm, kv_cache_dtype="fp32")  # log-probs as transformers' to 1e-4
    engine.add_request("a", ids, SamplingParams(max_tokens=8, logprobs=0, **GREEDY), images=spans)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == tokens
    got = [lp.logprob for o in outs for lp in o.logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
    # consecutive positions (as for Gemma's images) give other log-probabilities: the grid positions are what matched
    _, plain = reference_greedy(reference, ids, spans, 8, mrope=False)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-3


def test_text_only_answer_equals_transformers(reference, lm):
    """The image-text folder's text model with no image: plain positions, transformers' tokens and log-probs."""
    assert lm.vision is not None and lm.config.mrope_section == [3, 3, 2]
    ids = [9, 30, 31, 32, 40, 41, 42, 50, 51, 52, 53]
    tokens, logprobs = reference_greedy(reference, ids, [], 6)
    engine = make_engine(lm, kv_cache_dtype="fp32")  # log-probs as transformers' to 1e-4
    engine.add_request("a", ids, SamplingParams(max_tokens=6, logprobs=0, **GREEDY))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == tokens
    got = [lp.logprob for o in outs for lp in o.logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4


def test_moe_checkpoint_answers_an_image_as_transformers(tmp_path, processor):
    """Qwen3_5MoeForConditionalGeneration: the same tower and multimodal RoPE over the MoE text model."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    folder = write_tiny_qwen3_5_vl(tmp_path / "moe", seed=1, moe=True)
    reference = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    assert lm.config.moe is not None and lm.vision is not None
    image = _decode("png_100x60")
    pixels = lm.vision.preprocess(image)
    inputs = processor.image_processor(image, return_tensors="pt")
    with torch.no_grad():
        want = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    embeds = lm.vision.encode(pixels)
    assert (embeds - want).abs().max().item() < 1e-4
    grid = lm.vision.token_grid(pixels)
    ids = [9, 30, 3] + [IMAGE_PAD] * embeds.shape[0] + [4, 40, 41, 42]
    span = ImageSpan(3, embeds.shape[0], b"moe", embeds, grid=grid)
    tokens, logprobs = reference_greedy(reference, ids, [span], 6)
    engine = make_engine(lm, kv_cache_dtype="fp32")  # log-probs as transformers' to 1e-4
    engine.add_request("a", ids, SamplingParams(max_tokens=6, logprobs=0, **GREEDY), images=[span])
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == tokens
    got = [lp.logprob for o in outs for lp in o.logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4


def run(engine, prompts: list[tuple[list[int], list[ImageSpan]]], params) -> list[list[int]]:
    for i, (ids, spans) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params, images=spans)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_chunked_prefix_hit_and_preempted_equal_alone(lm):
    """Chunks of 5 cut both images; a second prompt sharing the first 32 tokens (both images) hits the prefix cache
    (a state checkpoint at 32); preemption recomputes with the same positions."""
    shared = PROMPT + [[70 + i for i in range(16)]]
    prompts = [with_images(shared + [tail]) for tail in ([80, 81, 82], [90, 91], [100, 101, 102, 103])]
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = [run(make_engine(lm), [p], params)[0] for p in prompts]
    assert run(make_engine(lm, max_num_batched_tokens=5), prompts, params) == alone
    engine = make_engine(lm)
    first = run(engine, prompts[:1], params)
    assert first + run(engine, prompts[1:], params) == alone
    assert engine.stats().kv.prefix_hits_tokens >= 2 * 32
    engine = make_engine(lm, num_kv_blocks=6)
    assert run(engine, prompts, params) == alone
    assert engine.stats().num_preemptions > 0


def test_a_grid_that_does_not_hold_the_image_is_refused(lm):
    ids, (span,) = with_images([[9, 30], (1, (2, 3)), [40]])
    bad = ImageSpan(span.start, span.length, span.digest, span.embeds, grid=(2, 2))
    with pytest.raises(InvalidRequest, match="grid"):
        make_engine(lm).add_request("a", ids, SamplingParams(max_tokens=1), images=[bad])


# ---------------------------------------------------------------------------------------------------------------
# The tower

IMAGES = {  # name -> encoded bytes: landscape, portrait strip, tiny (scaled up), large (scaled down), RGBA, grey
    "png_100x60": _image_bytes("PNG", (100, 60)),
    "jpeg_37x250": _image_bytes("JPEG", (37, 250), seed=1),
    "png_9x7": _image_bytes("PNG", (9, 7), seed=2),
    "jpeg_300x200": _image_bytes("JPEG", (300, 200), seed=3),
    "png_rgba_70x70": _image_bytes("PNG", (70, 70), "RGBA", seed=4),
    "png_gray_40x64": _image_bytes("PNG", (40, 64), "L", seed=5),
}


def _decode(name: str) -> Image.Image:
    return Image.open(io.BytesIO(IMAGES[name]))


def reference_processor(folder: Path):
    """Qwen3VLProcessor over the folder's files. It wants a video processor, which needs torchvision (not installed
    here); images need none, so that one is left out of its class check."""
    import transformers as tf
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class",
                   lambda self, name, arg: None if arg is None else check(self, name, arg))
        return tf.Qwen3VLProcessor(image_processor=tf.Qwen2VLImageProcessorPil.from_pretrained(folder),
                                   tokenizer=tf.AutoTokenizer.from_pretrained(folder), video_processor=None)


@pytest.fixture(scope="module")
def processor(folder):
    return reference_processor(folder)


@pytest.fixture(scope="module")
def encoder(folder) -> Qwen35Vision:
    return load_qwen3_5_vision(folder, torch.float32, "cpu")


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_preprocess_and_embeddings_equal_transformers(name, encoder, processor, reference):
    pixels = encoder.preprocess(_decode(name))
    expected = processor.image_processor(_decode(name), return_tensors="pt")
    _, rows, cols = expected["image_grid_thw"][0].tolist()
    assert encoder.token_grid(pixels) == (rows // 2, cols // 2)
    assert encoder.tokens_for(pixels) == rows * cols // 4
    assert (encoder.patches(pixels) - expected["pixel_values"]).abs().max().item() < 1e-6
    with torch.no_grad():
        want = reference.model.get_image_features(expected["pixel_values"], expected["image_grid_thw"])
    got = encoder.encode(pixels)
    assert got.dtype == torch.float32 and got.shape == want.pooler_output[0].shape
    assert (got - want.pooler_output[0]).abs().max().item() < 1e-4


def test_bfloat16_encoder_is_close_and_in_the_language_models_dtype(folder, encoder):
    bf16 = load_qwen3_5_vision(folder, torch.bfloat16, "cpu")
    pixels = encoder.preprocess(_decode("png_100x60"))
    got, expected = bf16.encode(pixels), encoder.encode(pixels)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_sizes_follow_smart_resize(encoder):
    grids = {name: encoder.token_grid(encoder.preprocess(_decode(name))) for name in IMAGES}
    assert grids["png_100x60"] == (2, 3) and grids["jpeg_37x250"] == (8, 1)
    assert grids["png_9x7"] == (2, 3)  # scaled up to min_pixels
    assert grids["jpeg_300x200"][0] * grids["jpeg_300x200"][1] * 32 ** 2 <= 128 * 128  # scaled down to max_pixels
    with pytest.raises(InvalidImage, match="200 times"):
        encoder.preprocess(Image.new("RGB", (4020, 20)))
    with pytest.raises(ValueError, match="multiples of 32"):
        encoder.encode(torch.zeros(3, 48, 64))
    with pytest.raises(ValueError, match=f"at most {MAX_IMAGE_TOKENS} tokens"):
        encoder.token_grid(torch.zeros(3, 32, 32 * (MAX_IMAGE_TOKENS + 1)))


def test_expand_matches_the_processor(folder, encoder, processor):
    """Qwen3.5's chat template writes <|vision_start|><|image_pad|><|vision_end|> for an image part; expanded, the
    prompt tokenizes as Qwen3VLProcessor's (two images in one message, one in a later turn)."""
    tok = Tokenizer.from_hf_folder(folder)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "these two."}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.count(encoder.placeholder_text()) == 3
    images = [_decode(n) for n in ("png_100x60", "jpeg_37x250", "png_9x7")]
    counts = [encoder.tokens_for(encoder.preprocess(i)) for i in images]
    ids = tok.encode(encoder.expand(rendered, counts))
    processed = processor(text=[rendered], images=images, add_special_tokens=False, return_tensors="pt")
    assert ids == processed["input_ids"][0].tolist()
    assert ids.count(encoder.image_token_id) == sum(counts) and len(set(counts)) > 1
    with pytest.raises(ValueError, match="2 images"):
        encoder.expand(rendered, counts[:2])


def test_bad_files_are_refused_by_name(folder, tmp_path):
    drop = _relabelled(folder, tmp_path / "drop", lambda n: None if n.endswith("blocks.1.mlp.linear_fc2.bias") else n)
    with pytest.raises(ModelFileError, match=r"'model\.visual\.blocks\.1\.mlp\.linear_fc2\.bias'.*missing"):
        load_qwen3_5_vision(drop, torch.float32, "cpu")
    from safetensors.torch import load_file, save_file

    bent = _relabelled(folder, tmp_path / "bent", lambda n: n.removeprefix("model."))  # transformers 4's names
    tensors = load_file(bent / "model.safetensors")
    tensors["visual.merger.linear_fc2.weight"] = torch.zeros(64, 127)
    save_file(tensors, bent / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"'visual\.merger\.linear_fc2\.weight' has shape \(64, 127\), "
                                             r"expected \(64, 128\)") as err:
        load_qwen3_5_vision(bent, torch.float32, "cpu")
    assert err.value.path == str(bent / "model.safetensors")

    pre, cfg = (json.loads((folder / n).read_text()) for n in ("preprocessor_config.json", "config.json"))
    for name, settings, match in (
            ("preprocessor_config.json", {**pre, "patch_size": 14}, "patch_size 14 differs"),
            ("preprocessor_config.json", {**pre, "size": {"shortest_edge": 9000, "longest_edge": 4096}},
             "min_pixels 9000 is over max_pixels"),
            ("config.json", {**cfg, "vision_config": {**cfg["vision_config"], "out_hidden_size": 32}},
             "out_hidden_size 32"),
            ("config.json", {**cfg, "vision_config": {**cfg["vision_config"], "num_position_embeddings": 15}},
             "not a square")):
        bad = tmp_path / f"bad-{name}-{match[:8]}"
        _relabelled(folder, bad, lambda n: n)
        (bad / name).write_text(json.dumps(settings))
        with pytest.raises(ModelFileError, match=match) as err:
            load_qwen3_5_vision(bad, torch.float32, "cpu")
        assert err.value.path == str(bad / name)


# ---------------------------------------------------------------------------------------------------------------
# Served

TOKENS = 8
NO_THINKING = {"enable_thinking": False}  # the answer is content (the template's thinking prompt aside)


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("vision-qwen3_5-daemon") / "llmd", "--model", str(folder),
                     "--kv-cache-dtype", "fp32")  # log-probs as transformers' to 1e-4
    yield d
    assert d.stop() == 0, d.log()


def expected_answer(reference, processor, image: bytes, question: str) -> tuple[str, list[float]]:
    """transformers' greedy answer (generate: 3-D positions from get_rope_index, then the rope delta) to one user
    turn holding the image then the question, and its tokens' log-probabilities."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                   **NO_THINKING)
    inputs = processor(text=[text], images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    logprobs = [float(torch.log_softmax(step[0].float(), -1).max()) for step in out.scores]
    text = processor.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return text, logprobs


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
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4, fmt  # the positions too
    assert len(set(answers.values())) > 1 and all(answers.values())  # the answer depends on the image
    strip = io.BytesIO()
    Image.new("RGB", (4020, 20)).save(strip, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(strip.getvalue()).decode()}"
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\].*differ at most 200 times"):
        client.chat.completions.create(model=folder.name, max_tokens=TOKENS, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    with urllib.request.urlopen(urllib.request.Request(
            daemon.url + "/api/show", json.dumps({"model": folder.name}).encode(),
            {"Content-Type": "application/json"}), timeout=30) as resp:
        assert "vision" in json.loads(resp.read())["capabilities"]
