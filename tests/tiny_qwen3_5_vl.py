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
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import MODEL_VOCAB, _randomise, _write_json, train_tokenizer

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
