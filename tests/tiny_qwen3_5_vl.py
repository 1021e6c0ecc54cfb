"""A tiny random-weight Qwen3_5ForConditionalGeneration in Hugging Face layout, written with transformers' own classes
(the reference): a 4-layer Qwen3.5 text model (Gated DeltaNet layers 0-2, gated attention on 3) whose multimodal RoPE
uses all three components (rotary_dim 16: 8 frequencies interleaved t, h, w by mrope_section [3, 3, 2]), a 2-block
vision tower in patches of 16 merged 2 x 2 (a 4 x 4 learned position grid, so every image interpolates it), the
image processor's settings (preprocessor_config.json: min/max pixels, mean/std not the defaults) and a tokenizer
with Qwen's vision specials and Qwen3.5's own chat template.
And a tiny Qwen3VLForConditionalGeneration (Qwen3.5's tower descends from it): a 4-layer Qwen3 text model (q/k norm)
whose multimodal RoPE turns whole heads of 16 (8 frequencies, mrope_section [3, 3, 2]), a 3-block tower of the same
shape with DeepStack mergers after blocks 0 and 1 (added to text layers 0 and 1), the same processor files and
tokenizer (Qwen3.5's template writes images as Qwen3-VL's does); or its MoE variant.
Either folder as llama.cpp's converter writes it: its text model as a GGUF file (`write_text_gguf`) and its tower as
an mmproj GGUF beside it (`write_mmproj`: projector qwen3vl_merger).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tiny_models import MODEL_VOCAB, _randomise, _write_json, train_tokenizer, write_tiny_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
TEMPLATE_FILE = Path(__file__).parent / "chat_templates" / "qwen3.5.jinja"
PATCH, MERGE = 16, 2
MIN_PIXELS, MAX_PIXELS = 64 * 64, 128 * 128  # at most 64 patches: 16 image tokens
IMAGE_MEAN, IMAGE_STD = [0.48, 0.45, 0.41], [0.27, 0.26, 0.28]


def write_tiny_qwen3_5_vl(folder: Path, seed: int = 0, moe: bool = False) -> Path:
    """moe: a Qwen3_5MoeForConditionalGeneration (every MLP 8 experts, top 2, and a gated shared expert)."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SPECIALS, add_bos=None)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}
    text = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512,
                rms_norm_eps=1e-6, initializer_range=0.1, rope_parameters=rope, tie_word_embeddings=False,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  initializer_range=0.1)
    if moe:
        del text["intermediate_size"]
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    config_class = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model_class = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    model = model_class(config).eval()
    _randomise(model)
    with torch.no_grad():  # the text model's RMSNorms scale by 1 + weight (not the gated one): keep them near 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name and ".visual." not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    _write_processing(folder, tok, ids)
    return folder


def write_tiny_qwen3_vl(folder: Path, seed: int = 0, deepstack: tuple[int, ...] = (0, 1), moe: bool = False) -> Path:
    """moe: a Qwen3VLMoeForConditionalGeneration (every MLP 8 experts of 16, top 2)."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SPECIALS, add_bos=None)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    text = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-6, initializer_range=0.1, rope_parameters=rope, tie_word_embeddings=False,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=list(deepstack), initializer_range=0.1)
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    config_class = tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (tf.Qwen3VLMoeForConditionalGeneration if moe else tf.Qwen3VLForConditionalGeneration)(config).eval()
    _randomise(model)
    model.save_pretrained(folder)
    _write_processing(folder, tok, ids)
    return folder


def _write_processing(folder: Path, tok, ids: dict[str, int]) -> None:
    """The tokenizer (with Qwen3.5's template), generation and image processor settings."""
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE_FILE.read_text(encoding="utf-8")})
    _write_json(folder / "generation_config.json", {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]})
    _write_json(folder / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": PATCH,
        "temporal_patch_size": 2, "merge_size": MERGE, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True})


def write_text_gguf(folder: Path, path: Path, matrix_type: str = "F32") -> Path:
    """The image-text folder's text model as llama.cpp's converter writes it (qwen35, qwen3vl, qwen3vlmoe: with the
    tower's DeepStack layer count, the experts stacked per projection), through a text-only copy of the folder."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = path.parent / (path.stem + "-text")
    text.mkdir()
    deepstack = len(cfg["vision_config"].get("deepstack_visual_indexes") or [])
    _write_json(text / "config.json", {**cfg["text_config"], "vision_deepstack_layers": deepstack,
                                       "tie_word_embeddings": cfg.get("tie_word_embeddings", False)})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (text / name).write_bytes((folder / name).read_bytes())
    tensors = {}
    for name, t in load_file(folder / "model.safetensors").items():
        name = name.replace("model.language_model.", "model.", 1)
        if name.endswith(".experts.gate_up_proj"):  # transformers 5's fused experts, per expert as the writer takes them
            for e, (gate, up) in enumerate(zip(*t.chunk(2, 1), strict=True)):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith(".experts.down_proj"):
            tensors.update({name.replace("down_proj", f"{e}.down_proj.weight"): d for e, d in enumerate(t)})
        elif not name.startswith("model.visual."):
            tensors[name] = t
    save_file(tensors, text / "model.safetensors")
    return write_tiny_gguf(text, path, matrix_type)


def write_mmproj(folder: Path, path: Path, drop: tuple[str, ...] = ()) -> Path:
    """The folder's tower as llama.cpp's converter (Qwen3VLVisionModel) writes an mmproj GGUF: projector
    qwen3vl_merger, the patch embedding split by frame, the merger as v.post_ln / mm.0 / mm.2, the DeepStack mergers
    as v.deepstack.<block>.* with a flag per block; names from the gguf package's own map. The processor's pixel
    bounds go in as image_min_pixels / image_max_pixels. `drop`: tensors (GGUF names) left out."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    pre = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision, text = cfg["vision_config"], cfg["text_config"]
    deepstack = list(vision.get("deepstack_visual_indexes") or [])
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    w.add_vision_projection_dim(text["hidden_size"])
    w.add_vision_image_size(int(vision["num_position_embeddings"] ** 0.5 * vision["patch_size"]))
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["depth"])
    w.add_vision_head_count(vision["num_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_MIN_PIXELS, pre["size"]["shortest_edge"])
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_MAX_PIXELS, pre["size"]["longest_edge"])
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    w.add_vision_attention_layernorm_eps(text["rms_norm_eps"])
    if deepstack:
        w.add_vision_is_deepstack_layers([i in deepstack for i in range(vision["depth"])])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        if not name.startswith("model.visual."):
            continue
        name = name.replace("model.visual.", "visual.", 1)
        t = tensor.float()
        if name == "visual.patch_embed.proj.weight":
            out = [("v.patch_embd.weight", t[:, :, 0]), ("v.patch_embd.weight.1", t[:, :, 1])]
        elif name.startswith("visual.deepstack_merger_list."):
            _, _, k, module, leaf = name.split(".")
            kind = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}[module]
            out = [(f"v.deepstack.{deepstack[int(k)]}.{kind}.{leaf}", t)]
        elif name.startswith("visual.merger."):
            module, leaf = name.split(".")[2:]
            out = [({"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[module] + "." + leaf, t)]
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            out = [(gguf_name, t)]
        for gguf_name, data in out:
            if gguf_name not in drop:
                w.add_tensor(gguf_name, np.ascontiguousarray(data.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
