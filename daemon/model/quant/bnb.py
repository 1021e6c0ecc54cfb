"""bitsandbytes layers (LLM.int8, NF4) as the alternative quantization backend (--quant bnb-int8 / bnb-nf4)."""

from __future__ import annotations

import torch
from torch import nn

def _bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError("--quant bnb-int8/bnb-nf4 needs bitsandbytes (pip install bitsandbytes)") from None
    return bitsandbytes


def _bnb_layer(method: str, in_features: int, out_features: int, bias: bool, dtype) -> nn.Module:
    bnb = _bnb()
    if method == "bnb-int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias, has_fp16_weights=False, threshold=6.0,
                                    device="meta")
    else:
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, quant_type="nf4",
                                  compute_dtype=dtype or torch.float32, device="meta")
    layer.weight = None  # set by _bnb_fill from the checkpoint tensor; the loader must not expect an fp weight
    return layer


def _bnb_fill(layer: nn.Module, weight: torch.Tensor, method: str) -> None:
    """bitsandbytes quantizes when the parameter moves to its device."""
    bnb = _bnb()
    device = weight.device
    if method == "bnb-int8":
        param = bnb.nn.Int8Params(weight.to(torch.float16 if device.type == "cuda" else weight.dtype).cpu(),
                                  requires_grad=False, has_fp16_weights=False)
    else:
        param = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4")
    layer.weight = param.to(device)
