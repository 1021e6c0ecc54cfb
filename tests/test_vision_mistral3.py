"""Mistral 3's image encoder (llmd.model.vision.mistral3) against transformers, CPU fp32: a tiny random-weight
Mistral3ForConditionalGeneration written by transformers (tests/tiny_models.py), real PNG and JPEG bytes made with
Pillow. Preprocessing equals PixtralImageProcessorPil's pixel values (called as PixtralProcessor calls it), the
embeddings get_image_features', the expanded prompt PixtralProcessor's layout; the text model loads from the
image-text folder as MistralForCausalLM; bad files are refused by name. Served: a real daemon answers through the
official `openai` client with transformers' greedy generate, and /api/show says vision.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llmd.errors import ModelFileError, UnsupportedArchitecture
from llmd.model.config import ModelConfig
from llmd.model.llama import CausalLM
from llmd.model.loader import load_model
from llmd.model.tokenizer import Tokenizer
from llmd.model.vision.mistral3 import Mistral3Vision, load_mistral3_vision, target_size
from llmd.model.vision.mistral3_gguf import load_mistral3_mmproj
from llmd_daemon_proc import start_daemon
from PIL import Image
from simple_driver import prefill_logits
from test_vision_gemma3 import _image_bytes, _relabelled, _rewrite_gguf
from tiny_models import MISTRAL3_LONGEST_EDGE, MISTRAL3_MERGE, MISTRAL3_PATCH, write_tiny_mistral3_mmproj
from tiny_models import write_tiny_mistral3_vision

EMBED_TOLERANCE = 1e-4
PIXEL_TOLERANCE = 1e-6
UNIT = MISTRAL3_PATCH * MISTRAL3_MERGE  # the processor's patch: one merged image token
TOKENS = 8

IMAGES = {  # sizes below, at and above the 48-pixel longest edge, landscape and portrait
    "png_48": _image_bytes("PNG", (48, 48)),
    "png_50x70": _image_bytes("PNG", (50, 70), seed=1),
    "jpeg_200x120": _image_bytes("JPEG", (200, 120), seed=2),
    "jpeg_33x97": _image_bytes("JPEG", (33, 97), seed=3),
    "png_rgba_20x13": _image_bytes("PNG", (20, 13), "RGBA", seed=4),
    "png_gray_40x64": _image_bytes("PNG", (40, 64), "L", seed=5),
}


def _decode(name: str) -> Image.Image:
    return Image.open(io.BytesIO(IMAGES[name]))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_mistral3_vision(tmp_path_factory.mktemp("mistral3_vision") / "mistral3-vl")


@pytest.fixture(scope="module")
def reference(folder):
    import transformers as tf

    model = tf.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tf.PixtralImageProcessorPil.from_pretrained(folder), tf.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def encoder(folder) -> Mistral3Vision:
    return load_mistral3_vision(folder, torch.float32, "cpu")


@pytest.fixture(scope="module")
def mmproj(folder) -> dict[str, Path]:
    return {kind: write_tiny_mistral3_mmproj(folder, folder.parent / f"mmproj-{kind}.gguf", kind)
            for kind in ("F32", "F16")}


def _reference_inputs(reference, image: Image.Image) -> dict:
    """PixtralImageProcessorPil's outputs, called as PixtralProcessor calls it (its patch times the merge)."""
    return reference[1](image, patch_size={"height": UNIT, "width": UNIT}, return_tensors="pt")


