"""Weight-only quantization: the `--quant` modes and every quantized layer, one module per concept.

Modes: none | int8 | int4 (group 64; int4-g32 / int4-g64 / int4-g128 pick the group) | bnb-int8 | bnb-nf4 | gguf.
- int8: per-output-channel symmetric scales, w = q * scale.
- int4: group-wise asymmetric, two values packed per byte, w = (q - 8) * scale + zero (llmd.kernels.quant_matmul).
- gguf: a GGUF file's tensors as it has them: on a GPU Q4_0 and Q4_1 rearranged into int4 g32, every other packed
  type (on the CPU every packed type) kept as the file's blocks (llmd.kernels.gguf_blocks).

  modes.py        QuantSpec, parse_quant
  quantize.py     the int8 / int4 quantizers (clip search, least-squares refit; AWQ and GPTQ use them)
  layers.py       QuantizedLinear, Int8Linear, Int4Linear; building and filling them
  gguf_blocks.py  GGUF blocks into those layers without dequantizing
  gguf_layers.py  GGUFLinear, GGUFConcat, GGUFEmbedding: layers holding GGUF blocks of any packed type; the tied head
  mxfp4.py        a Hugging Face checkpoint's MXFP4 tensors (gpt-oss's experts) as GGUF MXFP4 block rows
  bnb.py          bitsandbytes layers
  apply.py        applying a mode while a model loads (swap in on the meta device, quantize as weights stream in)

Quantization happens while the weights stream in (`quantizing_stream`): each linear's fp weight is quantized as soon
as it is read, so the unquantized model never sits whole in memory. The names below are this package's interface.
"""

from .apply import (build_empty_quantized, linear_modules, quantize_model, quantize_tied_head, quantizing_stream,
                    swap_in_quantized)
from .gguf_blocks import gguf_raw_tensors, gguf_tensor_types, int4_from_q4, int8_from_q8_0
from .gguf_layers import GGUFConcat, GGUFEmbedding, GGUFLinear, packed_weight_bytes, tie_gguf_head
from .layers import (Int4Linear, Int8Linear, QuantizedLinear, cpu_kernel_is_fast, empty_quantized,
                     fill_from_weight, fill_int4, quantize_linear, quantized_weight_bytes)
from .modes import DEFAULT_INT4_GROUP, QuantSpec, parse_quant
from .mxfp4 import mxfp4_blocks_from_hf
from .quantize import fit_int4_grid, quantize_int4, quantize_int8

__all__ = [
    "DEFAULT_INT4_GROUP", "GGUFConcat", "GGUFEmbedding", "GGUFLinear", "Int4Linear", "Int8Linear",
    "QuantSpec", "QuantizedLinear", "build_empty_quantized", "cpu_kernel_is_fast", "empty_quantized",
    "fill_from_weight", "fill_int4", "fit_int4_grid", "gguf_raw_tensors", "gguf_tensor_types", "int4_from_q4",
    "int8_from_q8_0", "linear_modules", "packed_weight_bytes", "parse_quant", "quantize_int4", "quantize_int8",
    "quantize_linear", "quantize_model", "quantize_tied_head", "quantized_weight_bytes", "quantizing_stream",
    "swap_in_quantized", "tie_gguf_head",
    "mxfp4_blocks_from_hf",
]
