"""llama.cpp's Qwen3.5 GGUF files (architectures `qwen35` and `qwen35moe`) and Qwen3-Next's (`qwen3next`): what its
converter writes, and how llmd.model.gguf reads it back into llmd.model.qwen3_5 (Gated DeltaNet layers between gated
attention layers).

Qwen3-Next's converter (Qwen3NextModel) writes the same but for: in_proj_qkvz split into attn_qkv and attn_gate (its
q, k, v and z rows gathered from their key-head groups), in_proj_ba kept fused as ssm_ba (each key head's beta rows
then its alpha rows: split as it loads, llmd.model.qwen3_next), the value heads left in Hugging Face's order (not
tiled), no rope.dimension_sections; every layer's MLP is the MoE block.

What convert_hf_to_gguf.py (Qwen3_5TextModel / Qwen3_5MoeTextModel, over Qwen3NextModel) writes, and how each is read:
- metadata: `ssm.conv_kernel` (linear_conv_kernel_dim), `ssm.state_size` (linear_key_head_dim), `ssm.group_count`
  (linear_num_key_heads), `ssm.time_step_rank` (linear_num_value_heads), `ssm.inner_size` (value heads x their
  width), `full_attention_interval` (layer i is a Gated DeltaNet layer unless (i + 1) % interval == 0),
  `rope.dimension_count` (the rotary width: partial rotary), `rope.dimension_sections` (multimodal RoPE sections,
  one position for text: not needed), `nextn_predict_layers` (multi-token-prediction blocks after the decoder,
  counted in block_count: not run);
- tensors: in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_b -> ssm_beta, in_proj_a -> ssm_alpha,
  conv1d -> ssm_conv1d (squeezed to [channels, kernel]: read back as [channels, 1, kernel]), dt_bias ->
  ssm_dt.bias, A_log -> ssm_a holding A = -exp(A_log) (read back as log(-A)), norm -> ssm_norm,
  out_proj -> ssm_out, post_attention_layernorm -> post_attention_norm; q_proj (queries and gates) kept as it is;
- every other `*norm.weight` stored as 1 + weight, the multiplier of llama.cpp's plain RMSNorm (GGUFArch.norm_shift
  takes it off again), the gated norm (ssm_norm) as it is;
- where value heads outnumber key heads, the value heads reordered from grouped by key head (HF) to tiled (value
  head j reads key head j % Hk) in attn_qkv's value rows, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the
  value channels of ssm_conv1d and ssm_out's columns. That order is kept (RecurrentConfig.tiled_value_heads): the
  columns of a K-quant ssm_out cannot be moved without dequantizing it, and the model reads q/k per value head the
  same way whatever the order.
A file is checked from its header before any weight is read (`check_layers`): each layer holds the tensors of its
kind, each recurrent tensor the shape the metadata gives, each MoE layer its router; a mismatch is a ModelFileError
naming the file, the tensor and the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ModelFileError

# blk.N.<gguf name> -> model.layers.N.<hf name>; "ssm_a" (no suffix) and "ssm_dt.bias" are bare parameters
QWEN35_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
}
BARE_PARAMETERS = ("linear_attn.dt_bias", "linear_attn.A_log")
UNSHIFTED_NORMS = (".linear_attn.norm.weight",)  # the gated norm multiplies by its weight: stored as it is
CONV_WEIGHT = ".linear_attn.conv1d.weight"
_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")


def a_log(a: torch.Tensor) -> torch.Tensor:
    """ssm_a holds A = -exp(A_log): A_log = log(-A), in fp32; a decay that is not negative is refused."""
    a = a.float()
    if not bool(torch.isfinite(a).all()) or not bool((a < 0).all()):
        raise ValueError("holds a decay A that is not a negative finite number (the file stores A = -exp(A_log))")
    return torch.log(-a)


UNDO = {".linear_attn.A_log": a_log}


def model_shape(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """A tensor's shape as the model holds it: the conv weight [channels, kernel] as [channels, 1, kernel] (the
    converter squeezed the 1 out); any other as it is."""
    return (shape[0], 1, shape[1]) if name.endswith(CONV_WEIGHT) and len(shape) == 2 else shape


def qwen35_quirks(cfg: dict, meta: dict, p: str) -> None:
    """The Gated DeltaNet sizes, layer pattern and value-head order as config.json keys (read by
    llmd.model.config.qwen3_5_fields); the rotary width as a fraction of head_dim. Raises ValueError / KeyError for
    missing or bad keys."""
    n_rot = meta.get(p + "rope.dimension_count")
    if n_rot is not None:  # always set: qwen3_5_fields' own default is a quarter
        cfg["partial_rotary_factor"] = int(n_rot) / cfg["head_dim"]
    cfg["num_hidden_layers"] -= int(meta.get(p + "nextn_predict_layers") or 0)  # counted in block_count
    cfg["linear_conv_kernel_dim"] = int(meta[p + "ssm.conv_kernel"])
    cfg["linear_key_head_dim"] = int(meta[p + "ssm.state_size"])
    cfg["linear_num_key_heads"] = int(meta[p + "ssm.group_count"])
    heads = cfg["linear_num_value_heads"] = int(meta[p + "ssm.time_step_rank"])
    inner = int(meta[p + "ssm.inner_size"])
    if heads < 1 or inner < 1 or inner % heads:
        raise ValueError(f"{p}ssm.inner_size {inner} is not a positive multiple of {p}ssm.time_step_rank {heads}")
    cfg["linear_value_head_dim"] = inner // heads
    interval = int(meta.get(p + "full_attention_interval") or 4)
    if interval < 1:
        raise ValueError(f"{p}full_attention_interval {interval} must be positive")
    cfg["full_attention_interval"] = interval
    cfg["llmd_tiled_value_heads"] = p != "qwen3next."  # (Qwen3-Next's converter keeps Hugging Face's order)
    if p in ("qwen35moe.", "qwen3next."):
        gating = meta.get(p + "expert_gating_func")
        if gating is not None and int(gating) != 1:  # llama.cpp: 1 softmax, 2 sigmoid
            raise ValueError(f"{p}expert_gating_func {gating} ({p[:-1]} routes by softmax, 1)")
        cfg["moe_intermediate_size"] = int(meta[p + "expert_feed_forward_length"])
        cfg["shared_expert_intermediate_size"] = int(meta.get(p + "expert_shared_feed_forward_length") or 0)
        if cfg["intermediate_size"] is None:  # no feed_forward_length: no dense MLP
            cfg["intermediate_size"] = cfg["shared_expert_intermediate_size"]


def check_layers(path: Path, shapes: dict[str, Sequence[int]], cfg: dict[str, Any]) -> None:
    """Each decoder layer's tensors against the metadata, from the header (`shapes`: GGUF name -> PyTorch-order
    shape): a Gated DeltaNet layer holds its nine tensors in the shapes the ssm.* keys give and no attention
    projection, an attention layer the reverse, a Qwen3.5-MoE layer its router. ModelFileError names the tensor."""
    hidden, interval = cfg["hidden_size"], cfg["full_attention_interval"]
    kernel, dk, hk = cfg["linear_conv_kernel_dim"], cfg["linear_key_head_dim"], cfg["linear_num_key_heads"]
    dv, hv = cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]
    channels, value = 2 * hk * dk + hv * dv, hv * dv
    sizes = (f"ssm.conv_kernel {kernel}, {hk} key heads (ssm.group_count) of {dk} (ssm.state_size), {hv} value "
             f"heads (ssm.time_step_rank) of {dv} (ssm.inner_size / heads), hidden {hidden}")
    beta_alpha = {"ssm_ba.weight": (2 * hv, hidden)} if cfg.get("model_type") == "qwen3next" else \
        {"ssm_beta.weight": (hv, hidden), "ssm_alpha.weight": (hv, hidden)}
    recurrent = {"attn_qkv.weight": (channels, hidden), "attn_gate.weight": (value, hidden), **beta_alpha,
                 "ssm_conv1d.weight": (channels, kernel), "ssm_dt.bias": (hv,), "ssm_a": (hv,),
                 "ssm_norm.weight": (dv,), "ssm_out.weight": (hidden, value)}
    for i in range(cfg["num_hidden_layers"]):
        is_recurrent = (i + 1) % interval != 0
        kind = "a Gated DeltaNet layer" if is_recurrent else "a full-attention layer"
        why = f"layer {i} is {kind} by full_attention_interval {interval}"
        own, other = (recurrent, _ATTENTION) if is_recurrent else (dict.fromkeys(_ATTENTION), recurrent)
        for suffix in other:
            if f"blk.{i}.{suffix}" in shapes:
                raise ModelFileError(path, f"tensor 'blk.{i}.{suffix}' does not belong where it is: {why} (the "
                                           "layer pattern does not match the tensors)")
        for suffix, want in own.items():
            name = f"blk.{i}.{suffix}"
            if name not in shapes:
                raise ModelFileError(path, f"tensor {name!r} is missing: {why}")
            if want is not None and tuple(shapes[name]) != want:
                raise ModelFileError(path, f"tensor {name!r} has shape {list(shapes[name])}, expected {list(want)} "
                                           f"for the metadata's {sizes}")
        if cfg.get("num_experts") and f"blk.{i}.ffn_gate_inp.weight" not in shapes:
            raise ModelFileError(path, f"tensor 'blk.{i}.ffn_gate_inp.weight' is missing: every layer of a "
                                       "Qwen3.5-MoE or Qwen3-Next model routes its tokens to experts")
