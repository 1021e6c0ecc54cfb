"""Activation-aware scaling (AWQ) of a decoder layer before its int4 quantization.

A few input channels of each projection carry much larger activations than the rest; their weights deserve a finer
grid. Multiplying input channel c of a weight by s_c (and dividing the activation by s_c, so the product is
unchanged) gives those weights more of their group's range. The activation side is folded into whatever produces
the input: the RMSNorm weight before q/k/v and gate/up, the rows of v_proj before o_proj, the rows of up_proj
before down_proj. Per group of projections, s = mean|x|^alpha, with alpha picked from a grid by the output error
of the quantized weights on the calibration inputs. alpha = 0 (no scaling) is always a candidate, so the search
never makes that error worse.

The pairs below follow the Llama-family layer (llmd.model.llama.DecoderLayer): Llama, Mistral, Qwen2, Qwen3.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .quant import fit_int4_grid

ALPHAS = tuple(i / 10 for i in range(11))

# (what produces the input, the projections that read it), names relative to a DecoderLayer
SCALED_INPUTS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


def _identity(s: torch.Tensor) -> torch.Tensor:
    return s


def scale_layer(layer: nn.Module, weights: dict[str, torch.Tensor], biases: dict[str, torch.Tensor | None],
                inputs: dict[str, torch.Tensor], group_size: int) -> None:
    """Search and fold the scales of one layer, in place: `weights` (fp32 [out, in] by projection name, about to be
    quantized), `biases` and the layer's RMSNorm weights are updated, and so is `inputs` (each projection's
    calibration inputs [T, in]; projections that share an input keep sharing one tensor), to what the scaled weights
    now see. Pairs whose projections are not all here are skipped."""
    for source, targets in SCALED_INPUTS:
        if not all(t in weights for t in targets) or (source.endswith("_proj") and source not in weights):
            continue
        x = inputs[targets[0]].to(torch.float32)
        mean_abs, mean_sq = x.abs().mean(0), x.square().mean(0)
        expand = _identity
        if source == "self_attn.v_proj":  # grouped-query heads: one scale per v channel, shared by its q heads
            attn = layer.self_attn
            mean_abs, expand = _per_kv_channel(mean_abs, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        s = search_scale([weights[t] for t in targets], mean_sq, mean_abs, group_size, expand)
        full = expand(s)
        scaled_input = x / full
        for t in targets:
            weights[t].mul_(full)
            inputs[t] = scaled_input
        if source.endswith("_proj"):
            weights[source].div_(s.unsqueeze(1))
            if biases.get(source) is not None:
                biases[source].div_(s.to(biases[source].dtype))
        else:
            norm = layer.get_submodule(source).weight
            norm.data = (norm.data.to(torch.float32) / s).to(norm.dtype)


def search_scale(weights: list[torch.Tensor], mean_sq: torch.Tensor, mean_abs: torch.Tensor, group_size: int,
                 expand: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The per-channel scale s = mean_abs^alpha (normalised around 1) whose fake-quantized weights give the least
    output error, estimated as sum((w_q - w)^2 * mean(x^2)) (the diagonal of X^T X: measured as good as the full
    matrix for ranking alphas, at a fraction of the cost); alpha = 0 is s = 1."""
    best_err, best = None, None
    base = mean_abs.clamp_min(1e-5)
    for alpha in ALPHAS:
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        full = expand(s)
        err = 0.0
        for w in weights:
            err += float((_fake_quant(w * full, group_size) / full - w).square_().mul_(mean_sq).sum())
        if best_err is None or err < best_err:
            best_err, best = err, s
    return best


def _fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Min/max int4 rounding, dequantized (the search only ranks the alphas; the real quantizer comes after)."""
    n, k = w.shape
    q, scale, low = fit_int4_grid(w.view(n, k // group_size, group_size), clip=False, refit_steps=0)
    return (q * scale.unsqueeze(-1) + low.unsqueeze(-1)).view(n, k)


def _per_kv_channel(mean_abs: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """o_proj's input channel (head h, d) is v channel (h // (heads / kv_heads), d): average the activation over the
    heads sharing a v channel, and expand a per-v-channel scale back to o_proj's inputs."""
    rep = heads // kv_heads
    per_v = mean_abs.view(kv_heads, rep, head_dim).mean(1).reshape(-1)

    def expand(s: torch.Tensor) -> torch.Tensor:
        return s.view(kv_heads, 1, head_dim).expand(kv_heads, rep, head_dim).reshape(-1)

    return per_v, expand