def _reference_embeddings(reference, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference[0].model.get_image_features(
            pixel_values=pixel_values[None], image_sizes=torch.tensor([list(pixel_values.shape[1:])])).pooler_output[0]


def _reference_layout(sizes: list[tuple[int, int]], i: int) -> str:
    """PixtralProcessor.replace_image_token's layout of the i-th image of these (height, width) pixel sizes, written
    out here: transformers' processing_pixtral imports torchvision, which the venv does not hold. A row of
    width / unit [IMG]s, then [IMG_BREAK], per height / unit rows; the last token [IMG_END] instead."""
    height, width = sizes[i]
    tokens = (["[IMG]"] * (width // UNIT) + ["[IMG_BREAK]"]) * (height // UNIT)
    return "".join(tokens[:-1] + ["[IMG_END]"])


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_preprocess_equals_the_image_processor(name, encoder, reference):
    got = encoder.preprocess(_decode(name))
    expected = _reference_inputs(reference, _decode(name))
    assert got.dtype == torch.float32 and tuple(got.shape[1:]) == tuple(expected["image_sizes"][0].tolist())
    assert max(got.shape[1:]) <= MISTRAL3_LONGEST_EDGE and got.shape[1] % UNIT == 0 and got.shape[2] % UNIT == 0
    assert (got - expected["pixel_values"][0]).abs().max().item() <= PIXEL_TOLERANCE


@pytest.mark.parametrize("name", ["png_50x70", "jpeg_200x120", "jpeg_33x97", "png_rgba_20x13"])
def test_embeddings_equal_get_image_features(name, encoder, reference):
    """Non-square images: the 2-D RoPE and the merge read the grid row by row, as transformers does."""
    pixels = encoder.preprocess(_decode(name))
    expected = _reference_embeddings(reference, pixels)
    got = encoder.encode(pixels)
    rows, cols = pixels.shape[1] // UNIT, pixels.shape[2] // UNIT
    assert rows != cols and got.shape == (rows, cols, 64) and got.dtype == torch.float32
    assert encoder.tokens_for(pixels) == rows * cols == expected.shape[0]
    assert (got.reshape(rows * cols, 64) - expected).abs().max().item() < EMBED_TOLERANCE


def test_target_size_is_the_processors():
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    for h, w in [(1, 1), (27, 29), (1540, 1540), (2000, 300), (301, 4000), (1000, 1541), (57, 1539)]:
        expected = get_resize_output_image_size(np.zeros((3, h, w)), (1540, 1540), (28, 28), "channels_first")
        assert target_size(h, w, 1540, 28) == tuple(expected), (h, w)
    assert target_size(8000, 1, 1540, 28) == (1540, 28)  # a sliver keeps a column of tokens (transformers: 0 wide)


def test_bfloat16_encoder_is_close_and_in_the_language_models_dtype(folder, encoder):
    bf16 = load_mistral3_vision(folder, torch.bfloat16, "cpu")
    pixels = encoder.preprocess(_decode("png_50x70"))
    got, expected = bf16.encode(pixels), encoder.encode(pixels)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_expand_matches_the_processor(folder, encoder, reference):
    """The chat template writes [IMG] for an image part; expanded, each image is its rows of [IMG]s broken by
    [IMG_BREAK] and closed by [IMG_END], token for token as PixtralProcessor lays it out."""
    tok = Tokenizer.from_hf_folder(folder)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                             {"type": "image"}, {"type": "text", "text": "these two."}]}]
    rendered = tok.apply_chat_template(messages)
    assert rendered.count(encoder.placeholder_text()) == 2
    pixels = [encoder.preprocess(_decode(n)) for n in ("png_50x70", "jpeg_200x120")]
    grids = [(p.shape[1] // UNIT, p.shape[2] // UNIT) for p in pixels]
    expanded = encoder.expand(rendered, grids)
    sizes = [tuple(p.shape[1:]) for p in pixels]
    pieces = rendered.split("[IMG]")
    expected = pieces[0] + _reference_layout(sizes, 0) + pieces[1] + _reference_layout(sizes, 1) + pieces[2]
    assert expanded == expected
    ids = tok.encode(expanded)
    assert ids == reference[2](expected, add_special_tokens=False)["input_ids"]
    assert ids.count(encoder.image_token_id) == sum(r * c for r, c in grids)
    assert not encoder.bidirectional
    with pytest.raises(ValueError, match="1 images"):
        encoder.expand(rendered, grids[:1])


def test_encode_refuses_pixels_of_another_shape(encoder):
    for shape in [(3, 12, 16), (3, 56, 16), (1, 16, 16), (3, 16)]:
        with pytest.raises(ValueError, match="expected"):
            encoder.encode(torch.zeros(shape))


def _transformers4_name(name: str) -> str:
    if name.startswith("language_model.model."):
        return name.replace("language_model.model.", "model.language_model.", 1)
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    return "model." + name


@pytest.mark.parametrize("layout", ["hub", "transformers4"])
def test_text_model_loads_from_the_image_text_folder(layout, folder, reference, encoder, tmp_path):
    """Mistral3ForConditionalGeneration's text model is MistralForCausalLM, its logits transformers' (no image); the
    loader reads the tower beside it under each layout's names (transformers 5 saves the hub's)."""
    path = folder if layout == "hub" else _relabelled(folder, tmp_path / layout, _transformers4_name)
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert type(lm.model) is CausalLM and lm.config.architecture == "MistralForCausalLM"
    ids = [1] + torch.randint(10, 570, (39,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = reference[0](torch.tensor([ids])).logits[0]
    got = prefill_logits(lm, ids, chunk_sizes=[7])
    assert (got - expected).abs().max().item() < EMBED_TOLERANCE
    assert isinstance(lm.vision, Mistral3Vision)
    pixels = encoder.preprocess(_decode("png_48"))
    assert torch.equal(lm.vision.encode(pixels), encoder.encode(pixels))


def test_ministral3_text_is_refused_by_name():
    """Ministral 3's text model scales its queries by position (llama_4_scaling): not MistralForCausalLM."""
    with pytest.raises(UnsupportedArchitecture, match="Ministral3ForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                                    "text_config": {"model_type": "ministral3", "vocab_size": 640, "hidden_size": 64,
                                                    "intermediate_size": 128, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4}, "vision_config": {}})


# ----------------------------------------------------------------------------------------------------------------
# Bad files: a ModelFileError that names the file and the tensor or setting


def test_missing_or_misshapen_tensor_in_the_folder(folder, tmp_path):
    drop = _relabelled(folder, tmp_path / "drop", lambda n: None if n.endswith("layers.1.feed_forward.up_proj.weight")
                       else n)
    with pytest.raises(ModelFileError, match=r"'vision_tower\.transformer\.layers\.1\.feed_forward\.up_proj\.weight'"
                                             r".*missing"):
        load_mistral3_vision(drop, torch.float32, "cpu")

    from safetensors.torch import load_file, save_file

    bent = _relabelled(folder, tmp_path / "bent", lambda n: n)
    tensors = load_file(bent / "model.safetensors")
    tensors["multi_modal_projector.patch_merger.merging_layer.weight"] = torch.zeros(32, 64)
    save_file(tensors, bent / "model.safetensors")
    with pytest.raises(ModelFileError) as err:
        load_mistral3_vision(bent, torch.float32, "cpu")
    assert err.value.path == str(bent / "model.safetensors")
    assert "'multi_modal_projector.patch_merger.merging_layer.weight' has shape (32, 64), expected (32, 128)" in str(
        err.value)


def test_bad_vision_config_is_refused_by_name(folder, tmp_path):
    bad = _relabelled(folder, tmp_path / "cfg", lambda n: n)
    cfg = json.loads((bad / "config.json").read_text())
    for change, match in [({"vision_feature_layer": -2}, "vision_feature_layer"),
                          ({"vision_config": {**cfg["vision_config"], "hidden_act": "relu"}}, "relu"),
                          ({"vision_config": {**cfg["vision_config"], "num_hidden_layers": 10**6}}, "at most 256"),
                          ({"vision_config": {**cfg["vision_config"], "patch_size": []}}, "patch_size")]:
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelFileError, match=match) as err:
            load_mistral3_vision(bad, torch.float32, "cpu")
        assert err.value.path == str(bad / "config.json")
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = json.loads((bad / "processor_config.json").read_text())
    (bad / "processor_config.json").write_text(json.dumps({**proc, "spatial_merge_size": 3}))
    with pytest.raises(ModelFileError, match="spatial_merge_size 3") as err:
        load_mistral3_vision(bad, torch.float32, "cpu")
    assert err.value.path == str(bad / "processor_config.json")


def test_mmproj_gguf_equals_transformers(mmproj, reference):
    f32 = load_mistral3_mmproj(mmproj["F32"], torch.float32, "cpu", image_token_id=reference[0].config.image_token_id)
    f16 = load_mistral3_mmproj(mmproj["F16"], torch.float32, "cpu")
    assert f32.image_token_id == reference[0].config.image_token_id and f16.image_token_id == 10
    assert f32.config.spatial_merge_size == MISTRAL3_MERGE and f32.config.longest_edge == MISTRAL3_LONGEST_EDGE
    for name in ("png_50x70", "jpeg_200x120"):
        pixels = f32.preprocess(_decode(name))  # the file's own mean / std and longest edge
        assert (pixels - _reference_inputs(reference, _decode(name))["pixel_values"][0]).abs().max().item() <= \
            PIXEL_TOLERANCE
        expected = _reference_embeddings(reference, pixels)
        got = f32.encode(pixels)  # q and k rows back in transformers' order, or the RoPE would turn the wrong pairs
        assert (got.reshape(expected.shape) - expected).abs().max().item() < EMBED_TOLERANCE
        # half-precision matrices (as llama.cpp stores them): dequantized, close but not exact
        err = (f16.encode(pixels).reshape(expected.shape) - expected).abs().max().item()
        assert 0 < err < 2e-2 * expected.abs().max().item()


def test_bad_mmproj_files_are_refused_by_name(mmproj, tmp_path):
    src = mmproj["F32"]
    no_tensor = _rewrite_gguf(src, tmp_path / "a.gguf", drop_tensor="v.blk.1.ffn_gate.weight")
    with pytest.raises(ModelFileError, match=r"'v\.blk\.1\.ffn_gate\.weight'.*missing") as err:
        load_mistral3_mmproj(no_tensor, torch.float32, "cpu")
    assert err.value.path == str(no_tensor)
    pixtral12b = _rewrite_gguf(src, tmp_path / "b.gguf", drop_key="clip.vision.spatial_merge_size")
    with pytest.raises(ModelFileError, match="without a patch merger"):
        load_mistral3_mmproj(pixtral12b, torch.float32, "cpu")
    no_key = _rewrite_gguf(src, tmp_path / "c.gguf", drop_key="clip.vision.embedding_length")
    with pytest.raises(ModelFileError, match="clip.vision.embedding_length"):
        load_mistral3_mmproj(no_key, torch.float32, "cpu")
    other = _rewrite_gguf(src, tmp_path / "d.gguf", drop_key="clip.projector_type",
                          set_key=("clip.projector_type", "gemma3"))
    with pytest.raises(ModelFileError, match="not a Mistral 3 mmproj.*gemma3"):
        load_mistral3_mmproj(other, torch.float32, "cpu")


def test_an_mmproj_beside_a_gguf_is_found_and_loaded_for_its_text_model(folder, mmproj, tmp_path, encoder):
    """llama.cpp's layout: the projector file next to the text GGUF, its [IMG] id from the text vocabulary."""
    import shutil

    from llmd.model.vision.loading import load_mmproj, mmproj_beside

    text = tmp_path / "Mistral-Small-3.1-24B-Instruct-2503-Q4_K_M.gguf"
    text.write_bytes(b"GGUF")
    shutil.copy(mmproj["F32"], tmp_path / "mmproj-F32.gguf")
    assert mmproj_beside(text) == tmp_path / "mmproj-F32.gguf"
    loaded = load_mmproj(tmp_path / "mmproj-F32.gguf", Tokenizer.from_hf_folder(folder), torch.float32,
                         torch.device("cpu"))
    assert isinstance(loaded, Mistral3Vision) and loaded.image_token_id == encoder.image_token_id
    pixels = encoder.preprocess(_decode("jpeg_33x97"))
    assert (loaded.encode(pixels) - encoder.encode(pixels)).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------------------------------------------
# Served: a real daemon, the official openai client


def _expected_text(folder, reference, image: bytes, question: str) -> str:
    """transformers' greedy answer to one user turn holding the image then the question, the prompt laid out as
    PixtralProcessor lays it out."""
    model, _, tokenizer = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = _reference_inputs(reference, Image.open(io.BytesIO(image)))
    text = text.replace("[IMG]", _reference_layout([tuple(inputs["image_sizes"][0].tolist())], 0))
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                             max_new_tokens=TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _stats(daemon) -> dict:
    import urllib.request

    with urllib.request.urlopen(daemon.url + "/v1/llmd/stats", timeout=30) as resp:
        return json.loads(resp.read())["models"][0]["stats"]


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("mistral3-daemon") / "llmd", "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


def test_served_answer_is_transformers_greedy_generate(daemon, folder, reference):
    """Two non-square images (rows of different widths) through the OpenAI dialect; /api/show lists vision."""
    import openai
    import urllib.request

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    answers = {}
    for name in ("png_50x70", "jpeg_200x120"):
        url = f"data:image/png;base64,{base64.b64encode(IMAGES[name]).decode()}"
        reply = client.chat.completions.create(
            model=folder.name, max_tokens=TOKENS, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is this?"}]}])
        answers[name] = reply.choices[0].message.content
        assert answers[name] == _expected_text(folder, reference, IMAGES[name], "What is this?"), name
    assert len(set(answers.values())) > 1  # the answer depends on the image
    hits = _stats(daemon)["kv"]["prefix_hits_tokens"]
    client.chat.completions.create(  # the same image again: its rows' blocks come from the prefix cache
        model=folder.name, max_tokens=2, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(IMAGES['png_50x70']).decode()}"}},
            {"type": "text", "text": "Again?"}]}])
    assert _stats(daemon)["kv"]["prefix_hits_tokens"] - hits >= 16
    sliver = base64.b64encode(_image_bytes("PNG", (1, 600))).decode()  # one pixel wide: one column of tokens
    reply = client.chat.completions.create(model=folder.name, max_tokens=1, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{sliver}"}}]}])
    assert reply.choices[0].finish_reason == "length"
    req = urllib.request.Request(daemon.url + "/api/show", json.dumps({"model": folder.name}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert "vision" in json.loads(resp.read())["capabilities"]
