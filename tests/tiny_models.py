"""Tiny random-weight models in Hugging Face layout, written with transformers' own classes (the reference).

Each folder holds config.json, safetensors weights, tokenizer.json (a byte-level BPE trained here on inline text;
Gemma 4's kind of BPE for its variants), tokenizer_config.json (with a chat template) and generation_config.json, like
a real hub snapshot.
Weights are random but not HF's init: norms and biases are perturbed too, so every parameter matters to the logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
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

GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
GEMMA4_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|turn>' + message['role'] + '\\n' + message['content'] | trim + '<turn|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)

FULL_ATTN = "full_attention"
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


def train_gemma4_tokenizer(vocab_size: int = 600):
    """A Gemma 4-style tokenizer (what llama.cpp's "gemma4" vocabulary model reads): BPE over whole characters with
    spaces written '▁' (no byte alphabet), the text cut into runs of newlines and of anything else, `<0xNN>` tokens
    for the bytes of what no token spells; ids: the specials, the 256 byte tokens, then the trained ones."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    def dress(tok):
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        return tok

    trained = dress(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=GEMMA4_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])
    trained.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    model = json.loads(trained.to_str())["model"]  # the byte tokens as plain vocabulary entries, as Gemma's are
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = dress(Tokenizer(models.BPE(vocab=model["vocab"], merges=merges, byte_fallback=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def _randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith((".bias", "_bias", ".sinks")):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's expert selection bias
                b.normal_(0.0, 0.1)


def write_tiny_model(folder: Path, kind: str, seed: int = 0, sliding_window: int | None = None) -> Path:
    """kind: one of TINY_KINDS (sliding_window, for mistral and qwen2: mistral's window on every layer, qwen2's on
    its second layer only; None: full attention). Returns the folder."""
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
    if kind.startswith("gemma4"):  # Gemma 4's own kind of vocabulary (a GGUF's "gemma4" tokenizer model)
        tok = train_gemma4_tokenizer()
        ids = {t: tok.token_to_id(t) for t in GEMMA4_SPECIALS}
        bos, eos, pad = ids["<bos>"], ids["<turn|>"], ids["<pad>"]
        gen_eos = [ids["<eos>"], ids["<turn|>"]]
        tok_cfg = {"bos_token": "<bos>", "eos_token": "<turn|>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "chat_template": GEMMA4_TEMPLATE}

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
    elif kind == "qwen2_yarn":  # Qwen2.5's long-context setting as its README gives it, over a 32-token context
        scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        config = tf.Qwen2Config(**common, rope_theta=1000000.0, rope_scaling=scaling, tie_word_embeddings=True,
                                use_sliding_window=False)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3_yarn":  # transformers >= 5's rope_parameters, every YaRN key given, a ramp over 3 dimensions
        scaling = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                   "beta_fast": 4.0, "beta_slow": 0.5, "attention_factor": 1.25}
        config = tf.Qwen3Config(**common, head_dim=16, rope_parameters=scaling, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    elif kind == "phi3":  # Phi-3-mini 4k / Phi-4: fused qkv_proj and gate_up_proj, plain RoPE
        config = tf.Phi3Config(**common, rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False)
        cls = tf.Phi3ForCausalLM
    elif kind == "phi3_longrope":  # Phi-3.5-mini / Phi-4-mini: longrope past a 32-token "pretraining" context,
        # partial rotary (0.75 of each 16-wide head), tied embeddings like Phi-4-mini
        scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 3.0],
                   "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]}
        config = tf.Phi3Config(**common, rope_theta=10000.0, rope_scaling=scaling, partial_rotary_factor=0.75,
                               original_max_position_embeddings=32, sliding_window=None, tie_word_embeddings=True)
        cls = tf.Phi3ForCausalLM
    elif kind == "qwen3_moe":  # 8 experts, top 2, renormalised; q/k norm; layer 1 dense (mlp_only_layers)
        config = tf.Qwen3MoeConfig(**common, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, mlp_only_layers=[1])
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":  # a shared expert behind a sigmoid gate; top-k weights not renormalised
        config = tf.Qwen2MoeConfig(**common, rope_theta=1000000.0, tie_word_embeddings=True, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, norm_topk_prob=False)
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "mixtral":
        config = tf.MixtralConfig(**common, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2,
                                  sliding_window=sliding_window, tie_word_embeddings=False)
        cls = tf.MixtralForCausalLM
    elif kind == "glm4_moe":  # sigmoid scores + a selection bias, 2 groups keeping 1, shared expert, layer 0 dense,
        # partial rotary (0.5), q/k/v bias, q/k norm
        config = tf.Glm4MoeConfig(**common, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False,
                                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                                  use_qk_norm=True)
        cls = tf.Glm4MoeForCausalLM
    elif kind == "gpt_oss":  # windows of 8 on even layers, YaRN past 64 positions, sinks, biased router/experts
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
        config = tf.GptOssConfig(**{**common, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=8, rope_parameters=rope,
                                 tie_word_embeddings=False)
        cls = tf.GptOssForCausalLM
    elif kind.startswith("gemma4"):
        config = tf.Gemma4TextConfig(**common | (GEMMA4_VARIANTS | GEMMA4_STACK_VARIANTS)[kind], head_dim=16,
                                     sliding_window=8, global_head_dim=32)
        cls = tf.Gemma4ForCausalLM
    elif kind == "qwen3_5":  # Gated DeltaNet layers 0-2 (2 q/k heads serving 4 value heads), gated attention on 3
        config = tf.Qwen3_5TextConfig(**common | {"num_hidden_layers": 4}, head_dim=16, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                      tie_word_embeddings=False)
        cls = tf.Qwen3_5ForCausalLM
    elif kind == "qwen3_5_moe":  # the same layers, each MLP 8 experts (top 2) and a gated shared expert
        moe = {k: v for k, v in common.items() if k != "intermediate_size"} | {"num_hidden_layers": 4}
        config = tf.Qwen3_5MoeTextConfig(**moe, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                         linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, tie_word_embeddings=False)
        cls = tf.Qwen3_5MoeForCausalLM
    elif kind.startswith("qwen3_next"):  # Qwen3.5-MoE's shape with fused linear-attention projections; qwen3_next:
        # layer 1's MLP dense, qwen3_next_sparse: every MLP the MoE block (as llama.cpp's qwen3next has it)
        config = tf.Qwen3NextConfig(**common | {"num_hidden_layers": 4}, head_dim=16, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, tie_word_embeddings=False,
                                    mlp_only_layers=[1] if kind == "qwen3_next" else [])
        cls = tf.Qwen3NextForCausalLM
    elif kind.startswith("granite_hybrid"):  # Mamba2 layers 0 and 2 (8 heads in 2 groups), attention on 1;
        # granite_hybrid: Granite 4.0-H's shape, no positions and 4 experts (top 2) beside the shared MLP;
        # granite_hybrid_dense: RoPE, one group, the shared MLP alone, tied embeddings
        dense = kind == "granite_hybrid_dense"
        config = tf.GraniteMoeHybridConfig(
            **common | {"num_hidden_layers": 3}, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=1 if dense else 2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            num_local_experts=0 if dense else 4, num_experts_per_tok=2, shared_intermediate_size=96,
            embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=4.0,
            position_embedding_type="rope" if dense else "nope", tie_word_embeddings=dense,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = tf.GraniteMoeHybridForCausalLM
    elif kind == "nemotron_h":  # Mamba2 (8 heads in 2 groups), attention, a squared-ReLU MLP, Mamba2
        config = tf.NemotronHConfig(**common, hybrid_override_pattern="M*-M", head_dim=16, mamba_num_heads=8,
                                    mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4,
                                    tie_word_embeddings=False)
        cls = tf.NemotronHForCausalLM
    elif kind.startswith("nemotron_h_moe"):  # Mamba2, experts, attention, experts, Mamba2; 8 squared-ReLU experts
        # (sigmoid router with its selection bias, renormalised, scaled) beside a shared expert. nemotron_h_moe:
        # Nemotron 3 Nano's shape (top 2, one group); nemotron_h_moe_latent: Super's (experts in a 32-wide latent
        # space), top 3 in the best of 2 groups
        latent = kind == "nemotron_h_moe_latent"
        config = tf.NemotronHConfig(**common, hybrid_override_pattern="ME*EM", head_dim=16, mamba_num_heads=8,
                                    mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4,
                                    n_routed_experts=8, num_experts_per_tok=3 if latent else 2,
                                    moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
                                    moe_latent_size=32 if latent else None, n_group=2 if latent else 1, topk_group=1,
                                    routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
        cls = tf.NemotronHForCausalLM
    else:
        raise ValueError(kind)

    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise(model)
    if kind.startswith("gemma4"):  # its learned scalars too (layer_scalar is a buffer in transformers)
        with torch.no_grad():
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                    p.normal_(1.0, 0.1)
    if kind.startswith(("qwen3_5", "qwen3_next")):
        # their RMSNorms scale by 1 + weight (but the gated norm by weight): keep them near 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and ".linear_attn." not in name:
                    p.normal_(0.0, 0.1)
    if kind in MAMBA2_KINDS:  # A = -exp(A_log) and the D skip away from their init values, per head
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith((".A_log", ".D")):
                    p.add_(torch.randn_like(p) * 0.3)
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


TINY_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope")
MOE_KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")  # written by tests/test_moe.py's own fixture
MAMBA2_KINDS = ("granite_hybrid", "granite_hybrid_dense", "nemotron_h", "nemotron_h_moe",
                "nemotron_h_moe_latent")  # written by tests/test_mamba2.py
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe") + MAMBA2_KINDS  # written by their tests' own fixtures


def add_mtp_head(folder: Path, seed: int = 0) -> None:
    """Give a tiny Qwen3.5 folder (write_tiny_model) a random multi-token-prediction head, as Qwen3.5's checkpoints
    ship one: `mtp.fc` [H, 2H], its two pre-fc norms, one decoder layer shaped like the folder's full-attention
    layers (a copy of one, perturbed), `mtp.norm`."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    cfg = json.loads((folder / "config.json").read_text())
    h = cfg["hidden_size"]
    prefix = f"model.layers.{cfg['layer_types'].index('full_attention')}."
    g = torch.Generator().manual_seed(seed)
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            tensors["mtp.layers.0." + name[len(prefix):]] = t + 0.02 * torch.randn(t.shape, generator=g)
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) / math.sqrt(2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=g)  # scales by 1 + weight, near 1
    save_file(tensors, path, metadata={"format": "pt"})
_G4_TYPES = ["sliding_attention", "full_attention"] * 2
GEMMA4_VARIANTS = {  # written by tests/test_gemma4.py's own fixture
    # E2B/E4B-like: per-layer embeddings (16 per layer: the table's rows are whole Q8_0 blocks), the last two layers
    # sharing K/V (one of each kind), double-wide MLPs there; as on the real ones, the last layer with K/V of its own
    # is a full one and the one before it sliding (which llama.cpp assumes: it reuses those two)
    "gemma4_e": dict(num_hidden_layers=6,
                     layer_types=["sliding_attention"] * 3 + [FULL_ATTN, "sliding_attention", FULL_ATTN],
                     hidden_size_per_layer_input=16, vocab_size_per_layer_input=MODEL_VOCAB,
                     num_kv_shared_layers=2, use_double_wide_mlp=True),
    # 31B-like: global layers with V taken from K and one KV head, final logit soft-cap
    "gemma4_dense": dict(num_hidden_layers=4, layer_types=_G4_TYPES, hidden_size_per_layer_input=0,
                         attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0),
    # 26B-A4B-like: an MoE block beside every MLP
    "gemma4_moe": dict(num_hidden_layers=4, layer_types=_G4_TYPES, hidden_size_per_layer_input=0,
                       enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                       attention_k_eq_v=True, num_global_key_value_heads=1),
}
# tests/test_cpu_stack.py's E-model: per-layer inputs 32 wide, so that int4-g32 and a Q8_0 file take its per-layer
# projection (K = 32) too, and the whole layer runs compiled
GEMMA4_STACK_VARIANTS = {"gemma4_e32": GEMMA4_VARIANTS["gemma4_e"] | dict(hidden_size_per_layer_input=32)}
YARN_KINDS = ("qwen2_yarn", "qwen3_yarn")  # written by the tests that use them (tests/test_families.py)


# ----------------------------------------------------------------------------------------------------------------
# The same models as llama.cpp GGUF files, converted as llama.cpp's convert_hf_to_gguf.py converts them (tensor
# names and metadata keys from the gguf package's constants; the llama q/k row permutation; Llama 3's rope_freqs and
# Phi-3's rope factor tensors; YaRN's rope.scaling keys; Qwen3.5's Gated DeltaNet tensors, transformed and named as
# its Qwen3_5TextModel converter does, and Qwen3-Next's as its Qwen3NextModel does, names from the gguf package's own
# tensor map). The vocabulary is the folder's byte-level BPE as a "gpt2" tokenizer model.

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe",
             "gpt_oss": "gpt-oss", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
             "granitemoehybrid": "granitehybrid", "gemma4_text": "gemma4",  # (gemma4: write_gemma4_gguf)
             "qwen3_vl_text": "qwen3vl", "qwen3_vl_moe_text": "qwen3vlmoe",  # (tiny_qwen3_5_vl.write_text_gguf)
             "nemotron_h": "nemotron_h"}  # (_write_nemotron_h: nemotron_h_moe where the pattern has experts)
QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj.",
                  ".shared_experts.": ".shared_expert."}  # (and GLM's shared_experts)
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str, arch: str = "") -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    if hf_name.endswith("mlp.gate.e_score_correction_bias"):
        return f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"
    if hf_name.endswith(".self_attn.sinks"):
        return f"blk.{hf_name.split('.')[2]}.attn_sinks.weight"
    if arch in ("glm4moe", "gpt-oss") and ".post_attention_layernorm." in hf_name:
        return f"blk.{hf_name.split('.')[2]}.post_attention_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{suffix}"


def _tiled(t: torch.Tensor, dim: int, width: int, cfg: dict, back: bool = False) -> torch.Tensor:
    """Value heads (each `width` wide along `dim`) from grouped by key head (Hugging Face's order) to tiled (value
    head j serving key head j % Hk, llama.cpp's), or `back`."""
    shape, hk = list(t.shape), cfg["linear_num_key_heads"]
    groups = (cfg["linear_num_value_heads"] // hk, hk) if back else (hk, cfg["linear_num_value_heads"] // hk)
    return t.reshape(*shape[:dim], *groups, width, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def qwen3next_qkvz(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """convert_hf_to_gguf's Qwen3NextModel split of in_proj_qkvz (per key head: q, k, the head's v rows, its z rows)
    into in_proj_qkv (every q, every k, every v) and in_proj_z; in_proj_ba left as it is."""
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vz = cfg["linear_num_value_heads"] // hk * cfg["linear_value_head_dim"]
    out = {}
    for name, t in state.items():
        if name.endswith(".in_proj_qkvz.weight"):
            per_head = t.T.reshape(t.shape[1], hk, 2 * dk + 2 * vz)
            q, k, v, z = (part.reshape(t.shape[1], -1) for part in per_head.split([dk, dk, vz, vz], dim=-1))
            out[name.replace("_qkvz.", "_qkv.")] = torch.cat([q, k, v], dim=-1).T.contiguous()
            out[name.replace("_qkvz.", "_z.")] = z.T.contiguous()
        else:
            out[name] = t
    return out


def qwen35_tensors(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """convert_hf_to_gguf's Qwen3.5 transforms, names left as Hugging Face's: where value heads outnumber key heads,
    the value heads reordered from grouped by key head to tiled (attn_qkv's value rows, z, a, b, A_log, dt_bias, the
    conv's value channels, out_proj's columns; not for Qwen3-Next); A_log stored as A = -exp(A_log); the conv weight
    squeezed to [channels, kernel]; every norm but the gated one (linear_attn.norm) stored as 1 + weight."""
    qk, dv = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    tiled = cfg["model_type"] != "qwen3_next"
    out = {}
    for name, t in state.items():
        if ".linear_attn." in name and tiled:
            if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
                t = torch.cat([t[:qk], _tiled(t[qk:], 0, dv, cfg)])
            elif name.endswith(".in_proj_z.weight"):
                t = _tiled(t, 0, dv, cfg)
            elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
                t = _tiled(t, 0, 1, cfg)
            elif name.endswith(".out_proj.weight"):
                t = _tiled(t, 1, dv, cfg)
        if name.endswith(".A_log"):
            t = -torch.exp(t.float())
        elif name.endswith(".conv1d.weight"):
            t = t.squeeze(1)
        elif name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
            t = t.float() + 1
        out[name] = t
    return out


def qwen35_name(cfg: dict):
    """HF name -> the GGUF name llama.cpp's converter gives it: the gguf package's tensor map for the architecture,
    after the converter's rename of dt_bias to dt_proj.bias."""
    import gguf

    arch = {"qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}.get(
        cfg["model_type"], gguf.MODEL_ARCH.QWEN35)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])

    def name(hf: str) -> str:
        hf = hf.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")
        out = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert out is not None, hf
        return out
    return name


def _qwen35_metadata(w, cfg: dict) -> None:
    """What Qwen3NextModel and the Qwen3.5 mixins add to the common keys."""
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    if cfg["model_type"] == "qwen3_next":
        return
    sections = list((cfg.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10])
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))  # padded to 4, as llama.cpp reads it


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves interleaved for llama.cpp's RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg: dict, scaling: dict, theta: float, head_dim: int) -> list[float]:
    """convert_hf_to_gguf's rope_freqs for llama3 scaling: one divisor per frequency."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _stacked_experts(w, state: dict[str, torch.Tensor], cfg: dict, experts: int) -> dict[str, torch.Tensor]:
    """The family's own MoE metadata (gguf_hparams writes the common keys), and each layer's per-expert projections
    stacked [E, out, in] as llama.cpp's ffn_*_exps."""
    import gguf

    if cfg["model_type"] == "glm4_moe":  # and one multi-token-prediction layer after the decoder, as GLM files have
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_nextn_predict_layers(1)
        mtp = f"blk.{cfg['num_hidden_layers']}"
        w.add_tensor(f"{mtp}.nextn.eh_proj.weight", np.zeros((cfg["hidden_size"], 2 * cfg["hidden_size"]), np.float32))
        w.add_tensor(f"{mtp}.nextn.enorm.weight", np.ones(cfg["hidden_size"], np.float32))
    if cfg["model_type"] == "gpt_oss":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        return _gpt_oss_experts(state)
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        for old, new in _MIXTRAL_NAMES.items():
            name = name.replace(old, new)
        head, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = tensor
            continue
        index, _, proj = rest.partition(".")
        stacks.setdefault(f"{head}.experts.{proj}", {})[int(index)] = tensor
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in range(experts)])
    return out


def _gpt_oss_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as llama.cpp's converter writes them: gate_up_proj [E, hidden, 2I] (gate and up interleaved)
    split into ffn_gate_exps / ffn_up_exps [E, I, hidden], down_proj [E, I, hidden] as [E, hidden, I]; the router is
    ffn_gate_inp."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        head, sep, proj = name.partition(".mlp.experts.")
        if name.endswith(".mlp.router.weight") or name.endswith(".mlp.router.bias"):
            out[name.replace(".router.", ".gate.")] = t
        elif not sep:
            out[name] = t
        elif proj == "gate_up_proj":
            out[f"{head}.mlp.experts.gate_proj.weight"] = t[..., 0::2].transpose(1, 2).contiguous()
            out[f"{head}.mlp.experts.up_proj.weight"] = t[..., 1::2].transpose(1, 2).contiguous()
        elif proj == "gate_up_proj_bias":
            out[f"{head}.mlp.experts.gate_proj.bias"] = t[:, 0::2].contiguous()
            out[f"{head}.mlp.experts.up_proj.bias"] = t[:, 1::2].contiguous()
        elif proj == "down_proj":
            out[f"{head}.mlp.experts.down_proj.weight"] = t.transpose(1, 2).contiguous()
        else:  # down_proj_bias
            out[f"{head}.mlp.experts.down_proj.bias"] = t
    return out


def _gguf_vocabulary(w, folder: Path, cfg: dict, arch: str) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tok["model"]["vocab"])
    specials = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        specials.add(added["content"])
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    tokens += [f"<|unused_{i}|>" for i in range(len(tokens), cfg["vocab_size"])]  # the padded embedding rows
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.UNUSED if t.startswith("<|unused_")
             else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    eos = cfg["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(cfg.get("bos_token_id") is not None)


def gguf_matrix(name: str, t: torch.Tensor) -> bool:
    """Whether write_tiny_gguf stores this tensor in its matrix type (else F32: vectors, routers, conv kernels)."""
    return t.ndim >= 2 and not name.endswith(("mlp.gate.weight", "conv1d.weight", "shared_expert_gate.weight"))


def round_to_gguf(folder: Path, out: Path, matrix_type: str) -> Path:
    """A copy of the HF folder whose matrices hold what a `matrix_type` GGUF file written from it holds (each rounded
    through the type as laid out in the file: Qwen3.5's out_proj with its value heads tiled), so transformers on the
    copy is the reference for the logits of the `matrix_type` file written from the folder."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    qtype = gguf.GGMLQuantizationType[matrix_type]
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    hybrid = GGUF_ARCH.get(cfg["model_type"]) in ("qwen35", "qwen35moe")  # (Qwen3-Next's value heads stay put)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    for file in sorted(out.glob("*.safetensors")):
        state = load_file(file)
        for name, t in state.items():
            if not gguf_matrix(name, t):
                continue
            cols = hybrid and name.endswith(".linear_attn.out_proj.weight")  # its value heads tiled in the file
            data = (_tiled(t, 1, cfg["linear_value_head_dim"], cfg) if cols else t).float().numpy()
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).reshape(data.shape))
            state[name] = (_tiled(w, 1, cfg["linear_value_head_dim"], cfg, back=True) if cols else w).to(t.dtype)
        save_file(state, file, metadata={"format": "pt"})
    return out


def _granite_hybrid_tensors(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Granite 4's tensors under llama.cpp's granitehybrid names, changed as its converter changes them: A_log as
    ssm_a = -exp(A_log) [heads, 1], D as [heads, 1], the conv squeezed, the gated norm as [groups, inner / groups],
    input_linear split into gate and up, q/k permuted as for llama."""
    experts = bool(cfg.get("num_local_experts"))
    shared = "shexp" if experts else ""
    mlp = {"shared_mlp.output_linear": f"ffn_down{'_' + shared if shared else ''}",
           "block_sparse_moe.output_linear": "ffn_down_exps", "block_sparse_moe.router.layer": "ffn_gate_inp",
           "mamba.in_proj": "ssm_in", "mamba.out_proj": "ssm_out", "mamba.conv1d": "ssm_conv1d",
           "mamba.norm": "ssm_norm", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           **{f"self_attn.{p}_proj": f"attn_{p}" for p in "qkv"}, "self_attn.o_proj": "attn_output"}
    groups = cfg["mamba_n_groups"]
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in _GGUF_GLOBAL:
            out[_GGUF_GLOBAL[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        blk, (module, _, suffix) = f"blk.{layer}", rest.rpartition(".")
        if rest.endswith("input_linear.weight"):  # gate rows, then up rows
            gate, up = t.chunk(2, dim=-2)
            kind = "exps" if module.startswith("block_sparse_moe") else shared
            out[f"{blk}.ffn_gate{'_' + kind if kind else ''}.weight"] = gate
            out[f"{blk}.ffn_up{'_' + kind if kind else ''}.weight"] = up
        elif rest in ("mamba.A_log", "mamba.D", "mamba.dt_bias"):
            gguf_name = {"mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.dt_bias": "ssm_dt.bias"}[rest]
            value = -t.exp() if rest == "mamba.A_log" else t
            out[f"{blk}.{gguf_name}"] = value if rest == "mamba.dt_bias" else value.reshape(-1, 1)
        else:
            if module == "mamba.conv1d" and suffix == "weight":
                t = t.squeeze(1)
            elif module == "mamba.norm":
                t = t.reshape(groups, -1)
            elif module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _llama_cpp_permute(t, cfg["num_attention_heads"] if "q_proj" in module
                                       else cfg["num_key_value_heads"])
            out[f"{blk}.{mlp[module]}.{suffix}"] = t
    return out


def _write_granite_hybrid(w, folder: Path, cfg: dict, path: Path, matrix_type: str) -> Path:
    """The granitehybrid metadata and tensors (see _granite_hybrid_tensors); matrices as `matrix_type`, but the conv,
    norms, router and the suffix-less ssm_a / ssm_d in F32, as llama.cpp's converter keeps them. rope.scaling.finetuned
    says whether the attention turns by RoPE (llama.cpp's converter writes false for every hybrid, which is right for
    the released Granite 4.0-H models: they have no positions)."""
    import gguf
    from safetensors.torch import load_file

    kv = cfg["num_key_value_heads"]  # (and 0 on the Mamba2 layers: the writer's key overwritten, as llama.cpp's)
    w.add_head_count_kv([kv if t == "full_attention" else 0 for t in cfg["layer_types"]])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_n_heads"] * cfg["mamba_d_head"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_rope_scaling_finetuned(cfg["position_embedding_type"] == "rope")
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])  # (gguf_hparams: the experts' keys)
    state = load_file(folder / "model.safetensors")
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, t in _granite_hybrid_tensors(state, cfg).items():
        data = t.float().numpy()
        keep = data.ndim < 2 or not name.endswith(".weight") or name.endswith(("_norm.weight", "ssm_conv1d.weight",
                                                                              "ffn_gate_inp.weight"))
        if keep or matrix_type == "F32":
            w.add_tensor(name, data)
        elif matrix_type == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_nemotron_h(folder: Path, path: Path, cfg: dict, matrix_type: str) -> Path:
    """Nemotron-H as llama.cpp's converter (NemotronHModel) writes it: `nemotron_h_moe` where the pattern has experts,
    else `nemotron_h`; the layer kinds as per-layer head_count_kv and feed_forward_length arrays, the Mamba2 sizes and
    transforms as Granite's (A as -exp(A_log) [heads, 1], D [heads, 1], the conv squeezed, the norm by group), q/k
    permuted as for llama, the experts stacked (ffn_up_exps, ffn_down_exps), the expert keys it writes (no group
    count kept: expert_group_used_count is written only where `cfg` has several groups, which the converter does not
    do); names from the gguf package's tensor map. Matrices as `matrix_type`, the rest F32."""
    import gguf
    from safetensors.torch import load_file

    types = cfg["layers_block_type"]
    moe = "moe" in types
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    layers, heads, kv = len(types), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    common = {k: v for k, v in cfg.items() if k not in ("n_routed_experts", "num_experts_per_tok")}
    gguf_hparams(w, {**common, "num_hidden_layers": layers, "rms_norm_eps": cfg["layer_norm_epsilon"]}, arch)
    _gguf_vocabulary(w, folder, cfg, arch)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_head_count_kv([kv if t == "full_attention" else 0 for t in types])
    ffn = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]
    w.add_feed_forward_length([ffn if t in ("mlp", "moe") else 0 for t in types])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(cfg["n_groups"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    w.add_rope_scaling_finetuned(False)
    if moe:
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_group_count(cfg["n_group"])
        if cfg["n_group"] > 1:
            w.add_expert_group_used_count(cfg["topk_group"])
        if cfg.get("moe_latent_size"):
            w.add_moe_latent_size(cfg["moe_latent_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H, layers)
    state = load_file(folder / "model.safetensors")
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        head, sep, rest = name.partition(".mixer.experts.")
        if sep:  # backbone.layers.N.mixer.experts.E.up_proj.weight: stacked as the converter stacks them
            e, _, proj = rest.partition(".")
            stacks.setdefault(f"model.layers.{head.split('.')[2]}.mlp.experts.{proj}", {})[int(e)] = t
            continue
        t = t.float()
        if name.endswith(".A_log"):
            t = (-t.exp()).reshape(-1, 1)
        elif name.endswith(".mixer.D"):
            t = t.reshape(-1, 1)
        elif name.endswith(".conv1d.weight"):
            t = t.squeeze(1)
        elif name.endswith(".mixer.norm.weight"):
            t = t.reshape(cfg["n_groups"], -1)
        elif name.endswith((".q_proj.weight", ".k_proj.weight")):
            t = _llama_cpp_permute(t, heads if ".q_proj." in name else kv)
        name = name.replace(".dt_bias", ".dt.bias").replace("e_score_correction_bias", "e_score_correction.bias")
        tensors[name] = t
    for name, parts in stacks.items():
        tensors[name] = torch.stack([parts[e] for e in range(len(parts))]).float()
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, t in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = t.numpy()
        if data.ndim < 2 or matrix_type == "F32" or gguf_name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight",
                                                                        "_norm.weight", "ssm_a", "ssm_d")):
            w.add_tensor(gguf_name, data)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_hparams(w, cfg: dict, arch: str) -> None:
    """The hyperparameter keys convert_hf_to_gguf writes from a config.json (`cfg`) for `arch` (Qwen3.5's ssm keys and
    the common MoE keys included); the vocabulary, rope scaling, family-specific MoE keys and tensors are the
    caller's."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    w.add_block_count(cfg["num_hidden_layers"] + (arch == "glm4moe"))  # GLM counts its nextn layer
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:  # (Qwen3.5-MoE has none)
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(int(head_dim * partial))
    if arch in ("qwen3", "qwen3vl", "qwen3vlmoe", *QWEN35_ARCHS) or head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in QWEN35_ARCHS:
        _qwen35_metadata(w, cfg)
    if arch in ("qwen3vl", "qwen3vlmoe"):  # the sections padded to 4, and the tower's DeepStack layer count
        w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0] * (4 - len(rope["mrope_section"])))
        w.add_num_deepstack_layers(cfg["vision_deepstack_layers"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def llama_cpp_shape(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor as the converter shapes it: a shared expert's gate [1, hidden] as llama.cpp's ffn_gate_inp_shexp
    [hidden]; any other as it is."""
    return t.reshape(-1) if name.endswith("shared_expert_gate.weight") else t


def write_tiny_gguf(folder: Path, path: Path, matrix_type: str = "F32", chat_template: str | None = None) -> Path:
    """The HF folder's model as a GGUF file, as llama.cpp's converter writes it; matrices (2-D weights) as
    `matrix_type` (F32, F16, or a block type the gguf package quantizes: Q8_0, Q4_0, ...), the rest F32; with
    `chat_template`, tokenizer.chat_template (as the converter copies it from tokenizer_config.json)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if cfg["model_type"] == "gemma4_text":
        return write_gemma4_gguf(folder, path, matrix_type)
    if cfg["model_type"] == "nemotron_h":
        return _write_nemotron_h(folder, path, cfg, matrix_type)
    arch = GGUF_ARCH[cfg["model_type"]]
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_type = rope.get("rope_type") or rope.get("type") or "default"

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {cfg['model_type']}")
    gguf_hparams(w, cfg, arch)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    _gguf_vocabulary(w, folder, cfg, arch)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if arch == "granitehybrid":
        return _write_granite_hybrid(w, folder, cfg, path, matrix_type)

    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", np.asarray(_llama3_rope_factors(cfg, rope, theta, head_dim), np.float32))
    if rope_type == "longrope":
        original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if rope_type == "yarn":  # the keys convert_hf_to_gguf writes: those the config gives
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if arch == "qwen3next":
        state = qwen3next_qkvz(state, cfg)
    if arch in QWEN35_ARCHS:
        state = qwen35_tensors(state, cfg)
    if experts:
        state = _stacked_experts(w, state, cfg, experts)
    gguf_name = qwen35_name(cfg) if arch in QWEN35_ARCHS else (lambda name: gguf_tensor_name(name, arch))
    for name, tensor in state.items():
        t = tensor.float()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = _llama_cpp_permute(t, heads if ".q_proj." in name else kv_heads)
        data = llama_cpp_shape(name, t).numpy()
        if data.ndim >= 2 and not gguf_matrix(name, t):  # llama.cpp keeps routers and conv kernels F32
            w.add_tensor(gguf_name(name), data)
        elif data.ndim >= 2 and matrix_type == "F16":
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        elif data.ndim == 2 and matrix_type == "MXFP4":  # (the experts only, as gpt-oss's files have it)
            w.add_tensor(gguf_name(name), data)
        elif data.ndim >= 2 and matrix_type != "F32":
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Gemma 4 (llama.cpp's gemma4), as convert_hf_to_gguf's Gemma4Model writes it: the per-layer shapes as metadata
# arrays (sliding-window flags, KV heads, FFN widths), key_length for the full layers and key_length_swa for the
# sliding ones, the proportional RoPE as a rope_freqs tensor (1 where a frequency turns, 1e30 where it does not),
# norms unshifted, the experts' gate_up as one ffn_gate_up_exps tensor, the router's scales as `.scale` tensors.

_GEMMA4_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                  "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                  "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
_GEMMA4_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight", "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}


def gemma4_gguf_name(hf_name: str) -> str:
    if hf_name in _GEMMA4_GLOBAL:
        return _GEMMA4_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GEMMA4_LAYER[rest]}"


def _gemma4_tensor(w, name: str, data: np.ndarray, matrix_type: str) -> None:
    """One tensor as the converter stores it for an output type: vectors and the router in F32; a matrix whose rows
    are not whole blocks of the type falls back to F16, as the converter's quantizer does."""
    import gguf

    qtype = gguf.GGMLQuantizationType[matrix_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.ndim < 2 or name.endswith("ffn_gate_inp.weight") or matrix_type == "F32":
        w.add_tensor(name, data.astype(np.float32))
    elif matrix_type == "F16" or data.shape[-1] % block:
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _gemma4_shapes(cfg: dict) -> tuple[int, int, int, int | None]:
    """(the full layers' head size, the sliding layers', the sliding layers' KV heads, the full layers' or None)."""
    spec = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    full = next(i for i, t in enumerate(cfg["layer_types"]) if t == FULL_ATTN)
    return spec[full]["head_dim"], cfg["head_dim"], cfg["num_key_value_heads"], spec[full].get("num_key_value_heads")


def gemma4_hparams(w, cfg: dict) -> None:
    """The metadata convert_hf_to_gguf writes for a Gemma 4 config.json (as transformers completes it: its
    per_layer_config), the vocabulary aside."""
    layers, types = cfg["num_hidden_layers"], cfg["layer_types"]
    head_full, head_swa, kv_swa, kv_full = _gemma4_shapes(cfg)
    shared, ffn, rope = cfg["num_kv_shared_layers"], cfg["intermediate_size"], cfg["rope_parameters"]
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length([ffn * (2 if i >= layers - shared else 1) for i in range(layers)]
                              if cfg["use_double_wide_mlp"] else ffn)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([kv_swa if t != FULL_ATTN else kv_full for t in types] if kv_full else kv_swa)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    w.add_key_length_swa(head_swa)
    w.add_value_length_swa(head_swa)
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern([t != FULL_ATTN for t in types])
    w.add_rope_dimension_count(head_full)
    w.add_rope_dimension_count_swa(head_swa)


def gemma4_rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's rope_freqs tensor: 1 where a full layer's frequency turns, 1e30 where it does not."""
    head_full = _gemma4_shapes(cfg)[0]
    turning = int(head_full * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.asarray([1.0] * turning + [1e30] * (head_full // 2 - turning), np.float32)


def gemma4_unused_kv(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The k/v projections and k norms of the KV-sharing layers that hub checkpoints carry and nothing reads
    (Hugging Face name -> shape); the converter copies them."""
    layers, shared, hidden = cfg["num_hidden_layers"], cfg["num_kv_shared_layers"], cfg["hidden_size"]
    head_full, head_swa, kv_swa, kv_full = _gemma4_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers - shared, layers):
        full = cfg["layer_types"][i] == FULL_ATTN
        d, kv = (head_full, kv_full or kv_swa) if full else (head_swa, kv_swa)
        b = f"model.layers.{i}.self_attn."
        out |= {b + "k_proj.weight": (kv * d, hidden), b + "v_proj.weight": (kv * d, hidden), b + "k_norm.weight": (d,)}
    return out


def gemma4_vocabulary(w, folder: Path, cfg: dict) -> None:
    """The folder's tokenizer as the converter writes a Gemma 4 one: tokenizer model "gemma4", the tokens in id order
    (padded to the model's vocabulary with unused ones, as Gemma's own vocabulary fills its table), their types
    (specials control, <0xNN> byte), the merges, BOS added, no space prefix."""
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tok["model"]["vocab"])
    specials = {added["content"] for added in tok.get("added_tokens", [])}
    vocab |= {added["content"]: added["id"] for added in tok.get("added_tokens", [])}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.UNUSED if t.startswith("<unused")
             else gguf.TokenType.BYTE if len(t) == 6 and t.startswith("<0x") else gguf.TokenType.NORMAL
             for t in tokens]
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    if template:
        w.add_chat_template(template)


def write_gemma4_gguf(folder: Path, path: Path, matrix_type: str = "F32") -> Path:
    """The HF folder's Gemma 4 model as a gemma4 GGUF (see above), with random values for the KV-sharing layers'
    unused k/v (gemma4_unused_kv) as hub checkpoints have them."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("tiny gemma4")
    gemma4_hparams(w, cfg)
    gemma4_vocabulary(w, folder, cfg)
    w.add_tensor("rope_freqs.weight", gemma4_rope_freqs(cfg))
    state = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(0)
    for name, shape in gemma4_unused_kv(cfg).items():
        state[name] = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) if len(shape) > 1
                                       else np.ones(shape, np.float32))
    for name, tensor in state.items():
        _gemma4_tensor(w, gemma4_gguf_name(name), tensor.float().numpy(), matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------------------------------------------
# Gemma 3 image-text (Gemma3ForConditionalGeneration): a SigLIP tower and the multimodal projector beside the text
# model, written by transformers; and the tower as llama.cpp's converter writes it into an mmproj GGUF.

GEMMA3_VISION_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                          "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_IMAGE_TOKENS = 64, 8, 16
# not the processor's defaults (0.5), so that a loader that ignores preprocessor_config.json shows
GEMMA3_IMAGE_MEAN, GEMMA3_IMAGE_STD = [0.48, 0.45, 0.41], [0.27, 0.26, 0.28]
GEMMA3_TEMPLATE_FILE = Path(__file__).parent / "chat_templates" / "gemma-3-it.jinja"  # Gemma 3's own


def write_tiny_gemma3_vision(folder: Path, seed: int = 0) -> Path:
    """A Gemma3ForConditionalGeneration folder as transformers saves it: a 2-layer text model (one window layer,
    one global), a 2-layer SigLIP tower of 64x64 pixels in patches of 8, pooled to 16 image tokens; a tokenizer with
    Gemma 3's image specials and its chat template (an image part renders as <start_of_image>), the processor's
    files (preprocessor_config.json, processor_config.json). Returns the folder."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(GEMMA3_VISION_SPECIALS, add_bos="<bos>")
    ids = {t: tok.token_to_id(t) for t in GEMMA3_VISION_SPECIALS}
    text = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, sliding_window=16,
                layer_types=["sliding_attention", FULL_ATTN], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                pad_token_id=ids["<pad>"])
    vision = dict(image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, layer_norm_eps=1e-6, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                             boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                             image_token_index=ids["<image_soft_token>"], initializer_range=0.1)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    _randomise(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:  # Gemma's RMSNorms multiply by 1 + weight
                p.sub_(1.0)
            if "mm_input_projection" in name:  # zeros as initialised
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)

    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": GEMMA3_TEMPLATE_FILE.read_text(encoding="utf-8"),
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
    })
    _write_json(folder / "generation_config.json", {"bos_token_id": ids["<bos>"],
                                                    "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]})
    _write_json(folder / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}, "resample": 2, "rescale_factor": 1 / 255,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": None, "do_pan_and_scan": None,
        "image_mean": GEMMA3_IMAGE_MEAN, "image_std": GEMMA3_IMAGE_STD,
    })
    _write_json(folder / "processor_config.json", {"processor_class": "Gemma3Processor",
                                                   "image_seq_length": GEMMA3_IMAGE_TOKENS})
    return folder


def gemma3_mmproj_writer(path: Path, cfg: dict, pre: dict):
    """A gguf.GGUFWriter holding the keys llama.cpp's converter writes into a Gemma 3 mmproj GGUF, from a
    Gemma3ForConditionalGeneration config.json (`cfg`) and its preprocessor_config.json (`pre`); the tensors are
    the caller's to add."""
    import gguf

    vision = cfg["vision_config"]
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(vision["image_size"])
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    w.add_vision_use_gelu(True)
    scale = (vision["image_size"] // vision["patch_size"]) // int(cfg["mm_tokens_per_image"] ** 0.5)
    if scale != 4:  # as the converter: written only when not the default
        w.add_vision_projector_scale_factor(scale)
    return w


def gemma3_mmproj_name(names, hf_name: str) -> str | None:
    """The mmproj GGUF's name of a Gemma3ForConditionalGeneration tensor (None: not the tower's or the projector's),
    from the gguf package's tensor map `names` (gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, layers))."""
    name = hf_name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # the hub's names
    elif not name.startswith(("vision_tower.", "multi_modal_projector.")):
        return None
    return names.get_name(name.replace("_weight", ".weight"), try_suffixes=(".weight", ".bias"))


def write_tiny_gemma3_mmproj(folder: Path, path: Path, matrix_type: str = "F32") -> Path:
    """The folder's vision tower and projector as llama.cpp's converter writes an mmproj GGUF (general.architecture
    "clip", projector type gemma3, clip.vision.* keys, the soft-emb norm stored as 1 + weight); names from the gguf
    package's own mapping. matrix_type F16 stores the 2-D and 4-D weights in half precision."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    pre = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision = cfg["vision_config"]
    w = gemma3_mmproj_writer(path, cfg, pre)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    for name, tensor in state.items():
        gguf_name = gemma3_mmproj_name(names, name)
        if gguf_name is None:
            continue
        data = tensor.float() + (1.0 if "soft_emb_norm" in name else 0.0)
        array = np.ascontiguousarray(data.numpy())
        if matrix_type == "F16" and array.ndim >= 2 and "position_embedding" not in name:
            array = array.astype(np.float16)
        w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------------------------------------------
# Gemma 4 image-text (Gemma4ForConditionalGeneration): a small Gemma 4 text model (GEMMA4_VARIANTS) beside a tiny
# vision tower and its embedder, written by transformers; the processor's files as the hub has them; and the tower
# as llama.cpp's converter writes it into an mmproj GGUF.

GEMMA4_VISION_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
                          "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                          "<tool_response|>", '<|"|>', "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>",
                          "<|audio|>", "<|video|>"]
GEMMA4_PATCH, GEMMA4_POOLING, GEMMA4_MAX_TOKENS = 4, 2, 70  # images of up to 70 tokens, ~67 x 67 pixels
GEMMA4_TEMPLATE_FILE = Path(__file__).parent / "chat_templates" / "gemma-4-it.jinja"  # Google's own


def write_tiny_gemma4_vision(folder: Path, seed: int = 0, variant: str = "gemma4_dense", bidirectional: bool = True,
                             clipped: bool = True) -> Path:
    """A Gemma4ForConditionalGeneration folder as transformers saves it: the text model of GEMMA4_VARIANTS[variant]
    (use_bidirectional_attention "vision" when bidirectional, as the 26B and 31B say), no audio tower, and a 2-layer
    vision tower (hidden 32, 4 heads over 2 KV heads, patches of 4 pixels pooled 2 x 2, standardised, its linear
    layers clipped when clipped) with its embedder; a tokenizer with Gemma 4's control and media tokens and its chat
    template (an image part renders as <|image|>); processor_config.json with the image processor's settings, as the
    released models have it. Returns the folder."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(GEMMA4_VISION_SPECIALS, add_bos=None)
    ids = {t: tok.token_to_id(t) for t in GEMMA4_VISION_SPECIALS}
    text = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"], head_dim=16,
                sliding_window=16, global_head_dim=32, **GEMMA4_VARIANTS[variant],
                use_bidirectional_attention="vision" if bidirectional else None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING,
                  position_embedding_size=640, standardize=True,  # rows of 280 tokens (an mmproj's budget)
                  use_clipped_linears=clipped, initializer_range=0.1)
    config = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                             boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
                             image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                             audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"],
                             eoa_token_index=ids["<audio|>"], initializer_range=0.1)
    torch.manual_seed(seed)
    model = tf.Gemma4ForConditionalGeneration(config).eval()
    _randomise(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("layer_scalar", "std_scale")):
                b.normal_(1.0, 0.1)
            elif name.endswith("std_bias"):
                b.normal_(0.0, 0.5)
            elif name.endswith(("input_max", "output_max")):  # bounds some activations reach
                b.fill_(torch.empty(()).uniform_(0.5, 1.5).item())
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-torch.empty(()).uniform_(0.5, 1.5).item())
    model.save_pretrained(folder)

    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": GEMMA4_TEMPLATE_FILE.read_text(encoding="utf-8"),
        "extra_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                                 "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
    })
    _write_json(folder / "generation_config.json", {"bos_token_id": ids["<bos>"],
                                                    "eos_token_id": [ids["<eos>"], ids["<turn|>"]]})
    _write_json(folder / "processor_config.json", {
        "processor_class": "Gemma4Processor", "image_seq_length": GEMMA4_MAX_TOKENS, "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_normalize": False,
            "do_rescale": True, "do_resize": True, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
            "max_soft_tokens": GEMMA4_MAX_TOKENS, "patch_size": GEMMA4_PATCH, "pooling_kernel_size": GEMMA4_POOLING,
            "resample": 3, "rescale_factor": 1 / 255}})
    return folder


