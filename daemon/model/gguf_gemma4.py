"""llama.cpp's Gemma 4 GGUF files (architecture `gemma4`): what its converter writes, and how llmd.model.gguf reads
it back into llmd.model.gemma4.

As llama.cpp's converter (convert_hf_to_gguf's Gemma4Model) writes it and its loader (src/models/gemma4.cpp) reads it:
- norms as they are (Gemma 4's RMSNorm multiplies by its weight: no shift), q/k rows in Hugging Face order;
- per-layer shapes in the metadata: attention.sliding_window_pattern (one flag per layer, true = sliding),
  attention.key_length (the full layers' head size) and key_length_swa (the sliding layers'), head_count_kv and
  feed_forward_length as per-layer arrays where layers differ (the 31B's global KV heads; the E-models'
  double-wide MLPs on the KV-sharing layers), attention.shared_kv_layers (the last N layers read the K/V of an
  earlier layer), embedding_length_per_layer_input (0: no per-layer embeddings), rope.freq_base / freq_base_swa;
- the full layers' proportional RoPE is the `rope_freqs` tensor over rope.dimension_count = key_length: 1 for the
  frequencies that turn, 1e30 (a frequency divided to nothing) for those that do not;
- V from K on the full layers (transformers' attention_k_eq_v) is a full layer without attn_v;
- per-layer embeddings: per_layer_token_embd [vocab, layers * P], per_layer_model_proj and per_layer_proj_norm, and
  per layer inp_gate, proj and post_norm; every layer's learned scalar is layer_output_scale;
- the 26B-A4B's experts: the router ffn_gate_inp with its `.scale` (transformers' router.scale), ffn_gate_up_exps
  (each expert's gate rows then up rows, as transformers stores them; or ffn_gate_exps + ffn_up_exps), and
  ffn_down_exps with its `.scale` (the router's per_expert_scale), the branch's norms pre_ffw_norm_2,
  post_ffw_norm_1 and post_ffw_norm_2.
Hub checkpoints carry k/v projections for the KV-sharing layers that nothing reads (transformers skips them); the
converter copies them and llama.cpp loads them unused: they are left unread here.
A file is checked from its header before any weight is read (`screen`): every tensor llama.cpp requires, present and
of the shape the metadata gives; a mismatch is a ModelFileError naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ModelFileError, UnsupportedArchitecture

# blk.N.<gguf name> -> model.layers.N.<hf name>; a name with its suffix is a bare parameter (BARE_PARAMETERS)
LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "layer_output_scale.weight": "layer_scalar",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj", "ffn_up_exps": "experts.up_proj", "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
BARE_PARAMETERS = ("layer_scalar", "router.scale", "router.per_expert_scale")
GLOBAL_NAMES = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                "per_layer_model_proj": "model.per_layer_model_projection",
                "per_layer_proj_norm": "model.per_layer_projection_norm"}
_SLIDING, _FULL = "sliding_attention", "full_attention"
_UNTURNED = 1e20  # a rope_freqs factor at least this large stops its frequency (the converter writes 1e30)


def first_int(value: Any) -> int:
    """A per-layer metadata value's first entry (the whole list is read by the family's quirks)."""
    return int(value[0] if isinstance(value, list) else value)


def _per_layer(meta: dict, key: str, layers: int) -> list[int]:
    """A metadata value given once or once per layer, as one int per layer."""
    value = meta[key]
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ValueError(f"{key} has {len(values)} values for {layers} layers")
    return [int(v) for v in values]


def _proportional_share(values: list[float], head_dim: int) -> float:
    """The share of a full layer's frequencies that turn, from the rope_freqs tensor (1 then 1e30)."""
    if len(values) != head_dim // 2:
        raise ValueError(f"tensor 'rope_freqs.weight' has {len(values)} values for the full layers' head size "
                         f"{head_dim} (expected {head_dim // 2})")
    turning = next((i for i, v in enumerate(values) if v != 1.0), len(values))
    if any(v < _UNTURNED for v in values[turning:]):
        raise UnsupportedArchitecture("gemma4 with RoPE frequency factors other than proportional RoPE's (1 for the "
                                      "frequencies that turn, then 1e30) is not supported")
    share = 2 * turning / head_dim
    if int(share * head_dim // 2) != turning:
        raise ValueError(f"tensor 'rope_freqs.weight': {turning} turning frequencies of {head_dim // 2}")
    return share


def quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    """The config.json keys llmd.model.config.gemma4_fields reads, from the metadata (see the module docstring);
    which full layers lack V (attention_k_eq_v) comes from the tensors (screen)."""
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    pattern = meta[p + "attention.sliding_window_pattern"]
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"{p}attention.sliding_window_pattern must hold one flag per layer ({layers})")
    types = [_SLIDING if flag else _FULL for flag in pattern]
    if types[-1] != _FULL:
        raise ValueError(f"{p}attention.sliding_window_pattern makes the last layer sliding (Gemma 4's is full)")
    full_dim, swa_dim = int(meta[p + "attention.key_length"]), int(meta[p + "attention.key_length_swa"])
    for suffix, dim in (("value_length", full_dim), ("value_length_swa", swa_dim)):
        if meta.get(p + "attention." + suffix) not in (None, dim):
            raise ValueError(f"{p}attention.{suffix} {meta[p + 'attention.' + suffix]} is not the key length {dim}")
    kv = _per_layer(meta, p + "attention.head_count_kv", layers)
    if any(k < 1 or heads % k for k in kv):
        raise ValueError(f"{p}attention.head_count_kv {kv} does not divide {heads} heads")
    shared = int(meta.get(p + "attention.shared_kv_layers") or 0)
    if not 0 <= shared < layers:
        raise ValueError(f"{p}attention.shared_kv_layers {shared} leaves none of the {layers} layers computing its "
                         "own K/V")
    ffn = _per_layer(meta, p + "feed_forward_length", layers)
    own, sharing = set(ffn[: layers - shared]), set(ffn[layers - shared:])
    if len(own) != 1 or len(sharing) > 1 or not sharing <= {ffn[0], 2 * ffn[0]}:
        raise ValueError(f"{p}feed_forward_length {ffn}: not one width (doubled or not on the KV-sharing layers)")
    n_rot = int(meta.get(p + "rope.dimension_count") or full_dim)
    n_rot_swa = int(meta.get(p + "rope.dimension_count_swa") or n_rot)
    if (n_rot, n_rot_swa) != (full_dim, swa_dim):
        raise UnsupportedArchitecture(f"gemma4 with RoPE over {n_rot} / {n_rot_swa} of the {full_dim} / {swa_dim} "
                                      "head dimensions (full / sliding) is not supported")
    if meta.get(p + "rope.scaling.type") not in (None, "none"):
        raise UnsupportedArchitecture(f"gemma4 with rope scaling {meta[p + 'rope.scaling.type']!r} is not supported")
    full_rope: dict[str, Any] = {"rope_type": "proportional", "rope_theta": cfg["rope_theta"]}
    if "rope_freqs.weight" in factors:  # (its absence is refused by screen, naming it)
        full_rope["partial_rotary_factor"] = _proportional_share(factors["rope_freqs.weight"], full_dim)
    dims = [swa_dim if t == _SLIDING else full_dim for t in types]
    cfg.update(
        layer_types=types, head_dim=swa_dim, global_head_dim=full_dim,
        num_key_value_heads=next((k for k, t in zip(kv, types, strict=True) if t == _SLIDING), kv[0]),
        per_layer_config={str(i): {"head_dim": d, "num_key_value_heads": k}
                          for i, (d, k) in enumerate(zip(dims, kv, strict=True))},
        num_kv_shared_layers=shared, intermediate_size=ffn[0], use_double_wide_mlp=sharing == {2 * ffn[0]},
        rope_parameters={"full_attention": full_rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base_swa") or cfg["rope_theta"])}},
        sliding_window=int(meta[p + "attention.sliding_window"]),
        final_logit_softcapping=meta.get(p + "final_logit_softcapping"),
        hidden_size_per_layer_input=int(meta[p + "embedding_length_per_layer_input"]),
        vocab_size_per_layer_input=cfg["vocab_size"],  # llama.cpp's rule: one row per token of the vocabulary
    )
    if meta.get(p + "expert_count"):  # an MoE block beside every MLP (the rest of the keys: _moe_config)
        gating = meta.get(p + "expert_gating_func")
        if gating not in (None, 1):  # llama.cpp: 1 softmax
            raise ValueError(f"{p}expert_gating_func {gating} (Gemma 4 routes by softmax, 1)")
        cfg.update(enable_moe_block=True, top_k_experts=int(meta[p + "expert_used_count"]),
                   moe_intermediate_size=int(meta[p + "expert_feed_forward_length"]))


def screen(path: Path, shapes: dict[str, tuple[int, ...]], cfg: dict) -> None:
    """Every tensor llama.cpp's gemma4 loader requires, present and of its shape as the metadata says (before any
    weight is read), the KV-sharing layers' unread k/v set aside, and V-from-K read off the full layers' tensors."""
    layers, hidden, vocab, heads = (cfg[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size",
                                                     "num_attention_heads"))
    per_layer, inter, types = cfg["hidden_size_per_layer_input"], cfg["intermediate_size"], cfg["layer_types"]
    own = layers - cfg["num_kv_shared_layers"]
    cfg["llmd_unread_tensors"] = [name for i in range(own, layers) for t in ("attn_k", "attn_v", "attn_k_norm")
                                  if (name := f"blk.{i}.{t}.weight") in shapes]
    full = [i for i in range(own) if types[i] == _FULL]
    without_v = [i for i in full if f"blk.{i}.attn_v.weight" not in shapes]
    if without_v and len(without_v) < len(full):
        raise ModelFileError(path, f"lacks tensor 'blk.{without_v[0]}.attn_v.weight' (the other full-attention "
                                   "layers have theirs)")
    cfg["attention_k_eq_v"] = bool(without_v)
    expected: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    notes = {}
    if "output.weight" in shapes:
        expected["output.weight"] = (vocab, hidden)
    if _FULL in types:
        expected["rope_freqs.weight"] = (cfg["global_head_dim"] // 2,)
    if per_layer:
        expected.update({"per_layer_token_embd.weight": (vocab, layers * per_layer),
                         "per_layer_model_proj.weight": (layers * per_layer, hidden),
                         "per_layer_proj_norm.weight": (per_layer,)})
        notes["per_layer_token_embd.weight"] = (f" (one row per token, {layers} layers of "
                                                f"{per_layer} per-layer inputs each)")
    experts, expert_inter = cfg.get("num_experts") or 0, cfg.get("moe_intermediate_size") or 0
    for i in range(layers):
        b, shape = f"blk.{i}.", cfg["per_layer_config"][str(i)]
        d, kv = shape["head_dim"], shape["num_key_value_heads"]
        wide = inter * (2 if cfg["use_double_wide_mlp"] and i >= own else 1)
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            expected[f"{b}{name}.weight"] = (hidden,)
        expected.update({b + "attn_q.weight": (heads * d, hidden), b + "attn_q_norm.weight": (d,),
                         b + "attn_output.weight": (hidden, heads * d), b + "ffn_gate.weight": (wide, hidden),
                         b + "ffn_up.weight": (wide, hidden), b + "ffn_down.weight": (hidden, wide),
                         b + "layer_output_scale.weight": (1,)})
        if i < own:
            expected.update({b + "attn_k.weight": (kv * d, hidden), b + "attn_k_norm.weight": (d,)})
            if not (cfg["attention_k_eq_v"] and types[i] == _FULL):
                expected[b + "attn_v.weight"] = (kv * d, hidden)
        if per_layer:
            expected.update({b + "inp_gate.weight": (per_layer, hidden), b + "proj.weight": (hidden, per_layer),
                             b + "post_norm.weight": (hidden,)})
        if experts:
            for name in ("ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
                         "post_ffw_norm_2.weight"):
                expected[b + name] = (hidden,)
            expected.update({b + "ffn_gate_inp.weight": (experts, hidden), b + "ffn_down_exps.scale": (experts,),
                             b + "ffn_down_exps.weight": (experts, hidden, expert_inter)})
            if b + "ffn_gate_up_exps.weight" in shapes:
                expected[b + "ffn_gate_up_exps.weight"] = (experts, 2 * expert_inter, hidden)
            else:
                for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                    expected[b + name] = (experts, expert_inter, hidden)
    for name, want in expected.items():
        shape = shapes.get(name)
        if shape is None:
            raise ModelFileError(path, f"lacks tensor {name!r}, which every gemma4 model of this shape has")
        if tuple(shape) != want:
            raise ModelFileError(path, f"tensor {name!r} has shape {list(shape)}, expected {list(want)}"
                                       f"{notes.get(name, ' as the metadata says')}")
