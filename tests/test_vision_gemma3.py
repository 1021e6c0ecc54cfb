"""Gemma 3's image encoder (llmd.model.vision.gemma3) against transformers, CPU fp32: a tiny random-weight
Gemma3ForConditionalGeneration written by transformers (tests/tiny_models.py) and the same tower in an mmproj GGUF
written as llama.cpp's converter does; real PNG and JPEG bytes made with Pillow. Preprocessing equals
Gemma3ImageProcessor's pixel values, the embeddings get_image_features', the expanded prompt Gemma3Processor's
tokens; the text model loads from the image-text folder as Gemma3ForCausalLM; bad files are refused by name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llmd.errors import ModelFileError
from llmd.model.config import ModelConfig
from llmd.model.gemma import GemmaCausalLM
from llmd.model.loader import load_model
from llmd.model.tokenizer import Tokenizer
from llmd.model.vision.gemma3 import Gemma3Vision, load_gemma3_mmproj, load_gemma3_vision
from PIL import Image
from simple_driver import prefill_logits
from tiny_models import GEMMA3_IMAGE_SIZE, GEMMA3_IMAGE_TOKENS, write_tiny_gemma3_mmproj, write_tiny_gemma3_vision

EMBED_TOLERANCE = 1e-4
PIXEL_TOLERANCE = 1e-6


def _image_bytes(fmt: str, size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> bytes:
    """A random-ish picture (smooth gradients plus noise, so resizing has something to do) encoded by Pillow."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(w + h - 2, 1)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":  # a transparent hole, composited onto white
        alpha = np.full((h, w), 255, np.uint8)
        alpha[h // 4: h // 2, w // 4: w // 2] = 0
        alpha[h // 2:, :] = 128
        image.putalpha(Image.fromarray(alpha, "L"))
    elif mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return out.getvalue()


IMAGES = {  # name -> encoded bytes: sizes below, at and above the tower's 64x64, landscape and portrait
    "png_64": _image_bytes("PNG", (64, 64)),
    "png_50x70": _image_bytes("PNG", (50, 70), seed=1),
    "jpeg_200x120": _image_bytes("JPEG", (200, 120), seed=2),
    "jpeg_33x97": _image_bytes("JPEG", (33, 97), seed=3),
    "png_rgba_90x90": _image_bytes("PNG", (90, 90), "RGBA", seed=4),
    "png_gray_40x64": _image_bytes("PNG", (40, 64), "L", seed=5),
}


def _decode(name: str) -> Image.Image:
    return Image.open(io.BytesIO(IMAGES[name]))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision") / "hf")


@pytest.fixture(scope="module")
def reference(folder):
    import transformers as tf

    model = tf.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tf.AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def encoder(folder) -> Gemma3Vision:
    return load_gemma3_vision(folder, torch.float32, "cpu")


@pytest.fixture(scope="module")
def mmproj(folder) -> dict[str, Path]:
    return {kind: write_tiny_gemma3_mmproj(folder, folder.parent / f"mmproj-{kind}.gguf", kind)
            for kind in ("F32", "F16")}


def _reference_pixels(reference, name: str) -> torch.Tensor:
    """Gemma3ImageProcessor's pixel values, called as Gemma3Processor calls it (converting to RGB)."""
    return reference[1].image_processor(_decode(name), do_convert_rgb=True, return_tensors="pt")["pixel_values"][0]


def _reference_embeddings(reference, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference[0].get_image_features(pixel_values[None]).pooler_output[0]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_preprocess_equals_the_image_processor(name, encoder, reference):
    got = encoder.preprocess(_decode(name))
    expected = _reference_pixels(reference, name)
    assert got.dtype == torch.float32 and got.shape == (3, GEMMA3_IMAGE_SIZE, GEMMA3_IMAGE_SIZE)
    assert (got - expected).abs().max().item() <= PIXEL_TOLERANCE


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_embeddings_equal_get_image_features(name, encoder, reference):
    pixels = encoder.preprocess(_decode(name))
    expected = _reference_embeddings(reference, pixels)
    got = encoder.encode(pixels)
    assert got.shape == (GEMMA3_IMAGE_TOKENS, 64) and got.dtype == torch.float32
    assert expected.abs().max().item() > 0.1  # the projection is not the zeros it was initialised to
    assert (got - expected).abs().max().item() < EMBED_TOLERANCE
    assert encoder.tokens_for(pixels) == GEMMA3_IMAGE_TOKENS


def test_different_images_give_different_embeddings(encoder):
    a, b = (encoder.encode(encoder.preprocess(_decode(n))) for n in ("png_64", "jpeg_200x120"))
    assert (a - b).abs().max().item() > 1e-2


def test_mmproj_gguf_equals_transformers(mmproj, reference):
    f32 = load_gemma3_mmproj(mmproj["F32"], torch.float32, "cpu", image_token_id=reference[0].config.image_token_id)
    f16 = load_gemma3_mmproj(mmproj["F16"], torch.float32, "cpu")
    assert f32.image_token_id == reference[0].config.image_token_id and f16.image_token_id == 262144
    assert f32.config.mm_tokens_per_image == GEMMA3_IMAGE_TOKENS  # from clip.vision.projector.scale_factor
    for name in ("png_50x70", "jpeg_200x120"):
        pixels = f32.preprocess(_decode(name))  # the file's own mean / std
        assert (pixels - _reference_pixels(reference, name)).abs().max().item() <= PIXEL_TOLERANCE
        expected = _reference_embeddings(reference, pixels)
        assert (f32.encode(pixels) - expected).abs().max().item() < EMBED_TOLERANCE
        # half-precision matrices (as llama.cpp stores the projection): dequantized, close but not exact
        err = (f16.encode(pixels) - expected).abs().max().item()
        assert 0 < err < 2e-2 * expected.abs().max().item()


def test_bfloat16_encoder_is_close_and_in_the_language_models_dtype(folder, encoder):
    bf16 = load_gemma3_vision(folder, torch.bfloat16, "cpu")
    pixels = encoder.preprocess(_decode("png_64"))
    got, expected = bf16.encode(pixels), encoder.encode(pixels)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_expand_matches_the_processor(folder, encoder, reference):
    """The chat template writes <start_of_image> for an image part; expanded, the prompt tokenizes as
    Gemma3Processor's does (two images in one message, and one in a later turn)."""
    tok = Tokenizer.from_hf_folder(folder)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "these two."}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    rendered = tok.apply_chat_template(messages)
    assert rendered.count(encoder.placeholder_text()) == 3
    images = [_decode(n) for n in ("png_64", "jpeg_200x120", "png_50x70")]
    expanded = encoder.expand(rendered, [encoder.tokens_for(encoder.preprocess(i)) for i in images])
    processed = reference[1](text=[rendered], images=[images], add_special_tokens=False, return_tensors="pt")
    ids = tok.encode(expanded)
    assert ids == processed["input_ids"][0].tolist()
    assert ids.count(encoder.image_token_id) == 3 * GEMMA3_IMAGE_TOKENS
    assert encoder.image_token_id == reference[0].config.image_token_id and encoder.bidirectional
    with pytest.raises(ValueError, match="2 images"):
        encoder.expand(rendered, [GEMMA3_IMAGE_TOKENS] * 2)


def test_encode_refuses_pixels_of_another_shape(encoder):
    with pytest.raises(ValueError, match="expected"):
        encoder.encode(torch.zeros(3, 32, 32))


def _relabelled(src: Path, dst: Path, rename) -> Path:
    """A copy of the folder whose safetensors names are rename(name) (None: dropped)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        new = rename(name)
        if new is not None:
            tensors[new] = t
    save_file(tensors, dst / "model.safetensors")
    return dst


def _hub_name(name: str) -> str:  # google/gemma-3-*-it
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _transformers4_name(name: str) -> str:
    if name.startswith("language_model.model."):
        return name.replace("language_model.model.", "model.language_model.", 1)
    return "model." + _hub_name(name)


@pytest.mark.parametrize("layout", ["transformers5", "hub", "transformers4"])
def test_text_model_loads_from_the_image_text_folder(layout, folder, reference, encoder, tmp_path):
    """Gemma3ForConditionalGeneration's text model is Gemma3ForCausalLM, its logits transformers' (no image); the
    loader reads the same tower beside it under each layout's names."""
    rename = {"transformers5": None, "hub": _hub_name, "transformers4": _transformers4_name}[layout]
    path = folder if rename is None else _relabelled(folder, tmp_path / layout, rename)
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert isinstance(lm.model, GemmaCausalLM) and lm.config.architecture == "Gemma3ForCausalLM"
    assert lm.config.layer_types == ["sliding_attention", "full_attention"] and lm.config.sliding_window == 16
    ids = [2] + torch.randint(10, 570, (39,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = reference[0](torch.tensor([ids])).logits[0]
    got = prefill_logits(lm, ids, chunk_sizes=[7])
    assert (got - expected).abs().max().item() < EMBED_TOLERANCE
    assert isinstance(lm.vision, Gemma3Vision)  # llmd.model.vision.loading found the tower beside it
    pixels = encoder.preprocess(_decode("png_64"))
    assert torch.equal(lm.vision.encode(pixels), encoder.encode(pixels))


def test_hub_config_without_text_sizes_takes_transformers_defaults():
    """The hub's gemma-3-4b-it config.json names only what differs from Gemma3TextConfig's defaults."""
    cfg = ModelConfig.from_hf_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "patch_size": 14}})
    assert (cfg.architecture, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        "Gemma3ForCausalLM", 262_208, 8, 4, 256)
    assert cfg.eos_token_ids == [1, 106] and cfg.rope_scaling["factor"] == 8.0 and cfg.layer_types[5] == "full_attention"


# ----------------------------------------------------------------------------------------------------------------
# Bad files: a ModelFileError that names the file and the tensor or setting


def test_missing_or_misshapen_tensor_in_the_folder(folder, tmp_path):
    drop = _relabelled(folder, tmp_path / "drop", lambda n: None if n.endswith("layers.1.mlp.fc2.bias") else n)
    with pytest.raises(ModelFileError, match=r"'vision_tower\.encoder\.layers\.1\.mlp\.fc2\.bias'.*missing"):
        load_gemma3_vision(drop, torch.float32, "cpu")

    from safetensors.torch import load_file, save_file

    bent = _relabelled(folder, tmp_path / "bent", lambda n: n)
    tensors = load_file(bent / "model.safetensors")
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(32, 65)
    save_file(tensors, bent / "model.safetensors")
    with pytest.raises(ModelFileError) as err:
        load_gemma3_vision(bent, torch.float32, "cpu")
    assert err.value.path == str(bent / "model.safetensors")
    assert "'multi_modal_projector.mm_input_projection_weight' has shape (32, 65), expected (32, 64)" in str(err.value)


def test_bad_vision_config_is_refused_by_name(folder, tmp_path):
    bad = _relabelled(folder, tmp_path / "cfg", lambda n: n)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "mm_tokens_per_image": 15}))
    with pytest.raises(ModelFileError, match="15 tokens") as err:
        load_gemma3_vision(bad, torch.float32, "cpu")
    assert err.value.path == str(bad / "config.json")
    (bad / "config.json").write_text(json.dumps({**cfg, "vision_config": {**cfg["vision_config"], "patch_size": "8"}}))
    load_gemma3_vision(bad, torch.float32, "cpu")  # a number in a string is still that number
    (bad / "config.json").write_text(json.dumps({**cfg, "vision_config": {**cfg["vision_config"], "patch_size": []}}))
    with pytest.raises(ModelFileError, match="patch_size"):
        load_gemma3_vision(bad, torch.float32, "cpu")
    (bad / "config.json").write_text(json.dumps({**cfg, "vision_config": {**cfg["vision_config"],
                                                                          "num_hidden_layers": 10**6}}))
    with pytest.raises(ModelFileError, match="at most 256 layers"):  # refused before anything is built
        load_gemma3_vision(bad, torch.float32, "cpu")
    text_only = {k: v for k, v in cfg.items() if k != "vision_config"}
    (bad / "config.json").write_text(json.dumps(text_only))
    with pytest.raises(ModelFileError, match="no vision_config"):
        load_gemma3_vision(bad, torch.float32, "cpu")


