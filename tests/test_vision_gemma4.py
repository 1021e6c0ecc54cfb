"""Gemma 4's image encoder (llmd.model.vision.gemma4) against transformers, CPU fp32: tiny random-weight
Gemma4ForConditionalGeneration folders written by transformers (tests/tiny_models.py) — a 31B-like text model whose
images attend both ways (use_bidirectional_attention "vision") beside a tower with clipped linears and
standardisation, and an E-like one (per-layer embeddings) whose images attend causally — and the tower in an mmproj
GGUF written as llama.cpp's converter does; real PNG/JPEG bytes made with Pillow. Preprocessing equals
Gemma4ImageProcessorPil's patches and positions, the embeddings get_image_features', the expanded prompt
Gemma4Processor's tokens; the engine's answer to a prompt with images equals Gemma4ForConditionalGeneration's (its
mask: both ways in the sliding layers within the window, causal in the global ones; image tokens' per-layer inputs the
pad token's); the text model loads from the image-text folder; a daemon answers an image as transformers' generate
does; bad files are refused by name."""

from __future__ import annotations

import base64
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
from llmd.model.gemma4 import Gemma4CausalLM
from llmd.model.loader import load_model
from llmd.model.tokenizer import Tokenizer
from llmd.model.vision.gemma4 import Gemma4Vision, load_gemma4_vision
from llmd.model.vision.gemma4_gguf import load_gemma4_mmproj
from llmd_daemon_proc import start_daemon
from PIL import Image
from simple_driver import prefill_logits
from test_vision_gemma3 import _image_bytes, _relabelled, _rewrite_gguf
from test_vision_served import picture
from tiny_models import GEMMA4_MAX_TOKENS, GEMMA4_PATCH, write_tiny_gemma4_mmproj, write_tiny_gemma4_vision

EMBED_TOLERANCE = 1e-4
TOKENS = 8

IMAGES = {  # name -> encoded bytes: landscape, portrait, tiny (scaled up to the budget), a thin strip, RGBA, grey
    "png_50x30": _image_bytes("PNG", (50, 30)),
    "jpeg_60x90": _image_bytes("JPEG", (60, 90), seed=1),
    "png_9x7": _image_bytes("PNG", (9, 7), seed=2),
    "jpeg_200x13": _image_bytes("JPEG", (200, 13), seed=3),
    "png_rgba_70x70": _image_bytes("PNG", (70, 70), "RGBA", seed=4),
    "png_gray_40x64": _image_bytes("PNG", (40, 64), "L", seed=5),
}


def _decode(name: str) -> Image.Image:
    return Image.open(io.BytesIO(IMAGES[name]))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4_vision")
    return {"both_ways": write_tiny_gemma4_vision(root / "g4-31b-like", seed=1),  # (its greedy answers are text)
            "causal": write_tiny_gemma4_vision(root / "g4-e-like", seed=2, variant="gemma4_e", bidirectional=False,
                                               clipped=False)}


@pytest.fixture(scope="module")
def folder(folders) -> Path:
    return folders["both_ways"]


def reference_processor(folder: Path):
    """Gemma4Processor over the folder's files. It wants a video processor, which needs torchvision (not installed
    here); images need none, so that one is left out of its class check."""
    import transformers as tf
    from transformers.processing_utils import ProcessorMixin

    settings = json.loads((folder / "processor_config.json").read_text())
    image_processor = tf.Gemma4ImageProcessorPil(**{k: v for k, v in settings["image_processor"].items()
                                                    if k != "image_processor_type"})
    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class",
                   lambda self, name, arg: None if arg is None else check(self, name, arg))
        return tf.Gemma4Processor(feature_extractor=tf.Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                                  tokenizer=tf.AutoTokenizer.from_pretrained(folder), video_processor=None)


