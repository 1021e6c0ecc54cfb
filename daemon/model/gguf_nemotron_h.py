"""llama.cpp's Nemotron-H GGUF files (architectures `nemotron_h` and `nemotron_h_moe`): what its converter
(NemotronHModel, over GraniteHybridModel and Mamba2Model) writes, and how llmd.model.gguf reads it back into
llmd.model.mamba2's Nemotron-H (one mixer per layer).

What the converter writes, and how each is read:
- the layer kinds, as two per-layer arrays: `attention.head_count_kv` (the KV heads on attention layers, 0 elsewhere)
  and `feed_forward_length` (the MLP's width on the MLP layers of `nemotron_h`, the experts' on the MoE layers of
  `nemotron_h_moe`, 0 elsewhere); a layer with neither is a Mamba2 layer (as llama.cpp reads them);
- the Mamba2 sizes as Granite's: `ssm.inner_size` (heads x head width), `ssm.time_step_rank` (the head count),
  `ssm.state_size`, `ssm.group_count`, `ssm.conv_kernel`; `attention.key_length` the head width;
- the experts: `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
  `expert_shared_feed_forward_length`, `expert_weights_norm`, `expert_weights_scale`, `expert_group_count` (the
  groups kept, `expert_group_used_count`, is not written: a file with several groups must carry it, else it is
  refused), `moe_latent_size`; the gating is sigmoid (not written; an `expert_gating_func` other than 2 is refused);
  `nextn_predict_layers` multi-token-prediction blocks after the decoder, counted in block_count, are not run;
- tensors as Granite's Mamba2 layers (ssm_a = -exp(A_log) [heads, 1], ssm_d [heads, 1], the conv squeezed to
  [channels, kernel], ssm_norm as [groups, inner / groups], dt_bias as ssm_dt.bias), q/k rows permuted as for
  llama (no RoPE: the permutation is undone all the same), the MLP as ffn_up / ffn_down, the experts stacked as
  ffn_up_exps / ffn_down_exps (no gate) beside ffn_gate_inp, exp_probs_b.bias (e_score_correction_bias),
  ffn_up_shexp / ffn_down_shexp and, for latent experts, ffn_latent_down / ffn_latent_up.
A file is checked from its header before any weight is read (`check_layers`): each layer holds the tensors of its
kind in the shapes the metadata gives, and none of another kind; a mismatch is a ModelFileError naming the file, the
tensor and the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ModelFileError

# blk.N.<gguf name> -> model.layers.N.<llmd name> (llmd.model.mamba2.NemotronHLayer: mixer, or mlp for the experts)
LAYER_NAMES = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d", "ssm_dt": "mixer.dt_bias", "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D", "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj",
    "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_latent_down": "mlp.fc1_latent_proj",
    "ffn_latent_up": "mlp.fc2_latent_proj",
}
BARE_PARAMETERS = ("mixer.dt_bias", "mixer.A_log", "mixer.D")


Transforms = dict[str, Callable[[torch.Tensor], torch.Tensor]]


def undo(mamba2: Transforms) -> Transforms:
    """Granite's Mamba2 transforms (`.mamba.` suffixes) for Nemotron-H's `.mixer.` names."""
    return {suffix.replace(".mamba.", ".mixer."): fn for suffix, fn in mamba2.items()}


def _per_layer(meta: dict, key: str, blocks: int) -> list[int]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != blocks:
        raise ValueError(f"{key} is {value!r}, not one value per block ({blocks} blocks)")
    return [int(v) for v in value]


def quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    """The layer kinds, Mamba2 sizes and the experts' extra keys as NemotronHConfig's config.json keys (read by
    llmd.model.config.nemotron_h_fields; llmd.model.gguf's _moe_config adds the common expert keys). Raises ValueError
    / KeyError for missing or bad keys."""
    blocks = cfg["num_hidden_layers"]
    layers = blocks - int(meta.get(p + "nextn_predict_layers") or 0)
    kv = _per_layer(meta, p + "attention.head_count_kv", blocks)[:layers]
    ffn = _per_layer(meta, p + "feed_forward_length", blocks)[:layers]
    moe = p == "nemotron_h_moe."
    cfg["num_hidden_layers"] = layers
    cfg["layers_block_type"] = ["full_attention" if k else ("moe" if moe else "mlp") if f else "mamba"
                                for k, f in zip(kv, ffn)]
    heads, inner = int(meta[p + "ssm.time_step_rank"]), int(meta[p + "ssm.inner_size"])
    if heads < 1 or inner < 1 or inner % heads:
        raise ValueError(f"{p}ssm.inner_size {inner} is not a positive multiple of {p}ssm.time_step_rank {heads}")
    cfg.update(mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=int(meta[p + "ssm.state_size"]),
               n_groups=int(meta[p + "ssm.group_count"]), conv_kernel=int(meta[p + "ssm.conv_kernel"]),
               intermediate_size=max(ffn) or cfg["intermediate_size"])
    eps = meta.get(p + "attention.layer_norm_rms_epsilon", meta.get(p + "attention.layer_norm_epsilon"))
    cfg["layer_norm_epsilon"] = float(eps) if eps is not None else cfg["rms_norm_eps"]
    if not moe:
        return
    if not meta.get(p + "expert_count"):
        raise ValueError(f"{p}expert_count is missing: the experts' layers need it")
    gating = meta.get(p + "expert_gating_func")
    if gating is not None and int(gating) != 2:  # llama.cpp: 1 softmax, 2 sigmoid
        raise ValueError(f"{p}expert_gating_func {gating} (Nemotron-H routes by sigmoid, 2)")
    groups = int(meta.get(p + "expert_group_count") or 1)
    if groups > 1 and meta.get(p + "expert_group_used_count") is None:
        raise ValueError(f"{p}expert_group_count {groups} without {p}expert_group_used_count (how many groups a "
                         "token's experts come from)")
    latent = meta.get(p + "moe_latent_size")
    if latent:
        cfg["moe_latent_size"] = int(latent)
    if meta.get(p + "expert_shared_feed_forward_length"):
        cfg["moe_shared_expert_intermediate_size"] = int(meta[p + "expert_shared_feed_forward_length"])


def _layer_tensors(kind: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a layer of `kind` holds (beside attn_norm), each with its PyTorch-order shape."""
    hidden = cfg["hidden_size"]
    if kind == "mamba":
        heads, inner, groups = cfg["mamba_num_heads"], cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["n_groups"]
        channels = inner + 2 * groups * cfg["ssm_state_size"]
        return {"ssm_in.weight": (inner + channels + heads, hidden),
                "ssm_conv1d.weight": (channels, cfg["conv_kernel"]), "ssm_dt.bias": (heads,), "ssm_a": (heads, 1),
                "ssm_d": (heads, 1), "ssm_norm.weight": (groups, inner // groups), "ssm_out.weight": (hidden, inner)}
    if kind == "full_attention":
        q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
        return {"attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
                "attn_output.weight": (hidden, q)}
    if kind == "mlp":
        inter = cfg["intermediate_size"]
        return {"ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter)}
    experts, inter = cfg.get("num_experts") or 0, cfg.get("moe_intermediate_size") or 0
    shared = cfg.get("moe_shared_expert_intermediate_size") or 0
    latent = cfg.get("moe_latent_size") or 0
    width = latent or hidden
    out = {"ffn_gate_inp.weight": (experts, hidden), "exp_probs_b.bias": (experts,),
           "ffn_up_exps.weight": (experts, inter, width), "ffn_down_exps.weight": (experts, width, inter),
           "ffn_up_shexp.weight": (shared, hidden), "ffn_down_shexp.weight": (hidden, shared)}
    if latent:
        out.update({"ffn_latent_down.weight": (latent, hidden), "ffn_latent_up.weight": (hidden, latent)})
    return out


_KINDS = ("mamba", "full_attention", "mlp", "moe")


def check_layers(path: Path, shapes: dict[str, Sequence[int]], cfg: dict[str, Any]) -> None:
    """Each decoder layer's tensors against the metadata, from the header (`shapes`: GGUF name -> PyTorch-order
    shape): a layer holds its kind's tensors (head_count_kv and feed_forward_length say the kind) in the shapes the
    metadata gives, and no tensor of another kind. ModelFileError names the tensor."""
    optional = {"ssm_conv1d.bias"}
    kinds = [k for k in _KINDS if k != "moe" or "moe" in cfg["layers_block_type"]]
    tensors = {kind: _layer_tensors(kind, cfg) for kind in kinds}
    tensors["mamba"]["ssm_conv1d.bias"] = (tensors["mamba"]["ssm_conv1d.weight"][0],)
    for i, kind in enumerate(cfg["layers_block_type"]):
        why = (f"layer {i} is a {kind} layer by the metadata's attention.head_count_kv and feed_forward_length (the "
               "layer pattern)")
        for other in kinds:
            for suffix in tensors[other]:
                name = f"blk.{i}.{suffix}"
                if other != kind and suffix not in tensors[kind] and name in shapes:
                    raise ModelFileError(path, f"tensor {name!r} belongs to a {other} layer, but {why}")
        for suffix, want in tensors[kind].items():
            name = f"blk.{i}.{suffix}"
            if name not in shapes:
                if suffix in optional:
                    continue
                raise ModelFileError(path, f"tensor {name!r} is missing: {why}")
            if tuple(shapes[name]) != want:
                raise ModelFileError(path, f"tensor {name!r} has shape {list(shapes[name])}, expected {list(want)} "
                                           "from the metadata's sizes")