def _rewrite_gguf(src: Path, dst: Path, drop_key: str | None = None, drop_tensor: str | None = None,
                  set_key: tuple[str, str] | None = None) -> Path:
    """A copy of an mmproj GGUF without one key or tensor, or with one string key set."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", drop_key):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, value)
        else:
            w.add_key_value(field.name, value, vtype)
    if set_key:
        w.add_string(*set_key)
    for t in reader.tensors:
        if t.name != drop_tensor:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_mmproj_files_are_refused_by_name(mmproj, tmp_path):
    src = mmproj["F32"]
    no_tensor = _rewrite_gguf(src, tmp_path / "a.gguf", drop_tensor="v.blk.1.attn_k.bias")
    with pytest.raises(ModelFileError, match=r"'v\.blk\.1\.attn_k\.bias'.*missing") as err:
        load_gemma3_mmproj(no_tensor, torch.float32, "cpu")
    assert err.value.path == str(no_tensor)
    no_key = _rewrite_gguf(src, tmp_path / "b.gguf", drop_key="clip.vision.block_count")
    with pytest.raises(ModelFileError, match="clip.vision.block_count"):
        load_gemma3_mmproj(no_key, torch.float32, "cpu")
    other = _rewrite_gguf(src, tmp_path / "c.gguf", drop_key="clip.projector_type",
                          set_key=("clip.projector_type", "qwen3vl"))
    with pytest.raises(ModelFileError, match="not a Gemma 3 mmproj.*qwen3vl"):
        load_gemma3_mmproj(other, torch.float32, "cpu")
    truncated = tmp_path / "d.gguf"
    truncated.write_bytes(src.read_bytes()[: src.stat().st_size - 100])
    with pytest.raises(ModelFileError, match="truncated"):
        load_gemma3_mmproj(truncated, torch.float32, "cpu")


def test_an_mmproj_beside_a_gguf_is_found_and_loaded_for_its_text_model(folder, mmproj, tmp_path, encoder):
    """llama.cpp's layout: the projector file next to the text GGUF, its image token from the text vocabulary."""
    import shutil

    from llmd.model.vision.loading import load_mmproj, mmproj_beside

    text = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    text.write_bytes(b"GGUF")
    assert mmproj_beside(text) is None
    shutil.copy(mmproj["F32"], tmp_path / "mmproj-other-f16.gguf")
    shutil.copy(mmproj["F32"], tmp_path / "gemma-3-4b-it-mmproj-f16.gguf")
    found = mmproj_beside(text)
    assert found == tmp_path / "gemma-3-4b-it-mmproj-f16.gguf"  # of two, the one named like the model
    loaded = load_mmproj(found, Tokenizer.from_hf_folder(folder), torch.float32, torch.device("cpu"))
    pixels = encoder.preprocess(_decode("png_64"))
    assert loaded.image_token_id == encoder.image_token_id
    assert (loaded.encode(pixels) - encoder.encode(pixels)).abs().max().item() < 1e-4
