"""Layers that keep GGUF tensors packed: a linear layer, an embedding table and the tied output head.

A GGUF weight of any type in llmd.kernels.gguf_blocks (Q4_K, Q5_K, Q6_K, Q5_0/1, IQ4, Q2_K/Q3_K, ...) stays the
file's own block bytes, uint8 [N, row bytes], beside its GGML type name: resident bytes are the file's. Matmuls:
- CPU, fp32 activations: the compiled kernel (llmd.kernels.cpu_gemm.gguf_kernel) when it builds here, by default on
  the integer path (activations quantized to int8 as llama.cpp does; LLMD_CPU_GEMM_ACT=fp32: the exact weights);
- CUDA with Triton: the fused dequantize + matmul kernels of llmd.kernels.gguf_matmul;
- otherwise (no C compiler, other dtypes): the rows of the weight are dequantized with the torch reference in
  bounded chunks per call and multiplied, so no fp32 copy is ever kept.
On a GPU, Q4_0 and Q4_1 linear layers load into llmd's int4 layers instead (an exact byte rearrangement,
llmd.model.quant.gguf_blocks), whose tuned kernels they share with --quant int4; a tied token table of any type
(Q8_0 included) is also the head (tie_gguf_head).
The parts of a fused projection (q/k/v, gate/up) that differ in type, as Q4_K_M files have them (attn_v Q6_K next to
Q4_K), load into a GGUFConcat of one GGUFLinear each, so the model and the C layer stack see one matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from llmd.kernels import cpu_gemm
from llmd.kernels import gguf_blocks as gb

from ...errors import ModelFileError
from ..host_table import HostResident
from .layers import LinearKernel, QuantizedLinear, c_kernel, use_triton

_CHUNK_ELEMENTS = 1 << 22  # weights dequantized at a time by the torch path (16 MiB of fp32)


def _chunk_rows(k: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, k))


class GGUFLinear(QuantizedLinear):
    """[..., in_features] -> [..., out_features] with the weight kept as GGUF blocks (`qweight`, uint8
    [out, row bytes]) of `type_name`."""

    def __init__(self, in_features: int, out_features: int, type_name: str, bias: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        elems = gb.block_shape(type_name)[0]
        super().__init__(in_features, out_features, bias, elems, dtype, device)
        self.type_name = self.file_type = type_name  # type_name: the blocks' layout now (set_layout)
        self.output_head = False  # the model's output head (set by the loader): its CPU kernel takes finer activations
        self.shared_blocks = False  # its blocks are also read elsewhere in the file's layout (an expert's view)
        self.register_buffer("qweight", torch.empty(out_features, gb.row_bytes(type_name, in_features),
                                                    dtype=torch.uint8, device=device))

    def fill(self, blocks: torch.Tensor, name: str, source, rows: slice | None = None) -> None:
        """Copy a tensor's block rows in (into `rows`: a part of a fused projection), after checking they are this
        layer's shape (ModelFileError if not)."""
        if self.type_name in gb.X8_OF:  # an interleaved GGUFLinear: the rows come in the file's layout
            self.set_layout(self.file_type)
        dest = self.qweight if rows is None else self.qweight[rows]
        if tuple(blocks.shape) != tuple(dest.shape):
            raise ModelFileError(source, f"tensor {name!r} ({self.type_name}) has {tuple(blocks.shape)} block bytes, "
                                         f"expected {tuple(dest.shape)} for [{dest.shape[0]}, "
                                         f"{self.in_features}]")
        dest.copy_(blocks)
        if isinstance(self, QuantizedLinear):
            self.unprepare()

    def dequantized_weight(self) -> torch.Tensor:
        return gb.dequantize_blocks(self.qweight, self.type_name)

    def _choose_kernel(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        if device.type != "cpu":
            self.set_layout(self.file_type)
        qweight, type_name, k = self.qweight, self.type_name, self.in_features
        if use_triton(device):
            from llmd.kernels.gguf_matmul import gguf_matmul

            return lambda x: gguf_matmul(x, qweight, type_name, k)
        if device.type == "cpu":
            c = c_kernel(dtype, lambda: cpu_gemm.gguf_kernel(self.cpu_parts(), k, head=self.output_head))
            if c is not None:
                return c
        return self._chunked

    def set_layout(self, type_name: str) -> None:
        """Rearrange the blocks in place into `type_name`'s layout: the file's type, or the CPU integer path's
        interleaved one (gguf_blocks.X8_OF); the same bits either way."""
        if type_name == self.type_name:
            return
        if type_name in gb.X8_OF:
            cpu_gemm.x8_pack_(self.qweight, type_name)
        else:
            self.qweight.copy_(gb.x8_unpack(self.qweight, self.type_name))
        self.type_name = type_name

    def cpu_parts(self) -> list[tuple[torch.Tensor, str]]:
        """The CPU kernel's part for this layer, its blocks first interleaved where the kernel's integer path has a
        layout for them (an output head's table too: a tied embedding reads its rows from either layout; not an
        expert's view, whose blocks the fused MoE kernel reads in the file's)."""
        layout = None if self.shared_blocks else \
            cpu_gemm.interleaved_type(self.file_type, self.out_features, self.in_features, head=self.output_head)
        self.set_layout(layout or self.file_type)
        return [(self.qweight, self.type_name)]

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W dequantized a bounded chunk of output rows at a time (the torch path)."""
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        step = -(-_chunk_rows(self.in_features) // 8) * 8  # whole groups of 8 rows (an interleaved layout's unit)
        for start in range(0, self.out_features, step):
            rows = slice(start, min(self.out_features, start + step))
            w = gb.dequantize_blocks(self.qweight[rows], self.type_name).to(x.dtype)
            y[:, rows] = torch.matmul(x, w.t())
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, type={self.type_name}"


class GGUFConcat(QuantizedLinear):
    """GGUFLinears of different types computing side by side on one input (a fused q/k/v or gate/up): each part keeps
    its own blocks and type, and its outputs are its own matmul's, column for column."""

    def __init__(self, layers: list[GGUFLinear]):
        first = layers[0]
        super().__init__(first.in_features, sum(m.out_features for m in layers), first.bias is not None, 0,
                         device="meta")
        biases = [m.bias for m in layers]
        for part in layers:
            part.bias = None  # added once, after the parts' outputs are side by side
        if biases[0] is not None:
            self.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
        self.parts = nn.ModuleList(layers)

    def _choose_kernel(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        if device.type == "cpu":  # one C call fills every part's columns
            c = c_kernel(dtype, lambda: cpu_gemm.gguf_kernel([q for p in self.parts for q in p.cpu_parts()],
                                                             self.in_features))
            if c is not None:
                return c
        kernels = [p.prepare(device, dtype) for p in self.parts]
        return lambda x: torch.cat([kernel(x) for kernel in kernels], dim=-1)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self.parts])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={[p.type_name for p in self.parts]}"


class GGUFEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks ([vocab, row bytes]); the looked-up rows are dequantized (exactly the
    file's values) and cast to `dtype`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, type_name: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.type_name, self.dtype = \
            num_embeddings, embedding_dim, type_name, dtype
        self.register_buffer("qweight", torch.empty(num_embeddings, gb.row_bytes(type_name, embedding_dim),
                                                    dtype=torch.uint8, device=device))
        self.head: list[GGUFLinear] = []  # the tied head sharing `qweight`, if any (a list: not a submodule)

    fill = GGUFLinear.fill

    @property
    def out_features(self) -> int:  # for fill's message
        return self.num_embeddings

    @property
    def in_features(self) -> int:
        return self.embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        layout = self.head[0].type_name if self.head else self.type_name  # a tied head may have interleaved the table
        picked = cpu_gemm.x8_rows(self.qweight, ids, layout) if layout in gb.X8_OF else self.qweight.index_select(0, ids)
        rows = cpu_gemm.gguf_dequantize(picked, self.type_name) if picked.is_cpu else None  # C where it builds
        if rows is None:
            rows = gb.dequantize_blocks(picked, self.type_name)
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.type_name}"


class HostGGUFEmbedding(HostResident, GGUFEmbedding):
    """A GGUFEmbedding that stays in host memory (llmd.model.host_table): the looked-up rows are dequantized on the
    CPU and only they are copied to the device."""


def tie_gguf_head(model: nn.Module, dtype: torch.dtype) -> bool:
    """A tied model whose token table stayed packed (GGUFEmbedding) gets its output head from that very table: a
    GGUFLinear sharing the table's bytes, so the table is held once, as the file's blocks. Q8_0 too: an int8 head
    rearranged from it would cost 1.06x the bytes (fp32 scales) for about 5% more speed on one row.
    Returns whether it tied a head."""
    emb = model.model.embed_tokens
    if getattr(model, "lm_head", "untied") is not None or not isinstance(emb, GGUFEmbedding):
        return False
    head = GGUFLinear(emb.embedding_dim, emb.num_embeddings, emb.type_name, bias=False, device="meta")
    head.qweight = emb.qweight  # shared: the table is held once
    emb.head = [head]
    model.lm_head = head
    return True


def packed_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the packed GGUF weights by the file's type (shared tables counted once)."""
    from .gguf_experts import ExpertBlocks

    seen, out = set(), {}
    for module in model.modules():
        if isinstance(module, (GGUFLinear, GGUFEmbedding, ExpertBlocks)):
            t = module.qweight
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            type_name = getattr(module, "file_type", module.type_name)  # an interleaved layout counts as its type
            out[type_name] = out.get(type_name, 0) + t.numel()
    return out


def dequantized_linear(layer: GGUFLinear) -> nn.Linear:
    """An fp32 nn.Linear with the layer's exact weight values (tests and the quality script compare against it)."""
    lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    lin.weight = nn.Parameter(layer.dequantized_weight(), requires_grad=False)
    if layer.bias is not None:
        lin.bias = nn.Parameter(layer.bias.detach().to(torch.float32), requires_grad=False)
    return lin


def embedding_dequantized(emb: GGUFEmbedding) -> torch.Tensor:
    return gb.dequantize_blocks(emb.qweight, emb.type_name)

