"""Tiny random-weight models in Hugging Face layout, written with transformers' own classes (the reference).

Each folder holds config.json, safetensors weights, tokenizer.json (a byte-level BPE trained here on inline text),
tokenizer_config.json (with a chat template) and generation_config.json, like a real hub snapshot.
Weights are random but not HF's init: norms and biases are perturbed too, so every parameter matters to the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged cache stores keys and values in fixed-size blocks.
What is the capital of France? The capital of France is Paris. Berlin is the capital of Germany.
Hello, world! How are you today? I am fine, thank you. Let us write some code together.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)
Large language models predict the next token. Tokens are pieces of words, numbers 0123456789 and symbols {}[]();:.
Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, \U0001F600 emoji and other unicode text should round-trip through the tokenizer.
"""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHATML_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MODEL_VOCAB = 640  # >= the trained tokenizer's size, like real models whose embedding is padded


def train_tokenizer(specials: list[str], add_bos: str | None, vocab_size: int = 600):
    """A byte-level BPE trained in memory; special tokens get ids 0..len(specials)-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id(add_bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{add_bos} $A", pair=f"{add_bos} $A {add_bos} $B", special_tokens=[(add_bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def _randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)


def write_tiny_model(folder: Path, kind: str, seed: int = 0, sliding_window: int | None = None) -> Path:
    """kind: llama | llama3_rope | qwen2 | qwen3 | mistral (sliding_window: its window on every layer; None: full
    attention; qwen2: on its second layer only). Returns the folder."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    is_qwen = kind.startswith("qwen")
    specials = QWEN_SPECIALS if is_qwen else LLAMA_SPECIALS
    tok = train_tokenizer(specials, add_bos=None if is_qwen else "<|begin_of_text|>")
    ids = {t: tok.token_to_id(t) for t in specials}
    if is_qwen:
        bos, eos, pad = None, ids["<|im_end|>"], ids["<|endoftext|>"]
        gen_eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        tok_cfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML_TEMPLATE}
    else:
        bos, eos, pad = ids["<|begin_of_text|>"], ids["<|eot_id|>"], None
        gen_eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        tok_cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}

    common = dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )
    if kind == "llama":
        config = tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3_rope":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
        config = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**common, rope_theta=10000.0, sliding_window=sliding_window,
                                  tie_word_embeddings=False)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        # with a window: layer 0 global, layer 1 within the window (max_window_layers), a mixed model
        window = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1) \
            if sliding_window else dict(use_sliding_window=False)
        config = tf.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True, **window)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)

    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise(model)
    # qwen3 is written sharded (with model.safetensors.index.json) to cover that loading path.
    model.save_pretrained(folder, max_shard_size="200KB" if kind == "qwen3" else "50GB")

    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "clean_up_tokenization_spaces": False, **tok_cfg,
    })
    gen = {"eos_token_id": gen_eos}
    if bos is not None:
        gen["bos_token_id"] = bos
    _write_json(folder / "generation_config.json", gen)
    # transformers may impose its own conventions for a model type (Qwen2Tokenizer swaps in Qwen's pre-tokenizer
    # regex); store what transformers actually uses, so tokenizer.json and the reference agree by construction.
    tf.AutoTokenizer.from_pretrained(folder).backend_tokenizer.save(str(folder / "tokenizer.json"))
    return folder


TINY_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3", "mistral")
