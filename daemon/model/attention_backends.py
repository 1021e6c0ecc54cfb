"""The attention backends: how one step writes its new tokens' K/V into the paged cache and attends over it.

One backend serves a model for its whole life: the engine's ModelRunner picks it once when it loads the model
(`choose_backend`: CPU -> `CpuBackend`, CUDA with Triton kernels that pass `check_attention_backend` on this GPU ->
`TritonBackend`, else `TorchBackend`) and puts it in every `AttentionMetadata` it builds, so a draft model beside a
target has its own and nothing is switched for the process. The models call `llmd.model.attention.paged_attention`,
which hands the step to `meta.backend`.

- `TorchBackend`: the reference in torch, with all decode tokens of a step in one batched computation and the other
  sequences (prefill chunks, speculative verifies) one by one. Which path a sequence takes depends only on its own
  query length, never on the rest of the batch, so a sequence's result is the same alone or batched.
- `CpuBackend`: the compiled C calls of llmd.kernels.cpu_ops (the K/V write; all decodes of a step in one call, each
  prefill chunk in one), reading every cache type in place, windowed and soft-capped layers included; the torch code
  only where they do not apply (activations that are not fp32, a cache layout they do not read, no C compiler).
- `TritonBackend`: the Triton kernels of llmd.kernels (decode, varlen prefill); it takes no per-step value from the
  host beyond static bounds, so decode steps can be captured in CUDA graphs (`cuda_graph_safe`).

Per-layer options, passed on every call: `window` (sliding window in tokens: a query at position p sees keys at
positions > p - window), `softcap` (Gemma 2's logit soft-capping: scores -> softcap * tanh(scores / softcap)
before the softmax) and `sinks` (gpt-oss: fp32 [heads], each head's logit joining its softmax denominator). Every
backend takes all three: no path reads a block wholly before the window; the C kernels compute the softcap with a
vectorised tanh (within ~1e-6 of torch's, keeping their batch, chunk and thread invariance), the Triton kernels with a
compile-time switch (so the kernels of layers without it are unchanged) and a tanh built from exp. The sink enters
where each kernel merges its partial softmaxes (the C `combine`, the end of a Triton program or its split combine),
so without sinks every kernel computes what it did before, bit for bit.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from ..kernels import cpu_ops
from .attention import (
    AttentionMetadata,
    DecodePlan,
    KVCache,
    allocate_kv_cache,
    batched_decode_attention,
    torch_paged_attention,
    write_kv,
)
from .kv_int8 import kv_parts

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str
    cuda_graph_safe: bool  # takes no per-step value from the host (see AttentionMetadata): CUDA graphs may record it

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' K/V [T, kv_heads, d] at their cache slots."""
        ...

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, *,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, heads, d] (its K/V already written) over each sequence's context -> [T, heads, d]."""
        ...


def decode_plan(meta: AttentionMetadata) -> DecodePlan:
    """The step's DecodePlan, built on first use and shared by every layer."""
    plan = meta._decode_plan
    if plan is None:
        plan = meta._decode_plan = DecodePlan.build(meta)
    return plan


class TorchBackend:
    name = "torch"
    cuda_graph_safe = False

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, kv_cache, slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, *,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = decode_plan(meta)
        options = dict(window=window, softcap=softcap, sinks=sinks)
        if plan.block_tables.shape[0] == 0:
            return torch_paged_attention(q, kv_cache, meta, scale, **options)
        if plan.rows is None:
            return batched_decode_attention(q, kv_cache, plan, scale, **options)
        out = torch_paged_attention(q, kv_cache, meta, scale, only=plan.others, **options)
        out[plan.rows] = batched_decode_attention(q[plan.rows], kv_cache, plan, scale, **options)
        return out


