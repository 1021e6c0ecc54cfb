"""All decoder layers of a quantized model in one C call on the CPU (llmd.kernels.cpu_stack).

The C code makes, layer by layer, the same kernel calls with the same arguments as the module path of llmd.model.llama
(each of which already runs in C on the CPU), so the hidden states are bit for bit the same; it only removes the
Python between them, about a third of a small model's decode step at batch 1.

It applies to Llama-shaped models (no q/k norm, no partial rotary; sliding windows included) and to Gemma 2 and 3
(llmd.model.gemma, `cpu_stack_kind = "gemma"`: sandwich norms, GELU-tanh; Gemma 3's q/k norms and local RoPE tables,
Gemma 2's soft-capped attention, `Layer.softcap`; Gemma 2's final logit soft-cap stays in `compute_logits`, outside the
layers) whose fused qkv, o, gate/up and down projections are int8 or int4 layers or packed GGUF layers (one type, or a
GGUFConcat of several) with a prepared CPU kernel (on either matmul path, as LLMD_CPU_GEMM_ACT chose it), with fp32
activations and a KV cache the C attention reads (fp32, fp16, bf16 or int8). Gemma 4's dense layers run too
(llmd.model.gemma4, `cpu_stack_kind = "gemma4"`; the C code's gemma4_stack): q, k, v, gate and up apart, each layer's
head shape and MLP width, KV-sharing layers, the per-layer inputs (computed before the stack, by `embed`) and the
layers' scalars; every projection, the per-layer input gate and projection included, must have a compiled kernel, and
a model with MoE blocks (26B-A4B) keeps its modules. Everything else (fp32 or bitsandbytes weights, Qwen3, attention
sinks, MoE, CUDA, LLMD_CPU_GEMM=0) keeps the module path. A step with two KV groups (a model
mixing window and global layers: `meta.window_group`) runs too: each window layer writes and reads its own group's pool
through its slots and tables (`Step.window`), as paged_attention picks them, and the two pools may differ in size. The
engine's runner builds a `CompiledCpuForward` once, when its attention backend is the CPU one, and calls it instead of
the model.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from ..kernels import cpu_gemm, cpu_ops
from ..kernels import cpu_stack as ck
from .attention import AttentionMetadata
from .attention_backends import decode_plan
from .quant import QuantizedLinear


class CpuLayerStack:
    """A model's layers as C structures, with references that keep every pointer in them alive."""

    def __init__(self, lib, dims: ck.Dims, layers: ctypes.Array, linears: list, norms: list,
                 rope_dims: dict[str, int] | None = None):
        self.lib, self.dims, self.layers = lib, dims, layers
        self._linears = linears  # (module, its prepared kernel): the kernels whose weights the C code reads
        self._norms = norms  # (RMSNorm, its weight)
        # Gemma 4: each layer kind's head size (its RoPE tables' width); None: every table is dims.head_dim wide
        self.rope_dims = rope_dims
        # each layer's cache shape (KV heads, head size): Gemma 4's differ from layer to layer
        self.kv_shapes = [(layer.kv_heads, layer.head_dim) for layer in layers] if dims.gemma4 \
            else [(dims.kv_heads, dims.head_dim)] * len(layers)
        self._caches: list = []  # weak references to the KV cache tensors whose pointers `layers` holds
        self.block_size = 0
        self.steps = 0  # steps the C code ran (the rest fell back to the modules): for tests and benchmarks
        self._lock = threading.Lock()  # two threads running the model on different caches must not mix pointers

    @classmethod
    def build(cls, model) -> "CpuLayerStack | None":
        """The stack for `model` (a llmd.model.llama.CausalLM), or None where it does not apply."""
        lib = ck.load()
        config = model.config
        if lib is None:
            return None
        kind = getattr(model, "cpu_stack_kind", "llama")
        if kind == "gemma":
            return cls._build_gemma(lib, model)
        if kind == "gemma4":
            return cls._build_gemma4(lib, model)
        if config.qk_norm or config.rotary_dim != config.head_dim:  # the C RoPE rotates whole heads
            return None
        if config.moe is not None:  # the C stack has dense MLPs only: MoE blocks run as modules
            return None
        layers = (ck.Layer * len(model.model.layers))()
        linears, norms = [], []
        for layer, c_layer in zip(model.model.layers, layers):
            attn = layer.self_attn
            if getattr(attn, "sinks", None) is not None or not _bind_projections(layer, c_layer, linears):
                return None
            c_layer.window = attn.window or 0  # each layer's sliding window (0: none)
            c_layer.softcap = attn.softcap or 0.0  # its attention logit soft-cap (0: none)
            for name, norm in (("input_norm", layer.input_layernorm), ("post_norm", layer.post_attention_layernorm)):
                if not _bind_norm(c_layer, name, norm, norm.weight, config.rms_norm_eps, norms):
                    return None
        c = config
        dims = ck.Dims(num_layers=len(layers), hidden=c.hidden_size, heads=c.num_attention_heads,
                       kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                       eps=c.rms_norm_eps, scale=model.model.layers[0].self_attn.scale)
        return cls(lib, dims, layers, linears, norms)

    @classmethod
    def _build_gemma(cls, lib, model) -> "CpuLayerStack | None":
        """Gemma 2's and 3's layers (llmd.model.gemma): the same projections, with the fp32 (1 + weight) multipliers
        of its norms, sandwich norms and GELU-tanh; Gemma 3's q/k norms and the local RoPE tables of its sliding
        layers; Gemma 2's soft-capped attention (q and k rotated as one view, as the modules do)."""
        config = model.config
        layers = (ck.Layer * len(model.model.layers))()
        linears, norms = [], []
        local = model.model.rotary_emb.sliding is not None
        for layer, c_layer in zip(model.model.layers, layers, strict=True):
            attn = layer.self_attn
            if not _bind_projections(layer, c_layer, linears):
                return None
            c_layer.window = attn.window or 0
            c_layer.softcap = attn.softcap or 0.0
            c_layer.local_rope = int(local and attn.window is not None)
            for name, norm in (("input_norm", layer.input_layernorm), ("post_norm", layer.pre_feedforward_layernorm),
                               ("attn_out_norm", layer.post_attention_layernorm),
                               ("mlp_out_norm", layer.post_feedforward_layernorm),
                               ("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
                if norm is None:
                    continue
                if norm.scale is None:
                    norm.prepare()
                if not _bind_norm(c_layer, name, norm, norm.scale, config.rms_norm_eps, norms):
                    return None
        c = config
        dims = ck.Dims(num_layers=len(layers), hidden=c.hidden_size, heads=c.num_attention_heads,
                       kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                       eps=c.rms_norm_eps, scale=model.model.layers[0].self_attn.scale, act=ck.ACTS["gelu_tanh"])
        return cls(lib, dims, layers, linears, norms)

    @classmethod
    def _build_gemma4(cls, lib, model) -> "CpuLayerStack | None":
        """Gemma 4's dense layers (llmd.model.gemma4; a model with MoE blocks keeps its modules): q, k, v, gate and up
        apart, each layer's head shape and MLP width, KV-sharing layers, the per-layer input block and the output
        scalar (see the C code's gemma4_stack)."""
        from .gemma4 import FULL

        config = model.config
        if config.moe is not None:
            return None
        layers = (ck.Layer * len(model.model.layers))()
        linears: list = []
        norms: list = []
        eps, cpu = config.rms_norm_eps, torch.device("cpu")
        rope_dims: dict[str, int] = {}
        for layer, c_layer in zip(model.model.layers, layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            scalar = layer.layer_scalar
            if layer.has_moe or scalar.dtype is not torch.float32 or scalar.numel() != 1:
                return None
            projections = [("qkv", attn.q_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_proj), ("up", mlp.up_proj),
                           ("down", mlp.down_proj)]
            norm_list = [("input_norm", layer.input_layernorm, None), ("q_norm", attn.q_norm, None),
                         ("attn_out_norm", layer.post_attention_layernorm, None),
                         ("post_norm", layer.pre_feedforward_layernorm, None),
                         ("mlp_out_norm", layer.post_feedforward_layernorm, None)]
            if not attn.shares_kv:
                projections += [("k", attn.k_proj)] + ([] if attn.v_proj is None else [("v", attn.v_proj)])
                norm_list += [("k_norm", attn.k_norm, None), ("v_norm", attn.v_norm, attn.v_norm.ones(cpu))]
            if layer.per_layer:
                projections += [("ple_gate", layer.per_layer_input_gate), ("ple_proj", layer.per_layer_projection)]
                norm_list.append(("ple_norm", layer.post_per_layer_input_norm, None))
            if not _bind_linears(c_layer, projections, linears):
                return None
            for name, norm, w in norm_list:
                if not _bind_norm(c_layer, name, norm, norm.weight if w is None else w, eps, norms):
                    return None
            c_layer.window = attn.window or 0
            c_layer.local_rope = int(attn.kind != FULL)
            c_layer.head_dim, c_layer.kv_heads = attn.head_dim, attn.num_kv_heads
            c_layer.intermediate = mlp.gate_proj.out_features
            c_layer.kv_shared = int(attn.shares_kv)
            c_layer.scalar = float(scalar)  # an fp32 value: exact as a C float
            rope_dims[attn.kind] = attn.head_dim
        c = config
        dims = ck.Dims(num_layers=len(layers), hidden=c.hidden_size, heads=c.num_attention_heads,
                       kv_heads=max(layer.kv_heads for layer in layers),
                       head_dim=max(layer.head_dim for layer in layers),
                       intermediate=max(layer.intermediate for layer in layers), eps=c.rms_norm_eps, scale=1.0,
                       act=ck.ACTS["gelu_tanh"], gemma4=1, ple=c.gemma4.per_layer_input_size or 0)
        return cls(lib, dims, layers, linears, norms, rope_dims)

    def _bind_caches(self, kv_caches: list) -> bool:
        """Point the layers at these caches: one per layer, all of one type and block size, each of its layer's head
        shape and one the C attention reads ((k, v) in fp32/fp16/bf16, or an int8 cache with its scales). Their
        numbers of blocks may differ (the pools of two KV groups): the C code checks each layer's block ids against
        its own cache. (A Gemma 4 layer that shares K/V is given the cache it reads.)"""
        self._caches = []
        if len(kv_caches) != self.dims.num_layers:
            return False
        views = [cpu_ops.kv_view(c) if isinstance(c, tuple) else None for c in kv_caches]
        first = views[0]
        if first is None:
            return False
        key = (first.dtype, first.block_size)
        if any(v is None or (v.dtype, v.block_size) != key or (v.kv_heads, v.d) != shape
               for v, shape in zip(views, self.kv_shapes)):
            return False
        for c_layer, view in zip(self.layers, views):
            c_layer.kv = view
        self.block_size = first.block_size
        # weak: the stack lives with the model and must not keep an engine's KV pool alive after the engine
        self._caches = [tuple(weakref.ref(t) for t in c) for c in kv_caches]
        return True

    def _bound_to(self, kv_caches: list) -> bool:
        return len(kv_caches) == len(self._caches) and all(
            len(refs) == len(c) and all(r() is t for r, t in zip(refs, c)) for refs, c in zip(self._caches, kv_caches))

    def forward(self, x: torch.Tensor, inputs: tuple, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Run every layer on x [T, hidden] in place; False (x untouched) where the stack does not apply.
        inputs: what the model's `embed` gave beside x: the RoPE tables (cos, sin), or Gemma's dicts of them per layer
        type (llmd.model.gemma); Gemma 4's tables per layer kind and per-layer inputs (llmd.model.gemma4)."""
        with self._lock:
            if self.rope_dims is not None:
                return self._forward_gemma4(x, *inputs, kv_caches, meta)
            return self._forward(x, *inputs, kv_caches, meta)

    def _forward_gemma4(self, x, rope: dict, per_layer: torch.Tensor | None, kv_caches, meta) -> bool:
        from .gemma4 import FULL

        assert self.rope_dims is not None
        if not self._bound_to(kv_caches) and not self._bind_caches(kv_caches):
            return False
        t, d = x.shape[0], self.dims
        for kind, width in self.rope_dims.items():
            if kind not in rope or any(not c.is_contiguous() or c.dtype is not torch.float32 or c.numel() != t * width
                                       for c in rope[kind]):
                return False
        if d.ple and (per_layer is None or per_layer.dtype is not torch.float32 or not per_layer.is_contiguous()
                      or tuple(per_layer.shape) != (t, d.num_layers, d.ple)):
            return False
        groups = [meta] if meta.window_group is None else [meta, meta.window_group]
        if any(g.block_size != self.block_size or g.slot_mapping.numel() != t for g in groups):
            return False
        step = _step(meta, t)
        for kind, (cos, sin) in rope.items():
            if kind == FULL:
                step.cos, step.ssin = cos.data_ptr(), sin.data_ptr()
            else:
                step.cos_local, step.ssin_local = cos.data_ptr(), sin.data_ptr()
        if d.ple:
            step.per_layer = per_layer.data_ptr()
        window = None
        if meta.window_group is not None:
            window = _step(meta.window_group, t)
            step.window = ctypes.addressof(window)
        ck.run(self.lib, d, self.layers, step, x.data_ptr(), torch.get_num_threads())
        self.steps += 1
        return True

    def _forward(self, x, cos, sin, kv_caches, meta) -> bool:
        if not self._bound_to(kv_caches) and not self._bind_caches(kv_caches):
            return False
        t = x.shape[0]
        local = None
        if isinstance(cos, dict):  # Gemma: the global tables, and the sliding layers' own
            local = (cos["sliding_attention"], sin["sliding_attention"])
            cos, sin = cos["full_attention"], sin["full_attention"]
        tables = [cos, sin] + list(local or ())
        groups = [meta] if meta.window_group is None else [meta, meta.window_group]
        if any(g.block_size != self.block_size or g.slot_mapping.numel() != t for g in groups) \
                or not all(c.is_contiguous() for c in tables) or any(c.numel() != t * self.dims.head_dim for c in tables):
            return False
        step = _step(meta, t)
        step.cos, step.ssin = cos.data_ptr(), sin.data_ptr()
        if local is not None:
            step.cos_local, step.ssin_local = local[0].data_ptr(), local[1].data_ptr()
        window = None
        if meta.window_group is not None:  # the window layers' own KV group: its slots and tables (C: step.window)
            window = _step(meta.window_group, t)
            step.window = ctypes.addressof(window)
        ck.run(self.lib, self.dims, self.layers, step, x.data_ptr(), torch.get_num_threads())
        self.steps += 1
        return True


def _step(meta: AttentionMetadata, t: int) -> ck.Step:
    """The C description of one KV group's part of a step: its slots, decode plan and chunk tables. The tensors it
    points into belong to `meta` (and its cached decode plan), which outlives the C call."""
    plan = decode_plan(meta)  # the same plan the CPU attention backend uses
    step = ck.Step(T=t, slots=meta.slot_mapping.data_ptr())
    if plan.block_tables.shape[0]:
        step.num_decodes = plan.block_tables.shape[0]
        step.decode_rows = None if plan.rows is None else plan.rows.data_ptr()
        step.decode_tables, step.decode_lens = plan.block_tables.data_ptr(), plan.seq_lens.data_ptr()
        step.decode_stride = plan.block_tables.shape[1]
    if plan.others:
        chunks = _chunks(meta, plan.others)
        step._chunks = chunks  # kept alive with the step
        tables = meta.block_tables
        step.num_chunks, step.chunks = len(plan.others), chunks.data_ptr()
        step.chunk_tables, step.num_tables, step.chunk_stride = tables.data_ptr(), tables.shape[0], tables.shape[1]
    return step


def _bind_projections(layer, c_layer, linears: list) -> bool:
    """The layer's four fused projections into its C structure (False: one has no compiled CPU kernel)."""
    attn, mlp = layer.self_attn, layer.mlp
    return _bind_linears(c_layer, [("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                   ("down", mlp.down_proj)], linears)


def _bind_linears(c_layer, projections: list, linears: list) -> bool:
    """(field, module) pairs into the C structure (False: a module has no compiled CPU kernel)."""
    for name, module in projections:
        linear = _linear(module)
        if linear is None:
            return False
        setattr(c_layer, name, linear)
        linears.append((module, module.kernel))
    return True


def _bind_norm(c_layer, name: str, norm, w: torch.Tensor, eps: float, norms: list) -> bool:
    """A norm's fp32 multiplier `w` into the C structure (False: not one the C code reads, or another eps)."""
    if w.dtype is not torch.float32 or not w.is_cpu or not w.is_contiguous() or norm.eps != eps:
        return False
    setattr(c_layer, name, w.data_ptr())
    norms.append((norm, w))
    return True


def _linear(module) -> ck.Linear | None:
    """The C structure of a quantized layer whose prepared kernel is a compiled CPU one, else None."""
    if not isinstance(module, QuantizedLinear):
        return None
    bias = module.bias
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu or not bias.is_contiguous()):
        return None
    if module.kernel is None or module.kernel_dtype is not torch.float32:
        module.prepare(torch.device("cpu"), torch.float32)
    kernel = module.kernel
    if isinstance(kernel, cpu_gemm.GGUFKernel):  # packed GGUF blocks: the kernel's parts array (one or more)
        return ck.Linear(kind=ck.KINDS["gguf", kernel.act], n=kernel.n, k=kernel.k, group=len(kernel.parts),
                         q=kernel.parts_pointer, s=None, z=None, bias=None if bias is None else bias.data_ptr())
    if not isinstance(kernel, cpu_gemm.LayerKernel):
        return None
    kind = kernel.kind
    ptrs = kernel.weight_pointers
    return ck.Linear(kind=ck.KINDS[kind, kernel.act], n=kernel.n, k=kernel.k, group=kernel.group_size, q=ptrs[0],
                     s=ptrs[1], z=ptrs[2] if kind == "int4" else None,
                     bias=None if bias is None else bias.data_ptr())


def _chunks(meta: AttentionMetadata, others: list[int]) -> torch.Tensor:
    """[len(others), 4] long: each chunk's first row, rows, context length and block-table index."""
    starts = [0]
    for n in meta.query_lens_list:
        starts.append(starts[-1] + n)
    return torch.tensor([[starts[i], meta.query_lens_list[i], meta.seq_lens_list[i], i] for i in others],
                        dtype=torch.long)


class CompiledCpuForward:
    """`CausalLM.forward` with the decoder layers run by a CpuLayerStack: embeddings, then all layers in one C call,
    then the final norm. A step the stack does not take (a KV cache the C attention does not read, activations that
    are not fp32) runs the model's modules instead, so it is a drop-in for `model(...)`.

    Built once, by the engine's runner, for a model whose weights no longer change: the stack keeps the layers'
    prepared kernels (and so their weights) alive, and never checks them again."""

    def __init__(self, model, stack: CpuLayerStack):
        self.model, self.stack = model, stack

    @classmethod
    def try_build(cls, model) -> "CompiledCpuForward | None":
        """The compiled forward of `model` (a llmd.model.llama.CausalLM on the CPU), or None where the stack does
        not apply (see llmd.model.llama's docstring)."""
        param = next(model.parameters(), None)
        if param is None or not param.is_cpu or not hasattr(model, "run_layers"):
            return None
        stack = CpuLayerStack.build(model)
        return None if stack is None else cls(model, stack)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        x, *inputs = model.embed(input_ids, positions, meta)  # inputs: what the layers take beside x
        if meta.bidirectional or not (x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()
                                      and not x.requires_grad and self.stack.forward(x, inputs, kv_caches, meta)):
            # in place, one C call; a chunk with an image whose tokens see each other runs the modules
            x = model.run_layers(x, *inputs, kv_caches, meta)
        return model.model.norm(x)
