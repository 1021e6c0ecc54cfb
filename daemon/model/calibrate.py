"""Calibrated int4 quantization while loading: AWQ scaling (llmd.model.awq), then GPTQ (llmd.model.gptq), layer by
layer, on a short built-in text (llmd.model.calibration_text).

The loader's stream fills everything except the int4 layers (embeddings, norms, biases; `quantizing_stream` skips
the weights of calibrated layers). Then, for each decoder layer in order:
  1. its fp weights are read from the checkpoint by name (one layer's worth in memory),
  2. the calibration tokens' hidden states (already through the quantized layers before it) run through the layer
     in fp, and each projection's input is recorded,
  3. the AWQ scales are searched and folded into the weights and the layer's norms,
  4. the projections are quantized by GPTQ on the Hessian of their (scaled) input, those that share an input
     (q/k/v, gate/up) in one run,
  5. the hidden states go through the quantized layer and become the next layer's input.
Peak memory is the quantized model plus one layer in fp32 and the calibration activations (a few thousand tokens).
(Re-running the layer between projections, so that o_proj is calibrated on the quantized q/k/v's output, measured
no better on SmolLM2-135M and cost 3x the forwards.)

Deterministic: the same checkpoint gives the same bytes on the same machine and torch build. The quant cache keys
on `CALIBRATION`: change it whenever the method or the text changes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import awq, quant
from .attention import AttentionMetadata, allocate_kv_cache
from .calibration_text import CHAT, DOCUMENTS
from .gptq import gptq_int4, input_hessian

log = logging.getLogger(__name__)

CALIBRATION = "awq+gptq-2"  # names method + text in the quant cache key
BLOCK_SIZE = 16


@torch.no_grad()
def quantize_calibrated(model: nn.Module, sources: list[Path], spec: quant.QuantSpec,
                        token_ids: list[list[int]] | None = None) -> None:
    """Fill the model's empty Int4Linear layers (everything else already loaded). `token_ids`: calibration
    sequences (default: the built-in text through the checkpoint's own tokenizer)."""
    start = time.perf_counter()
    readers = weight_readers(sources)
    seqs = token_ids if token_ids is not None else calibration_token_ids(sources)
    pending = {name: m for name, m in model.named_modules() if isinstance(m, quant.Int4Linear)}
    decoder = model.model
    device, dtype = decoder.embed_tokens.weight.device, decoder.embed_tokens.weight.dtype

    lens = [len(s) for s in seqs]
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE, device=device)
    cfg = model.config
    (kv_cache,) = allocate_kv_cache(1, next_block, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                                    device=device)  # one layer's cache, reused by every layer
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=device)
    x = decoder.embed_tokens(ids)
    cos, sin = decoder.rotary_emb(positions, x.dtype)

    for index, layer in enumerate(decoder.layers):
        prefix = f"model.layers.{index}."
        mine = {name[len(prefix):]: m for name, m in pending.items() if name.startswith(prefix)}
        parts = {name: [(p[len(prefix):], rows) for p, rows in model.checkpoint_parts(prefix + name)] for name in mine}
        x = _quantize_block(layer, mine, parts, prefix, readers, spec, dtype,
                            lambda: layer(x, cos, sin, kv_cache, meta), scale=True)
    head = pending.get("lm_head")
    if head is not None:  # an untied head quantized on request: its input is the final norm's output
        hidden = decoder.norm(x)
        _quantize_block(model, {"lm_head": head}, {"lm_head": [("lm_head", slice(None))]}, "", readers, spec, dtype,
                        lambda: model.lm_head(hidden))
    log.info("calibrated int4 quantization (AWQ + GPTQ) of %d layers on %d tokens in %.1f s", len(pending), len(ids),
             time.perf_counter() - start)