class CpuBackend(TorchBackend):
    """The C calls where they apply (fp32 activations and the cache layouts cpu_ops reads), else the torch code."""

    name = "cpu"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        if not cpu_ops.write_kv(k, v, kv_cache, slot_mapping):  # one C call, any cache type
            write_kv(k, v, kv_cache, slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, *,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        if self._c_attention(q, kv_cache, meta, decode_plan(meta), scale, out, window, softcap, sinks):
            return out
        return super().attend(q, kv_cache, meta, scale, window=window, softcap=softcap, sinks=sinks)

    @staticmethod
    def _c_attention(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, plan: DecodePlan, scale: float,
                     out: torch.Tensor, window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> bool:
        """All decodes in one call, then each prefill chunk or speculative verify in one call, into `out`. False
        where the C code does not apply (`out` may then be partly written)."""
        if plan.block_tables.shape[0] and not cpu_ops.decode_attention(q, kv_cache, plan.block_tables,
                                                                        plan.seq_lens, plan.rows, scale, out, window,
                                                                        softcap, sinks):
            return False
        starts = [0]
        for n in meta.query_lens_list:
            starts.append(starts[-1] + n)
        for i in plan.others:
            rows = slice(starts[i], starts[i + 1])
            if not cpu_ops.prefill_attention(q[rows], kv_cache, meta.block_tables[i], meta.seq_lens_list[i], scale,
                                             out[rows], window, softcap, sinks):
                return False
        return True


class TritonBackend:
    """Decode-only steps run the decode kernel; steps with prefill chunks (or speculative verifies) run the varlen
    prefill kernel over the whole step, decode rows included. Decode-only steps read the per-step values only from
    tensors and take from the host only query_lens_list and max(seq_lens_list), which a captured step holds as static
    bounds: they can be captured in a CUDA graph."""

    name = "triton"
    cuda_graph_safe = True

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, kv_cache, slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, *,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return triton_paged_attention(q, kv_cache, meta, scale, window=window, softcap=softcap, sinks=sinks)


def triton_paged_attention(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
                           window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels on one step (see TritonBackend); window, softcap, sinks: the layer's options."""
    from ..kernels import paged_attention, prefill_attention

    k_cache, v_cache, k_scale, v_scale = kv_parts(kv_cache)
    if not meta.is_decode_only:
        return prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            max_query_len=max(meta.query_lens_list), k_scale=k_scale, v_scale=v_scale, window=window,
            softcap=softcap, sinks=sinks)
    return paged_attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                  max_seq_len=max(meta.seq_lens_list), k_scale=k_scale,
                                                  v_scale=v_scale, window=window, softcap=softcap, sinks=sinks)


TORCH = TorchBackend()
CPU = CpuBackend()
TRITON = TritonBackend()


def default_backend(device: torch.device | str) -> AttentionBackend:
    """The backend for metadata built without one: the C calls on the CPU where they build, else torch. (CUDA's
    Triton kernels are only chosen after `check_attention_backend`, by `choose_backend`.)"""
    if torch.device(device).type == "cpu" and cpu_ops.load() is not None:
        return CPU
    return TORCH


def check_attention_backend(backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, kv_cache_dtype: str = "auto",
                            device: str | torch.device = "cuda", windows: tuple[int, ...] = (),
                            softcap: float | None = None, sinks: bool = False) -> str | None:
    """Run `backend` once on a small paged batch of the model's head shape (a prefill chunk over a cached prefix
    beside decodes, then a decode-only step), with full attention and with each of the model's sliding `windows`,
    against the torch reference; soft-capped when the model's attention has a `softcap`, with random sink logits
    when it has `sinks`. Returns None when it agrees, else why not: a kernel that fails to compile or computes wrong
    values on this GPU is caught at startup, before it serves a request."""
    # The check's scores are about unit-sized: the model's cap (Gemma 2: 50) would leave them almost as they are and
    # a kernel that ignored it would pass. A cap they reach runs the same compiled kernel (the value is not compiled
    # in) through both branches of its tanh.
    cap = None if not softcap else min(softcap, 2.0)
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 12
    (cache,) = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kv_cache_dtype)
    slots = torch.arange(num_blocks * block_size, device=device)
    kv = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    write_kv(kv[0], kv[1], cache, slots)
    # sink logits about as large as the scores: each takes a sizeable share of its head's softmax
    head_sinks = torch.randn(num_heads, generator=gen).to(device) if sinks else None
    tables = [[3, 7, 1], [0, 5, 9, 2], [11]]
    steps = [([17, 1, 1], [45, 61, 9]), ([1, 1, 1], [46, 62, 10])]  # (query lens, context lens)
    tol = 1e-4 if dtype == torch.float32 and str(device) == "cpu" else 3e-2  # bf16/fp16 rounding, TF32 dots
    for window in (None, *windows):
        for query_lens, seq_lens in steps:
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device, backend=backend)
            q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
            try:
                got = backend.attend(q, cache, meta, head_dim ** -0.5, window=window, softcap=cap, sinks=head_sinks)
            except Exception as e:  # a compile or launch failure on this GPU
                return f"{type(e).__name__}: {e}"
            want = torch_paged_attention(q, cache, meta, head_dim ** -0.5, window=window, softcap=cap,
                                         sinks=head_sinks)
            err = (got.float() - want.float()).abs().max().item()
            if not err <= tol:  # also catches NaN
                return (f"max |difference| from the torch reference {err:.3g} > {tol:g} (query lens {query_lens}, "
                        f"window {window}, softcap {cap}, sinks {sinks})")
    return None


def choose_backend(device: torch.device, model_config=None, dtype: torch.dtype = torch.bfloat16,
                   kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend a model serves with on `device`. On CUDA: the Triton kernels when Triton is present and, given the
    model's config, they pass `check_attention_backend` on this GPU for its head shape; otherwise torch, with the
    reason logged."""
    if device.type != "cuda":
        return default_backend(device)
    import llmd.kernels as kernels

    if not kernels.available():
        return TORCH
    if model_config is not None:
        c = model_config
        windows = tuple(sorted({w for w in getattr(c, "layer_windows", ()) if w is not None}))
        # every head shape the model's layers have (Gemma 4's global layers are wider)
        shapes = sorted({(c.layer_num_kv_heads(i), c.layer_head_dim(i)) for i in c.kv_layers})
        for kv_heads, head_dim in shapes:
            problem = check_attention_backend(TRITON, c.num_attention_heads, kv_heads, head_dim, dtype,
                                              kv_cache_dtype, device=device, windows=windows,
                                              softcap=getattr(c, "attn_logit_softcapping", None),
                                              sinks=getattr(c, "attention_sinks", False))
            if problem is not None:
                log.warning("Triton attention disabled, the torch path serves instead: %s", problem)
                return TORCH
    return TRITON
