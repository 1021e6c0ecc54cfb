"""llmd.kernels: Triton kernels, each beside a pure-torch reference with the same signature.

- quant_matmul: fused dequant + matmul for int8 (per-channel or group-wise) and int4 (group-wise, packed) weights.
- paged_attention: decode attention over the paged KV cache (GQA-grouped, optional split-KV); the model's
  TritonBackend (llmd.model.attention_backends) routes steps with prefill chunks to prefill_attention.
- prefill_attention: varlen causal attention of a step's new tokens over cached prefix blocks plus their own chunk.
- gguf_matmul: fused dequantize + matmul for GGUF blocks kept packed (every type in gguf_matmul.TYPES).
- moe_matmul: a mixture of experts' experts (fp or packed GGUF) in three launches, the pairs grouped on the device.
- recurrent_triton: the recurrent layers of hybrid models (the short causal conv, the gated delta rule: token by token
  and by chunks), varlen over a step's sequences through their state slots.

The kernels run on CUDA; under TRITON_INTERPRET=1 they also run on CPU tensors (slowly, for tests).

The CPU has its own C kernels, compiled on first use (each falls back to torch where it cannot be built):
- cpu_gemm: int8/int4 weight-only matmul reading the same packed layouts.
- cpu_ops: the fp32 glue of a decoder layer (RMSNorm, RoPE, SiLU * up, the paged KV write, attention).
- cpu_moe: a mixture-of-experts layer's packed GGUF experts for one step in one call (llama.cpp's mul_mat_id), built
  from the steps of cpu_gemm's GGUF matmul (cpu_gguf.h).
- cpu_stack: a quantized model's whole stack of decoder layers, built from the two above, in one call.
- cpu_recurrent: the recurrent layers of hybrid models (the short causal conv, the gated delta rule) over a step's
  sequences, each at its state slot.
- openmp: a thread that stops computing hands its OpenMP worker threads back (libgomp throttles spinning otherwise).
"""

from __future__ import annotations

import os


def available() -> bool:
    """True when the Triton kernels can run here: Triton is importable and a CUDA device is present (or the
    interpreter is on)."""
    from ._triton import HAVE_TRITON

    if not HAVE_TRITON:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return torch.cuda.is_available()
