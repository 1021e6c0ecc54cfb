"""Architecture -> the model class that runs it: the one place a new family is plugged in.

Llama-shaped families (Llama, Mistral, Qwen2, Qwen3) share llmd.model.llama.CausalLM; families whose layers differ
have their own file (Gemma 2 / Gemma 3 text: llmd.model.gemma). Every class has CausalLM's interface:
`forward(input_ids, positions, kv_caches, meta) -> hidden`, `compute_logits(hidden)`, `init_buffers(device)`,
`fuse_projections()`, and Hugging Face parameter names.
"""

from __future__ import annotations

import importlib

from torch import nn

from .config import ModelConfig

# HF architecture -> "module:class" for the families that are not llama.CausalLM
MODEL_CLASSES = {
    "Gemma2ForCausalLM": "gemma:GemmaCausalLM",
    "Gemma3ForCausalLM": "gemma:GemmaCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssCausalLM",
    "Qwen3_5ForCausalLM": "qwen3_5:Qwen35CausalLM",
    "Qwen3_5MoeForCausalLM": "qwen3_5:Qwen35CausalLM",
    "Qwen3NextForCausalLM": "qwen3_next:Qwen3NextCausalLM",
    "Qwen3VLTextModel": "qwen3_vl:Qwen3VLCausalLM",
    "Qwen3VLMoeTextModel": "qwen3_vl:Qwen3VLCausalLM",
    "Gemma4ForCausalLM": "gemma4:Gemma4CausalLM",
    "GraniteMoeHybridForCausalLM": "mamba2:GraniteHybridCausalLM",
    "NemotronHForCausalLM": "mamba2:NemotronHCausalLM",
}
DEFAULT_CLASS = "llama:CausalLM"


def model_class(config: ModelConfig) -> type[nn.Module]:
    module, _, name = MODEL_CLASSES.get(config.architecture, DEFAULT_CLASS).partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def build_model(config: ModelConfig) -> nn.Module:
    """The model for `config` with its parameters where the current torch device context puts them."""
    return model_class(config)(config)
