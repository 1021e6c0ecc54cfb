"""Tiny random-weight Gemma 2 and Gemma 3 text models: Hugging Face folders written by transformers' own classes, and
GGUF files of the same weights written with the `gguf` package as llama.cpp's converter would (norms stored as
1 + weight, q/k rows unpermuted, a SentencePiece-style vocabulary).

The windows are small (8 and 16 tokens) so that short test contexts reach well past them; the soft-caps of the Gemma 2
model are small enough to bite on random weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny_models import MODEL_VOCAB, _randomise, _write_json, train_tokenizer

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_KINDS = ("gemma2", "gemma3")
WINDOWS = {"gemma2": 8, "gemma3": 16}
# the GGUF variant needs head_dim == query_pre_attn_scalar: transformers' GGUF loader takes Gemma's default
# query_pre_attn_scalar (256), llama.cpp (and llmd) head_dim; the HF folders use a scalar of their own
GGUF_HEAD_DIM = 256


def _config(kind: str, for_gguf: bool):
    import transformers as tf

    head_dim = GGUF_HEAD_DIM if for_gguf else 16
    common = dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, sliding_window=WINDOWS[kind], tie_word_embeddings=True,
        query_pre_attn_scalar=256 if for_gguf else 24, attn_implementation="eager",
    )
    if kind == "gemma2":
        return tf.Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=50.0 if for_gguf else 2.0,
                               final_logit_softcapping=30.0 if for_gguf else 3.0,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), tf.Gemma2ForCausalLM
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    if not for_gguf:  # global layers with linear scaling, as on Gemma 3 4B and larger
        rope["full_attention"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}
    return tf.Gemma3TextConfig(**common, num_hidden_layers=7, rope_parameters=rope), tf.Gemma3ForCausalLM


def _model(kind: str, seed: int, for_gguf: bool):
    config, cls = _config(kind, for_gguf)
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise(model)
    with torch.no_grad():  # Gemma norms multiply by 1 + weight: centre them on 0, not 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return model


def write_tiny_gemma(folder: Path, kind: str, seed: int = 0) -> Path:
    """A Hugging Face folder (config.json, safetensors, tokenizer files) of a random `kind` model."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    _model(kind, seed, for_gguf=False).save_pretrained(folder)
    tok = train_tokenizer(GEMMA_SPECIALS, add_bos="<bos>")
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
    })
    _write_json(folder / "generation_config.json", {"bos_token_id": 2, "eos_token_id": 1})
    tf.AutoTokenizer.from_pretrained(folder).backend_tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# Hugging Face layer names -> llama.cpp's, for gemma2 / gemma3
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, index, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{index}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def write_tiny_gemma_gguf(path: Path, kind: str, seed: int = 0) -> Path:
    """A gemma2 / gemma3 GGUF (fp32 tensors) of a random model with head_dim 256, as llama.cpp's converter writes it."""
    import gguf

    model = _model(kind, seed, for_gguf=True)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), kind)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(1_000_000.0)
    tokens = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(MODEL_VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(GEMMA_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(tokens) - 262)])
    w.add_token_types([3] * len(GEMMA_SPECIALS) + [6] * 256 + [1] * (len(tokens) - 262))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        data = tensor.detach().float()
        if name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's converter stores the multiplier 1 + weight
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(data.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
