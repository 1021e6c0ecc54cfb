"""Applying a mode to a model while it loads: quantized layers swapped in on the meta device, then each weight
quantized (or its GGUF blocks kept) as it streams in, so the unquantized model never sits whole in memory."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from ...errors import ModelFileError
from ..huge_pages import place_packed_on_huge_pages
from . import layers
from .gguf_blocks import _fill_packed
from .layers import Int4Linear, empty_quantized, quantize_linear
from .modes import QuantSpec, parse_quant

def linear_modules(model: nn.Module, include_lm_head: bool) -> dict[str, nn.Linear]:
    """The projections to quantize, by module name (embeddings and, by default, the output head stay as they are)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (include_lm_head or not name.endswith("lm_head")):
            out[name] = module
    return out


def swap_in_quantized(model: nn.Module, spec: QuantSpec, include_lm_head: bool = False,
                      dtype: torch.dtype | None = None, device=None,
                      gguf_types: dict[str, str] | None = None, cpu: bool = False) -> dict[str, nn.Module]:
    """Replace the model's linear layers by unfilled quantized ones (call before the weights load).

    For spec "gguf" the layer follows each tensor's GGML type (gguf_types: weight name -> type), the output head
    included: off the CPU, Q4_0 and Q4_1 -> int4 g32 (an exact byte rearrangement, for the tuned Triton int4
    kernels); on the CPU (`cpu`) they stay packed, as every other packed type (llmd.kernels.gguf_blocks: Q4_K, Q6_K,
    Q5_0, Q8_0, ...) does in a GGUFLinear (the integer path's interleaved Q4_0 tiles: 2.7 times the int4 kernel's
    speed at one row; Q4_1 on the int16 path, twice: llmd.kernels.cpu_gemm.ACTIVATIONS); float types stay a
    plain linear; a packed token table becomes a GGUFEmbedding. Returns {module name: new layer}.
    """
    from llmd.kernels.gguf_blocks import BLOCKS

    from ..host_table import HostResident
    from .gguf_layers import GGUFEmbedding, GGUFLinear, HostGGUFEmbedding

    swapped = {}
    if spec.method == "gguf":
        include_lm_head = True  # a packed head stays packed (a Q6_K head dequantized would be 5x its bytes)
        for attr in ("embed_tokens", "embed_tokens_per_layer"):  # (Gemma 4's per-layer table: most of an E-model)
            emb, kind = getattr(model.model, attr, None), (gguf_types or {}).get(f"model.{attr}.weight")
            if isinstance(emb, nn.Embedding) and kind in BLOCKS:
                kept = HostGGUFEmbedding if isinstance(emb, HostResident) else GGUFEmbedding  # on the host stays
                layer = kept(emb.num_embeddings, emb.embedding_dim, kind, dtype or torch.float32, device=device)
                setattr(model.model, attr, layer)
                swapped[f"model.{attr}"] = layer
    for name, linear in linear_modules(model, include_lm_head).items():
        if spec.method == "gguf":
            layer = _gguf_layer(linear, model.checkpoint_parts(name), name, gguf_types or {}, dtype, device, cpu)
            if layer is None:
                continue
        else:
            if spec.method == "int4" and linear.in_features % spec.group_size:
                raise ValueError(f"{name}: in_features {linear.in_features} is not a multiple of the int4 group "
                                 f"size {spec.group_size}; pick a smaller group (int4-g32)")
            layer = empty_quantized(spec, linear.in_features, linear.out_features, linear.bias is not None,
                                    dtype=dtype, device=device)
            if layer is None:
                continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        swapped[name] = layer
    if spec.method == "gguf" or gguf_types:  # (an HF folder's packed experts: gpt-oss's MXFP4, whatever the mode)
        swapped.update(_swap_in_packed_experts(model, gguf_types or {}, dtype, device))
    return swapped