def _quantize_block(block: nn.Module, layers: dict[str, quant.Int4Linear], parts: dict[str, list[tuple[str, slice]]],
                    prefix: str, readers, spec, dtype: torch.dtype, forward: Callable[[], torch.Tensor],
                    scale: bool = False) -> torch.Tensor:
    """Quantize `layers` (names relative to `block`) and return the forward's output through the quantized block.
    parts: each layer's checkpoint projections and their rows (q/k/v of a fused qkv_proj; a plain layer: itself).

    While the block is calibrated its projections are plain nn.Linear: first with the checkpoint weight, then with the
    dequantized int4 weight (what the int4 layer computes, without its slow-at-prefill CPU kernel). AWQ and GPTQ see
    the checkpoint projections (row views of the fused weights), so the result is that of quantizing them apart."""
    weights, biases, linears, owner = {}, {}, {}, {}
    for name, qlayer in layers.items():
        whole = readers.get(f"{prefix}{name}.weight")  # a checkpoint that stores the fused projection (Phi-3)
        read = [whole()] if whole is not None else [readers[f"{prefix}{p}.weight"]() for p, _ in parts[name]]
        fused = torch.cat(read).to(device=qlayer.scales.device, dtype=torch.float32)
        for part, rows in parts[name]:
            weights[part] = fused[rows]
            biases[part] = None if qlayer.bias is None else qlayer.bias[rows]
            owner[part] = (name, rows)
        linears[name] = nn.Linear(qlayer.in_features, qlayer.out_features, bias=False, device="meta")
        linears[name].weight = nn.Parameter(fused.to(dtype), requires_grad=False)
        linears[name].bias = qlayer.bias
        _set(block, name, linears[name])
    inputs = {part: x for name, x in _all_inputs(linears, forward).items() for part, _ in parts[name]}
    if scale:
        awq.scale_layer(block, weights, biases, inputs, spec.group_size)
    for names, x in _by_shared_input(inputs):
        # projections that read the same input share its Hessian: one GPTQ run over their stacked rows
        packed, scales, zeros = gptq_int4(torch.cat([weights.pop(n) for n in names]), input_hessian(x),
                                          spec.group_size)
        row = 0
        for part in names:
            name, rows = owner[part]
            n = layers[name].out_features if rows.start is None else rows.stop - rows.start
            mine = slice(row, row + n)
            quant.layers.fill_int4(layers[name], packed[mine], scales[mine], zeros[mine], rows=rows)
            row = mine.stop
    for name, qlayer in layers.items():
        linears[name].weight = nn.Parameter(qlayer.dequantized_weight().to(dtype), requires_grad=False)
    out = forward()
    for name, qlayer in layers.items():
        _set(block, name, qlayer)
    return out


def _all_inputs(linears: dict[str, nn.Linear], forward: Callable) -> dict[str, torch.Tensor]:
    """Every projection's input [T, in] in one forward; projections that share an input share one tensor."""
    raw = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: raw.setdefault(n, args[0]))
               for n, m in linears.items()]
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    flat = {}
    for x in raw.values():
        flat.setdefault(id(x), x.reshape(-1, x.shape[-1]))
    return {name: flat[id(x)] for name, x in raw.items()}


def _by_shared_input(inputs: dict[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, x in inputs.items():
        groups.setdefault(id(x), ([], x))[0].append(name)
    return list(groups.values())


def _set(block: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent_name) if parent_name else block, child, module)


def weight_readers(sources: list[Path]) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> reader of one fp tensor, for a GGUF file or safetensors shards."""
    if len(sources) == 1 and Path(sources[0]).suffix.lower() == ".gguf":
        from .gguf import tensor_readers

        return tensor_readers(sources[0])
    from .weights import safetensors_readers

    return safetensors_readers([Path(p) for p in sources])


def calibration_token_ids(sources: list[Path]) -> list[list[int]]:
    """The built-in documents and chat, tokenized by the checkpoint's tokenizer (the chat through its template)."""
    from .tokenizer import Tokenizer

    first = Path(sources[0])
    if first.suffix.lower() == ".gguf":
        from .gguf import read_gguf_metadata

        tokenizer = Tokenizer.from_gguf(read_gguf_metadata(first), path=first)
    else:
        tokenizer = Tokenizer.from_hf_folder(first.parent)
    seqs = [tokenizer.encode(doc, add_special_tokens=True) for doc in DOCUMENTS]
    try:
        seqs.append(tokenizer.encode_chat(list(CHAT), add_generation_prompt=False))
    except Exception as exc:  # a template that cannot render this chat: calibrate on the plain text of it
        log.debug("chat template failed on the calibration chat (%s); using plain text", exc)
        seqs.append(tokenizer.encode("\n\n".join(m["content"] for m in CHAT), add_special_tokens=True))
    return [s for s in seqs if s]