def write_tiny_gemma4_mmproj(folder: Path, path: Path, matrix_type: str = "F32") -> Path:
    """The folder's vision tower and embedder as llama.cpp's converter writes an mmproj GGUF (projector type gemma4v,
    clip.vision.* keys, the patch embedding as a conv kernel [hidden, 3, p, p], the clip bounds as [1] tensors, the
    position table in F32); names from the gguf package's own mapping. matrix_type F16 stores the 2-D and 4-D
    weights in half precision."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vision = cfg["vision_config"]
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA4V)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(224)  # unused, as the converter writes it
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean([0.0, 0.0, 0.0])
    w.add_vision_image_std([1.0, 1.0, 1.0])
    w.add_vision_attention_layernorm_eps(1e-6)
    if vision["pooling_kernel_size"] != 3:
        w.add_vision_projector_scale_factor(vision["pooling_kernel_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    for name, tensor in state.items():
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        data = tensor.float()
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if name.endswith("patch_embedder.input_proj.weight"):  # [h, p * p * 3] -> the conv kernel [h, 3, p, p]
            p = vision["patch_size"]
            data = data.reshape(data.shape[0], p, p, 3).permute(0, 3, 1, 2)
        array = np.ascontiguousarray(data.reshape(1) if data.dim() == 0 else data).astype(np.float32)
        if matrix_type == "F16" and array.ndim >= 2 and "position_embedding" not in name:
            array = array.astype(np.float16)
        suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
        w.add_tensor(names.get_name(name, try_suffixes=suffixes), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------------------------------------------
# Mistral 3 image-text (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2): a Pixtral tower, the patch
# merger and projector beside a Mistral text model, written by transformers; the processor's files as the hub has them.

MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>"]
MISTRAL3_PATCH, MISTRAL3_MERGE, MISTRAL3_LONGEST_EDGE = 4, 2, 48  # images resized into 48 x 48, multiples of 8
MISTRAL3_IMAGE_MEAN, MISTRAL3_IMAGE_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# the shape of Mistral Small 3.1's template (a user turn in [INST] ... [/INST], an image part as [IMG]), shortened
MISTRAL3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '[IMG]' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '[/INST]' }}{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- message['content'] }}{%- endif %}{%- endfor %}"
)


def write_tiny_mistral3_vision(folder: Path, seed: int = 0) -> Path:
    """A Mistral3ForConditionalGeneration folder as transformers saves it: a 2-layer Mistral text model, a 2-layer
    Pixtral tower (patches of 4, SiLU-gated MLP as Mistral Small 3.1's) whose 2 x 2 patches merge into one image
    token, the RMSNorm + linear-GELU-linear projector; a tokenizer with [IMG] / [IMG_BREAK] / [IMG_END] and a
    Mistral-style chat template, the processor's files (preprocessor_config.json, processor_config.json)."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(MISTRAL3_SPECIALS, add_bos="<s>")
    ids = {t: tok.token_to_id(t) for t in MISTRAL3_SPECIALS}
    text = dict(model_type="mistral", vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=None, initializer_range=0.1,
                rope_theta=1e6, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    vision = dict(model_type="pixtral", image_size=MISTRAL3_LONGEST_EDGE, patch_size=MISTRAL3_PATCH, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, hidden_act="silu",
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}, initializer_range=0.1)
    config = tf.Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"],
                               spatial_merge_size=MISTRAL3_MERGE, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Mistral3ForConditionalGeneration(config).eval()
    _randomise(model)
    model.save_pretrained(folder)

    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": MISTRAL3_TEMPLATE,
    })
    _write_json(folder / "generation_config.json", {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]})
    _write_json(folder / "preprocessor_config.json", {
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "size": {"longest_edge": MISTRAL3_LONGEST_EDGE}, "patch_size": {"height": MISTRAL3_PATCH,
                                                                        "width": MISTRAL3_PATCH},
        "resample": 3, "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": MISTRAL3_IMAGE_MEAN, "image_std": MISTRAL3_IMAGE_STD,
    })
    _write_json(folder / "processor_config.json", {
        "processor_class": "PixtralProcessor", "patch_size": MISTRAL3_PATCH, "spatial_merge_size": MISTRAL3_MERGE,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    return folder


def write_tiny_mistral3_mmproj(folder: Path, path: Path, matrix_type: str = "F32") -> Path:
    """The folder's tower, merger and projector as llama.cpp's converter writes a Mistral 3 mmproj GGUF (projector
    type pixtral, clip.vision.* keys with the spatial merge, clip.use_silu, q/k rows interleaved per head, the text
    model's [IMG_BREAK] embedding as v.token_embd.img_break); names from the gguf package's own mapping. matrix_type
    F16 stores the 2-D and 4-D weights in half precision."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    pre = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision, text = cfg["vision_config"], cfg["text_config"]
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    w.add_vision_projection_dim(text["hidden_size"])
    w.add_vision_image_size(vision["image_size"])
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_vision_attention_layernorm_eps(1e-5)  # transformers' fixed Pixtral eps, as the converter writes it
    w.add_vision_use_silu(True)
    w.add_vision_spatial_merge_size(cfg["spatial_merge_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision["num_hidden_layers"], 3))  # mm.1, mm.2
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    heads = vision["num_attention_heads"]
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.endswith("embed_tokens.weight"):  # the [IMG_BREAK] row, which llmd leaves unread
            tensor, gguf_name = tensor[MISTRAL3_SPECIALS.index("[IMG_BREAK]")], "v.token_embd.img_break"
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                tensor = _llama_cpp_permute(tensor, heads)
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        else:
            continue
        array = np.ascontiguousarray(tensor.float().numpy())
        if matrix_type == "F16" and array.ndim >= 2:
            array = array.astype(np.float16)
        w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