def _swap_in_packed_experts(model: nn.Module, gguf_types: dict[str, str], dtype, device) -> dict[str, nn.Module]:
    """Each experts' projection whose stacked GGUF tensors (ffn_*_exps; Gemma 4's gate and up as one,
    ffn_gate_up_exps) are all packed keeps their blocks (GGUFExpertLinear); a float one stays an fp ExpertLinear."""
    from llmd.kernels.gguf_blocks import BLOCKS

    from ..moe import ExpertLinear, Experts
    from .gguf_experts import GGUFExpertLinear

    swapped = {}
    for name, experts in list(model.named_modules()):
        if not isinstance(experts, Experts):
            continue
        inter = experts.intermediate_size
        gate_up = (("gate_proj", inter), ("up_proj", inter)) if experts.moe.gated else (("up_proj", inter),)
        for proj, parts in (("gate_up_proj", gate_up), ("down_proj", (("down_proj", experts.down_proj.out_features),))):
            fp: ExpertLinear = getattr(experts, proj)
            whole = gguf_types.get(f"{name}.{proj}.weight")  # stored fused, as such
            if whole is not None:
                parts = ((proj, fp.out_features),)
            kinds = [whole] if whole is not None else [gguf_types.get(f"{name}.{part}.weight") for part, _ in parts]
            if not all(k in BLOCKS for k in kinds):
                continue
            layer = GGUFExpertLinear(fp.num_experts, fp.in_features, [(n, k) for (_, n), k in zip(parts, kinds)],
                                     fp.bias is not None, dtype=dtype, device=device)
            setattr(experts, proj, layer)
            swapped[f"{name}.{proj}"] = layer
    return swapped


def _gguf_layer(linear: nn.Module, parts: list[tuple[str, slice]], name: str, gguf_types: dict[str, str],
               dtype, device, cpu: bool) -> nn.Module | None:
    """The layer keeping a (fused) projection's GGUF blocks, by its parts' types: int4 g32 for Q4_0 and Q4_1 off the
    CPU, one GGUFLinear for one packed type, a GGUFConcat of GGUFLinears for several (Q4_K_M's q/k in Q4_K, v
    in Q6_K); None (a plain fp layer, the parts dequantized) where a part is not packed."""
    from llmd.kernels.gguf_blocks import BLOCKS

    from .gguf_layers import GGUFConcat, GGUFLinear

    whole = gguf_types.get(f"{name}.weight")  # a file that stores the fused projection as such
    kinds = [whole] if whole is not None else [gguf_types.get(f"{part}.weight") for part, _ in parts]
    bias = linear.bias is not None
    if not cpu and all(k in ("Q4_0", "Q4_1") for k in kinds):
        return Int4Linear(linear.in_features, linear.out_features, bias, 32, dtype=dtype, device=device)
    if not all(k in BLOCKS for k in kinds):
        return None
    if len(set(kinds)) == 1:
        return GGUFLinear(linear.in_features, linear.out_features, kinds[0], bias, dtype=dtype, device=device)
    return GGUFConcat([GGUFLinear(linear.in_features, rows.stop - rows.start, kind, bias, dtype=dtype, device=device)
                       for (_, rows), kind in zip(parts, kinds)])