@pytest.fixture(scope="module")
def references(folders) -> dict:
    import transformers as tf

    return {kind: (tf.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(),
                   reference_processor(path)) for kind, path in folders.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["both_ways"]


@pytest.fixture(scope="module")
def encoder(folder) -> Gemma4Vision:
    return load_gemma4_vision(folder, torch.float32, "cpu")


def _reference_inputs(reference, image: Image.Image) -> dict:
    return reference[1].image_processor(image, return_tensors="pt")


def _reference_embeddings(reference, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return reference[0].get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output[0]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_preprocess_equals_the_image_processor(name, encoder, reference):
    """The same resize and the same patches in the same order, at the same (column, row); the processor pads to its
    budget with zero patches at (-1, -1), which llmd never makes."""
    pixels = encoder.preprocess(_decode(name))
    patches, positions = encoder.patches(pixels)
    expected = _reference_inputs(reference, _decode(name))
    n = patches.shape[0]
    assert pixels.dtype == torch.float32 and encoder.tokens_for(pixels) == expected["num_soft_tokens_per_image"][0]
    assert encoder.tokens_for(pixels) > GEMMA4_MAX_TOKENS * 0.6  # each image fills most of the budget
    assert (patches - expected["pixel_values"][0, :n]).abs().max().item() <= 1e-6
    assert torch.equal(positions, expected["image_position_ids"][0, :n])
    assert (expected["image_position_ids"][0, n:] == -1).all()


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_embeddings_equal_get_image_features(name, encoder, reference):
    pixels = encoder.preprocess(_decode(name))
    expected = _reference_embeddings(reference, _reference_inputs(reference, _decode(name)))
    got = encoder.encode(pixels)
    assert got.shape == (encoder.tokens_for(pixels), 64) and got.dtype == torch.float32
    assert expected.abs().max().item() > 0.1
    assert (got - expected).abs().max().item() < EMBED_TOLERANCE


def test_bfloat16_encoder_is_close_and_in_the_language_models_dtype(folder, encoder):
    bf16 = load_gemma4_vision(folder, torch.bfloat16, "cpu")
    pixels = encoder.preprocess(_decode("png_50x30"))
    got, expected = bf16.encode(pixels), encoder.encode(pixels)
    assert got.dtype == torch.bfloat16 and bf16.std_bias.dtype == torch.float32
    assert (got.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_expand_matches_the_processor(folder, encoder, reference):
    """The chat template writes <|image|> for an image part; expanded, the prompt tokenizes as Gemma4Processor's
    (two images in one message, one in a later turn); pixels of another shape are refused."""
    tok = Tokenizer.from_hf_folder(folder)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "these two."}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.count(encoder.placeholder_text()) == 3
    images = [_decode(n) for n in ("png_50x30", "jpeg_60x90", "png_9x7")]
    counts = [encoder.tokens_for(encoder.preprocess(i)) for i in images]
    ids = tok.encode(encoder.expand(rendered, counts))
    processed = reference[1](text=[rendered], images=[images], add_special_tokens=False, return_tensors="pt")
    assert ids == processed["input_ids"][0].tolist()
    assert ids.count(encoder.image_token_id) == sum(counts) and len(set(counts)) > 1
    assert encoder.image_token_id == reference[0].config.image_token_id
    with pytest.raises(ValueError, match="2 images"):
        encoder.expand(rendered, counts[:2])
    with pytest.raises(ValueError, match="multiples of 8"):
        encoder.encode(torch.zeros(3, 30, 32))


def _image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == token:
            j += 1
        if j > i:
            runs.append((i, j - i))
        i = max(j, i + 1)
    return runs


@pytest.mark.parametrize("kind", ["both_ways", "causal"])
def test_engine_answers_an_image_prompt_as_transformers(kind, folders, references):
    """Two images in a prompt whose sliding layers' window (16) is shorter than each image (~60 tokens), prefilled
    in chunks of 7 (never splitting an image whose tokens see each other): the engine's first token and its logprob
    are Gemma4ForConditionalGeneration's with its own mask; 31B-like: the images' tokens both ways in the sliding
    layers within the window, causally in the global ones; E-like: causally, their per-layer inputs the pad token's."""
    lm = load_model(folders[kind], dtype=torch.float32, device="cpu")
    assert isinstance(lm.model, Gemma4CausalLM) and isinstance(lm.vision, Gemma4Vision)
    assert lm.vision.bidirectional == (kind == "both_ways")
    model, processor = references[kind]
    tok = Tokenizer.from_hf_folder(folders[kind])
    rendered = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}],
        add_generation_prompt=True)
    images = [Image.open(io.BytesIO(picture("PNG", c, size))) for c, size in (((220, 40, 40), (40, 30)),
                                                                               ((30, 160, 60), (30, 50)))]
    embeds = [lm.vision.encode(lm.vision.preprocess(i)) for i in images]
    ids = tok.encode(lm.vision.expand(rendered, [int(e.shape[0]) for e in embeds]))
    inputs = processor(text=[rendered], images=[images], add_special_tokens=False, return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    spans = [ImageSpan(start, n, bytes([i]), e, lm.vision.bidirectional)
             for i, ((start, n), e) in enumerate(zip(_image_runs(ids, lm.vision.image_token_id), embeds, strict=True))]
    assert all(s.length > lm.config.sliding_window for s in spans) and len(ids) - spans[-1].end < 16
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    engine = make_engine(lm, max_num_batched_tokens=7, kv_cache_dtype="fp32")
    engine.add_request("a", ids, SamplingParams(max_tokens=1, logprobs=0, temperature=0), images=spans)
    outs = []
    while engine.has_work():
        outs += engine.step()
    (out,) = outs
    assert out.new_token_ids == [int(logits.argmax())]
    assert abs(out.logprobs[0].logprob - torch.log_softmax(logits, -1).max().item()) < EMBED_TOLERANCE


def test_text_model_loads_from_the_image_text_folder(folder, reference):
    """Gemma4ForConditionalGeneration's text model is Gemma4ForCausalLM, its logits transformers' (no image)."""
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    assert lm.config.architecture == "Gemma4ForCausalLM" and lm.config.sliding_window == 16
    ids = [2] + torch.randint(30, 570, (39,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = reference[0](torch.tensor([ids])).logits[0]
    assert (prefill_logits(lm, ids, chunk_sizes=[7]) - expected).abs().max().item() < EMBED_TOLERANCE


def test_mmproj_gguf_equals_transformers(folder, reference, encoder, tmp_path):
    """llama.cpp's layout (projector type gemma4v), found through MMPROJ_LOADERS with the image token of the text
    vocabulary; F16 matrices close but not exact. The file holds no budget: the processor's default of 280 tokens."""
    from llmd.model.vision.loading import load_mmproj

    f32 = load_mmproj(write_tiny_gemma4_mmproj(folder, tmp_path / "mmproj-f32.gguf"), Tokenizer.from_hf_folder(folder),
                      torch.float32, torch.device("cpu"))
    f16 = load_gemma4_mmproj(write_tiny_gemma4_mmproj(folder, tmp_path / "mmproj-f16.gguf", "F16"), torch.float32,
                             "cpu")
    assert isinstance(f32, Gemma4Vision) and f32.image_token_id == reference[0].config.image_token_id
    assert f32.config.max_soft_tokens == 280 and f32.config.clipped and f32.config.standardize
    pixels = f32.preprocess(_decode("png_50x30"))
    assert f32.tokens_for(pixels) > GEMMA4_MAX_TOKENS
    for name in ("png_50x30", "jpeg_60x90"):
        inputs = _reference_inputs(reference, _decode(name))
        pixels = encoder.preprocess(_decode(name))
        expected = _reference_embeddings(reference, inputs)
        assert (f32.encode(pixels) - expected).abs().max().item() < EMBED_TOLERANCE
        err = (f16.encode(pixels) - expected).abs().max().item()
        assert 0 < err < 2e-2 * expected.abs().max().item()


# ----------------------------------------------------------------------------------------------------------------
# Bad files: a ModelFileError that names the file and the tensor or setting


def test_bad_files_are_refused_by_name(folder, tmp_path):
    drop = _relabelled(folder, tmp_path / "drop", lambda n: None if n.endswith("layers.1.mlp.up_proj.input_max") else n)
    with pytest.raises(ModelFileError, match=r"'model\.vision_tower\.encoder\.layers\.1\.mlp\.up_proj\.input_max'.*"
                                             "missing"):
        load_gemma4_vision(drop, torch.float32, "cpu")
    from safetensors.torch import load_file, save_file

    bent = _relabelled(folder, tmp_path / "bent", lambda n: n)
    tensors = load_file(bent / "model.safetensors")
    tensors["model.embed_vision.embedding_projection.weight"] = torch.zeros(64, 33)
    save_file(tensors, bent / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"'model\.embed_vision\.embedding_projection\.weight' has shape "
                                             r"\(64, 33\), expected \(64, 32\)") as err:
        load_gemma4_vision(bent, torch.float32, "cpu")
    assert err.value.path == str(bent / "model.safetensors")

    settings = json.loads((folder / "processor_config.json").read_text())
    for change, match in (({"max_soft_tokens": 100}, "max_soft_tokens 100"),
                          ({"patch_size": GEMMA4_PATCH * 2}, "patch_size 8 differs")):
        bad = {**settings, "image_processor": {**settings["image_processor"], **change}}
        (drop / "processor_config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelFileError, match=match) as err:
            load_gemma4_vision(drop, torch.float32, "cpu")
        assert err.value.path == str(drop / "processor_config.json")
    cfg = json.loads((folder / "config.json").read_text())
    (bent / "config.json").write_text(json.dumps({**cfg, "vision_config": {**cfg["vision_config"], "head_dim": 6}}))
    with pytest.raises(ModelFileError, match="multiple of 4"):
        load_gemma4_vision(bent, torch.float32, "cpu")

    mmproj = write_tiny_gemma4_mmproj(folder, tmp_path / "mmproj.gguf")
    no_tensor = _rewrite_gguf(mmproj, tmp_path / "a.gguf", drop_tensor="v.blk.1.attn_k_norm.weight")
    with pytest.raises(ModelFileError, match=r"'v\.blk\.1\.attn_k_norm\.weight'.*missing"):
        load_gemma4_mmproj(no_tensor, torch.float32, "cpu")
    other = _rewrite_gguf(mmproj, tmp_path / "b.gguf", drop_key="clip.vision.projector_type",
                          set_key=("clip.vision.projector_type", "gemma3"))
    with pytest.raises(ModelFileError, match="not a Gemma 4 mmproj.*gemma3"):
        load_gemma4_mmproj(other, torch.float32, "cpu")


# ----------------------------------------------------------------------------------------------------------------
# Served: a real daemon


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("vision-gemma4-daemon") / "llmd", "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


def expected_text(folder: Path, reference, image: bytes, question: str) -> str:
    """transformers' greedy answer to one user turn holding the image then the question."""
    model, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_served_answers_equal_transformers_generate(daemon, folder, reference):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    answers = {}
    for fmt, color in (("png", (220, 40, 40)), ("jpeg", (40, 60, 230))):
        data = picture(fmt.upper(), color)
        url = f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"
        reply = client.chat.completions.create(
            model=folder.name, max_tokens=TOKENS, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is this?"}]}])
        answers[fmt] = reply.choices[0].message.content
        assert answers[fmt] == expected_text(folder, reference, data, "What is this?"), fmt
    assert len(set(answers.values())) > 1 and all(answers.values())  # the answer depends on the image
    with urllib.request.urlopen(urllib.request.Request(
            daemon.url + "/api/show", json.dumps({"model": folder.name}).encode(),
            {"Content-Type": "application/json"}), timeout=30) as resp:
        assert "vision" in json.loads(resp.read())["capabilities"]



def test_image_prompts_batched_cached_and_preempted_equal_alone(folder):
    """The engine's invariants with Gemma 4's images (their tokens both ways in the sliding layers only): two prompts
    sharing an image prefix, batched and chunked, equal each alone and the second reuses the first's blocks; under a
    small KV pool, preempted equals plain."""
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    vision, tok = lm.vision, Tokenizer.from_hf_folder(folder)
    embeds = vision.encode(vision.preprocess(Image.open(io.BytesIO(picture("PNG", (220, 40, 40))))))
    prompts = [tok.encode(vision.expand(tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": question}]}], add_generation_prompt=True), [embeds.shape[0]]))
        for question in ("What is this?", "Which colour is it, and where is the chequered corner?")]
    images = [[ImageSpan(start, n, b"red", embeds, True) for start, n in _image_runs(p, vision.image_token_id)]
              for p in prompts]
    params = SamplingParams(max_tokens=TOKENS, temperature=0)

    def run(engine, which):
        for i in which:
            engine.add_request(str(i), prompts[i], params, images=images[i])
        out: dict[str, list[int]] = {str(i): [] for i in which}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return [out[str(i)] for i in which]

    alone = [run(make_engine(lm, enable_prefix_caching=False), [i])[0] for i in (0, 1)]
    engine = make_engine(lm, max_num_batched_tokens=24)
    assert run(engine, [0]) + run(engine, [1]) == alone
    assert engine.stats().kv.prefix_hits_tokens >= 48  # the second prompt read the image's blocks
    assert run(make_engine(lm, max_num_batched_tokens=100), [0, 1]) == alone
    small = make_engine(lm, num_kv_blocks=9)
    assert run(small, [0, 1]) == alone and small.stats().num_preemptions > 0
