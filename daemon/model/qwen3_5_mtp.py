"""Qwen3.5 / Qwen3.6's multi-token-prediction (MTP) head, read from an HF folder's `mtp.*` tensors on demand (the
engine's MTP draft, llmd.engine.spec_mtp; the target model itself leaves them unread).

The head guesses token t+2 from the target's final hidden state at position t and the embedding of token t+1, as
vLLM's Qwen3.5 MTP does: x = fc(cat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(hidden_t))),
then one gated full-attention decoder layer shaped like the target's (its own MLP or MoE, its own KV cache), then
`mtp.norm` and the target's own head. `hidden_t` is what the target's forward returns, i.e. after its final norm
(vLLM feeds its drafter the model's output, which is normed). Guessing further, the head's own output at t stands
in for the target's hidden state at t+1. Embeddings, RoPE tables and the output head are the target's.

Checkpoint names: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.0.*` (the decoder layer's names), `mtp.norm.weight`; an image-text checkpoint's `model.mtp.*` alike.
One MTP layer is read (Qwen3.5's checkpoints ship one). Weights are kept in the compute dtype, unquantized.
Not from GGUF: the gguf package's (0.19) qwen35 / qwen35moe tensor lists name no `nextn` tensors, so llama.cpp's
converter writes no head; a file with an MTP block after its decoder (`nextn_predict_layers`) loads with the block
unread (llmd.model.gguf_hybrid), and `--draft mtp` is refused for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelFileError
from .attention import AttentionMetadata, KVCache
from .gemma import GemmaRMSNorm
from .linear import make_linear, use_transposed_weights
from .llama import CausalLM
from .moe import Experts
from .ops import bind_ops, choose_ops
from .qwen3_5 import DecoderLayer, packed_modules
from .weights import load_tensors, read_safetensors_header, tensor_reader

PREFIXES = {"mtp.": "mtp.", "model.mtp.": "mtp."}  # checkpoint prefix -> the head's


class _MtpBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.fc = make_linear(2 * h, h)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, 0)])
        self.norm = GemmaRMSNorm(h, config.rms_norm_eps)


class MtpHead(nn.Module):
    """The head's weights under their checkpoint names (`mtp.*`) and its one step."""

    checkpoint_parts = CausalLM.checkpoint_parts
    route = CausalLM.route
    covers = CausalLM.covers
    lm_head = None  # never read from here (load_tensors asks)

    def __init__(self, target_config):
        super().__init__()
        # the decoder layer is the target's full-attention layer: a one-layer config of that kind
        self.config = dataclasses.replace(target_config, num_hidden_layers=1, layer_types=["full_attention"])
        self.mtp = _MtpBlock(self.config)
        self.packed_modules = packed_modules(self.config)

    def forward(self, target: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T]: token t+1 of each row; hidden [T, H]: the target's (or this head's) output at t; positions:
        t. Returns the head's output [T, H] (after mtp.norm): target.compute_logits of it guesses token t+2."""
        m = self.mtp
        embeds, cos, sin = target.embed(input_ids, positions)
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(embeds), m.pre_fc_norm_hidden(hidden.to(embeds.dtype))], -1))
        x = m.layers[0](x, cos, sin, kv_cache, meta)
        return m.norm(x)


def mtp_tensors(files: list[Path]) -> dict[str, tuple[Path, int, dict]]:
    """The checkpoint's MTP tensors (headers only): the head's name -> (file, data start, header entry)."""
    found = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                data_start, header = read_safetensors_header(path, f)
        except OSError as exc:
            raise ModelFileError(path, f"cannot read ({exc.strerror or exc})") from None
        for name, entry in header.items():
            prefix = next((p for p in PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                found[PREFIXES[prefix] + name.removeprefix(prefix)] = (path, data_start, entry)
    return found


def has_mtp_head(loaded) -> bool:
    """Whether the model is a Qwen3.5 family model whose folder ships an MTP head."""
    source = getattr(loaded, "source", None)
    return (source is not None and source.kind == "hf" and loaded.config.recurrent is not None
            and loaded.config.architecture.startswith("Qwen3_5") and bool(mtp_tensors(source.files)))


def load_mtp_head(loaded) -> MtpHead:
    """The MTP head of a loaded Qwen3.5 model, read from its folder in the model's dtype on its device. A tensor of
    the wrong shape, an unknown one or a missing one is a ModelFileError naming the file and the tensor."""
    source = getattr(loaded, "source", None)
    if not loaded.config.architecture.startswith("Qwen3_5") or loaded.config.recurrent is None:
        raise ValueError(f"{loaded.name!r} ({loaded.config.architecture}) has no multi-token-prediction head: "
                         "the MTP draft is for Qwen3.5 / Qwen3.6 models")
    if source is None or source.kind != "hf":
        raise ValueError(f"{loaded.name!r}: the multi-token-prediction head is read from Hugging Face folders only "
                         "(llama.cpp's qwen35 GGUF files carry none); load the folder to draft with it")
    found = mtp_tensors(source.files)
    if not found:
        raise ValueError(f"{loaded.name!r}: its checkpoint has no mtp.* tensors (no multi-token-prediction head)")
    with torch.device("meta"):
        head = MtpHead(loaded.config)
    head = head.to(dtype=loaded.dtype).to_empty(device=loaded.device).eval().requires_grad_(False)
    params = dict(head.named_parameters())
    for name, (path, _, entry) in found.items():  # shapes from the headers first: the error names the file
        target, rows = head.route(name)
        param = params.get(target)
        if param is None:
            raise ModelFileError(path, f"unexpected tensor {name!r} in the multi-token-prediction head")
        want = tuple(param.data.shape if rows is None else param.data[rows].shape)
        if tuple(entry["shape"]) != want:
            raise ModelFileError(path, f"tensor {name!r} has shape {tuple(entry['shape'])}, expected {want}")
    load_tensors(head, ((name, tensor_reader(path, start, entry)()) for name, (path, start, entry) in found.items()),
                 source.path)
    if loaded.device.type == "cpu":
        use_transposed_weights(head)
    bind_ops(head, choose_ops(loaded.device, loaded.dtype))
    for module in head.modules():
        if isinstance(module, Experts):
            module.prepare(loaded.device, loaded.dtype)
    return head