def quantizing_stream(
    tensors: Iterable, model: nn.Module, swapped: dict[str, nn.Module], spec: QuantSpec, source,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, except the weights of swapped layers, which are quantized into their layer
    (a part of a fused projection into its rows, `CausalLM.route`) on the spot. Items may also be GGUF RawTensor
    objects: packed blocks go straight into their layer (GGUFLinear, GGUFEmbedding; Q8_0/Q4 rearranged into
    int8/int4 layers), everything else is dequantized and continues as an fp tensor. bitsandbytes layers quantize
    the assembled weight once all its parts are in.

    A calibrated spec leaves the swapped layers empty (their weights are only checked to be present): they are
    filled afterwards, layer by layer, by llmd.model.calibrate.quantize_calibrated."""
    from ..gguf import RawTensor, dequantize
    from .gguf_experts import GGUFExpertLinear

    parts = {f"{name}.weight": model.checkpoint_parts(name) for name in swapped}
    pending = {f"{part}.weight" for p in parts.values() for part, _ in p}  # checkpoint weights still to come
    assembling: dict[str, dict[int, torch.Tensor]] = {}  # bitsandbytes: the parts read so far, by first row
    for item in tensors:
        name = item.name if isinstance(item, RawTensor) else item[0]
        target, rows = model.route(name)
        layer = swapped.get(target.removesuffix(".weight")) if target.endswith(".weight") else None
        covered = model.covers(name)  # the parts this tensor fills (every expert's, for a stacked one)
        if layer is None or not (covered & pending or target in parts):
            yield item if not isinstance(item, RawTensor) else (name, dequantize(item.data, item.type_name,
                                                                                 item.shape))
            continue
        pending -= {f"{p}.weight" for p, _ in parts[target]} if rows is None else covered
        if spec.calibrate and not isinstance(layer, GGUFExpertLinear):
            continue  # read again, by name, during calibration (packed experts are filled now: never calibrated)
        if isinstance(item, RawTensor):
            if (spec.method == "gguf" or isinstance(layer, GGUFExpertLinear)) and _fill_packed(layer, item, source,
                                                                                                 rows):
                continue
            tensor = dequantize(item.data, item.type_name, item.shape)
        else:
            tensor = item[1]
        if layers.fills_rows(layer) or rows is None:
            layers.fill_from_weight(layer, tensor, spec, rows)
            continue
        got = assembling.setdefault(target, {})
        got[rows.start] = tensor
        if sum(t.shape[0] for t in got.values()) == layer.out_features:
            layers.fill_from_weight(layer, torch.cat([got[k] for k in sorted(got)]), spec)
            del assembling[target]
    if pending:
        shown = ", ".join(sorted(pending)[:5])
        raise ModelFileError(source, f"{len(pending)} quantized weights missing from the checkpoint (e.g. {shown})")


def quantize_model(model: nn.Module, mode: str | QuantSpec, include_lm_head: bool = False) -> nn.Module:
    """Post-load transform: quantize a loaded model's linear layers in place, one layer at a time."""
    spec = mode if isinstance(mode, QuantSpec) else parse_quant(mode)
    if spec.method == "none":
        return model
    for name, linear in linear_modules(model, include_lm_head).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantize_linear(linear, spec))
    return model


def quantize_tied_head(model: nn.Module, spec: QuantSpec) -> None:
    """Give a tied-embedding model a separate quantized output head (the embedding table stays as it is).
    The head is the largest single matmul of a small model's decode step. On the meta device (the skeleton that a
    cache entry fills) the layer is only made."""
    emb = model.model.embed_tokens.weight
    layer = empty_quantized(spec, emb.shape[1], emb.shape[0], False, dtype=emb.dtype, device=emb.device)
    if not emb.is_meta:
        layers.fill_from_weight(layer, emb.detach(), spec)
    model.lm_head = layer


def build_empty_quantized(config, dtype: torch.dtype, device, spec: QuantSpec, include_lm_head: bool = False,
                          gguf_types: dict[str, str] | None = None, runs_on=None):
    """Like llmd.model.weights.build_empty, with quantized layers swapped in while the model is still on the meta
    device, so no full-precision copy of the swapped weights is ever allocated. runs_on: the device the model will
    compute on, which picks some layers (default: device). Returns (model, swapped layers)."""
    from ..registry import build_model

    with torch.device("meta"):
        model = build_model(config)
    model = model.to(dtype=dtype)  # before the swap: scales and zeros stay fp32
    swapped = swap_in_quantized(model, spec, include_lm_head, dtype=dtype, device="meta", gguf_types=gguf_types,
                                cpu=torch.device(runs_on or device).type == "cpu")
    model = model.to_empty(device=device)
    place_packed_on_huge_pages(model)
    model.init_buffers(device)
    return model.eval().requires_grad_(False), swapped
