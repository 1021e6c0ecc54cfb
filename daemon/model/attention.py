"""Attention over a paged KV cache: the one seam between the models and the engine.

Every model layer calls `paged_attention(q, k, v, kv_cache, meta, scale, window=..., softcap=..., sinks=...)`. The
engine builds one `AttentionMetadata` per step
for the whole flattened batch (decodes and prefill chunks mixed). K/V of the new tokens are written in place through
`slot_mapping`; attention then reads each sequence's context through its block table.

Cache layout, per layer: a pair (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim], in the
model's dtype ("auto") or in fp32/fp16/bf16 (kv_cache_dtype "fp32", "fp16", "bf16"); or, with "int8", an
`Int8KVCache` (llmd.model.kv_int8): int8 values in that layout plus a per-token, per-head scale. Readers turn any of
them into values through `kv_int8.gather_blocks`. Slot s lives at block s // block_size, offset s % block_size.

Sliding window (a per-layer option, `window=W`; Mistral, Gemma 2/3's local layers): a query at position p attends
to the keys at positions (p - W, p], as transformers does. No path reads a block that lies wholly before the window
of the earliest query it computes, so the engine may free or reuse those blocks (a block table keeps their places,
with any valid id in them: llmd.engine.block_manager). A model that mixes window and global layers keeps its window
layers' K/V in a pool of their own: the step's metadata for them is `window_group`.

Attention sinks (a per-layer option, `sinks`: gpt-oss): a learned logit per query head joins each query's softmax
denominator and contributes no value, p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)), with m the largest
of the scores and the sink, as transformers' gpt_oss eager attention computes it (`softmax_with_sinks`).

How K/V are written and attention computed is the step's `AttentionBackend` (llmd.model.attention_backends: torch,
the CPU's C calls, or Triton), chosen once by the engine's ModelRunner and carried in the metadata; the torch
functions here are the reference and the torch backend's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .huge_pages import huge_page_tensors
from .kv_int8 import KV_CACHE_DTYPES, Int8KVCache, allocate_int8, cache_dtype, gather_blocks, kv_parts, write_int8

if TYPE_CHECKING:
    from .attention_backends import AttentionBackend
    from .recurrent import StateMetadata

KVCache = tuple[torch.Tensor, torch.Tensor] | Int8KVCache


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of T new tokens belonging to B sequences (sequence order = token order)."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] long: offsets of each sequence's new tokens in the flat batch
    seq_lens: torch.Tensor  # [B] long: context length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] long: block ids, padded with 0
    block_size: int
    # Python copies of the small per-sequence values, so the torch path needs no device->host syncs. In a step
    # captured in a CUDA graph (llmd.engine.cuda_graphs) seq_lens_list holds a static upper bound (max_model_len)
    # for every row, since the graph is replayed with other lengths: only backends marked `cuda_graph_safe` (they
    # take nothing else per step from the host) run there.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # How this step writes K/V and attends: the runner's backend (build() without one: the device's default)
    backend: "AttentionBackend" = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    # Built on first use by the batched decode path and shared by every layer of the step.
    _decode_plan: "DecodePlan | None" = field(default=None, repr=False, compare=False)
    # In a model that mixes sliding-window and global layers, the window layers keep their K/V in a pool of their
    # own (llmd.engine.runner): the same step over their block tables. paged_attention picks it for window layers.
    window_group: "AttentionMetadata | None" = field(default=None, repr=False, compare=False)
    # In a hybrid model (llmd.model.recurrent): each sequence's state slot, for the recurrent layers
    state: "StateMetadata | None" = field(default=None, repr=False, compare=False)
    # Images (llmd.model.vision): the flat rows whose input embeddings an image gives, and those embeddings (with
    # Qwen3-VL's DeepStack features after them: [rows, hidden * (1 + config.deepstack_layers)]); and, for
    # Gemma's images whose tokens attend to each other both ways, each such sequence's spans (positions [start, end))
    input_embeds: "tuple[torch.Tensor, torch.Tensor] | None" = field(default=None, repr=False, compare=False)
    bidirectional: "dict[int, list[tuple[int, int]]] | None" = field(default=None, repr=False, compare=False)
    # ... those spans bounded by a sliding layer's window too (Gemma 4; Gemma 3's see each other past it)
    bidirectional_in_window: bool = field(default=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: "AttentionBackend | None" = None,
    ) -> "AttentionMetadata":
        """Metadata for sequences whose new tokens occupy positions [seq_len - query_len, seq_len). backend: the
        step's attention backend (None: llmd.model.attention_backends.default_backend for the device)."""
        if backend is None:
            from .attention_backends import default_backend

            backend = default_backend(device)
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            slot_mapping=torch.tensor(slots, **as_long),
            query_start_loc=torch.tensor(starts, **as_long),
            seq_lens=torch.tensor(seq_lens, **as_long),
            block_tables=torch.tensor(padded, **as_long),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            backend=backend,
        )


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots (quantized for an int8 cache)."""
    if isinstance(kv_cache, Int8KVCache):
        write_int8(k, v, kv_cache, slot_mapping)
        return
    k_cache, v_cache = kv_cache
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(
    kv_cache: KVCache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V at positions [start', seq_len) as `dtype`, [seq_len - start', kv_heads, head_dim]
    each, where start' = start rounded down to its block (whole blocks are gathered). Returns (k, v)."""
    k_cache, v_cache, k_scale, v_scale = kv_parts(kv_cache)
    block_size = k_cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    first = start // block_size
    ids = block_table[first:n_blocks]
    n = seq_len - first * block_size
    k = gather_blocks(k_cache, k_scale, ids, dtype).flatten(0, 1)[:n]
    v = gather_blocks(v_cache, v_scale, ids, dtype).flatten(0, 1)[:n]
    return k, v


def window_start(seq_len: int, q_len: int, window: int | None) -> int:
    """The first context position any of a chunk's queries (positions seq_len - q_len .. seq_len - 1) attends to."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of `scores`, with `sinks` (broadcastable to scores[..., :1]: each row's head's sink
    logit) joining each row's denominator; None: the plain softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def torch_paged_attention(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, only: list[int] | None = None,
    *, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention for q [T, heads, head_dim] whose K/V are already in the cache. Returns [T, heads, head_dim].

    Each sequence's queries sit at the end of its context, so query i of a chunk of length L attends to the
    first seq_len - L + i + 1 context tokens (causal, including cached prefix blocks), or with a `window` W only to
    the last W of them. `only`: compute just these sequences (the other rows of the result are left uninitialised).
    window / softcap / sinks: see `paged_attention`.
    """
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    start = 0
    wanted = None if only is None else set(only)
    spans = meta.bidirectional or {}
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len == 0 or (wanted is not None and i not in wanted):
            start += q_len
            continue
        lo = min([window_start(s_len, q_len, window)] + [a for a, _ in spans.get(i, ())])
        lo = lo // meta.block_size * meta.block_size
        k, v = gather_context(kv_cache, meta.block_tables[i], s_len, q.dtype, lo)
        group = num_heads // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qs = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, d]
        ks, vs = k.transpose(0, 1), v.transpose(0, 1)
        if q_len == 1 and window is None and softcap is None and sinks is None and i not in spans:
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        else:
            q_pos = torch.arange(s_len - q_len, s_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(lo, s_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            for lo_pos, hi_pos in spans.get(i, ()):  # an image's tokens see each other both ways (as transformers
                # overlays it: past a window too, or within it for Gemma 4)
                both = (q_pos >= lo_pos) & (q_pos < hi_pos) & (k_pos >= lo_pos) & (k_pos < hi_pos)
                if window is not None and meta.bidirectional_in_window:
                    both &= k_pos > q_pos - window
                mask |= both
            if softcap is None and sinks is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            else:
                if softcap is None:
                    scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
                else:
                    scores = torch.tanh(torch.matmul(qs, ks.transpose(-1, -2)) * (scale / softcap)) * softcap
                head_sinks = None if sinks is None else sinks.view(-1, 1, 1)
                probs = softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), head_sinks)
                o = torch.matmul(probs, vs)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


@dataclass
class DecodePlan:
    """Gather indices for all single-token (decode) sequences of a step, built once and used by every layer."""

    rows: torch.Tensor | None  # [Bd] rows of those tokens in the flat batch (None: every row is a decode)
    block_tables: torch.Tensor  # [Bd, nb] block ids, nb = blocks of the longest context
    seq_lens: torch.Tensor  # [Bd] context lengths
    longest: int  # the largest of them
    masked: torch.Tensor  # [Bd, 1, 1, nb * block_size] bool: True past the sequence's context
    others: list[int]  # indices of the sequences that are not decodes (prefill chunks, speculative verifies)
    # the torch layout for a sliding window, by window: only the blocks the window spans (see `windowed`)
    _windows: dict[int, "DecodePlan"] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "DecodePlan":
        decodes = [i for i, q in enumerate(meta.query_lens_list) if q == 1]
        others = [i for i, q in enumerate(meta.query_lens_list) if q > 1]
        device = meta.block_tables.device
        bs = meta.block_size
        longest = max((meta.seq_lens_list[i] for i in decodes), default=1)
        nb = (longest + bs - 1) // bs
        idx = torch.tensor(decodes, dtype=torch.long, device=device)
        rows = None if len(decodes) == len(meta.query_lens_list) else meta.query_start_loc[idx]
        lens = meta.seq_lens[idx]
        masked = torch.arange(nb * bs, device=device).unsqueeze(0) >= lens.unsqueeze(1)
        return cls(rows, meta.block_tables[idx, :nb].contiguous(), lens, longest, masked[:, None, None, :], others)

    def windowed(self, window: int, block_size: int) -> "DecodePlan":
        """The plan of `batched_decode_attention` for a sliding-window layer: each sequence gathers only the
        blocks its window spans (from the one holding position len - window), masked outside the window. Built
        once per step and window. (block_tables/masked hold the windowed layout; the C path uses the full plan.)"""
        plan = self._windows.get(window)
        if plan is not None:
            return plan
        bs, nb = block_size, self.block_tables.shape[1]
        # blocks that `window` consecutive positions can touch: the same layout for every batch (batch invariance)
        span = (window + bs - 2) // bs + 1
        first = (self.seq_lens - window).clamp(min=0) // bs  # [Bd]
        cols = first.unsqueeze(1) + torch.arange(span, device=first.device).unsqueeze(0)
        tables = self.block_tables.gather(1, cols.clamp(max=nb - 1)).contiguous()
        pos = (first * bs).unsqueeze(1) + torch.arange(span * bs, device=first.device).unsqueeze(0)
        lens = self.seq_lens.unsqueeze(1)
        masked = (pos >= lens) | (pos < lens - window)
        plan = DecodePlan(self.rows, tables, self.seq_lens, self.longest, masked[:, None, None, :], self.others)
        self._windows[window] = plan
        return plan


def batched_decode_attention(q: torch.Tensor, kv_cache: KVCache, plan: DecodePlan, scale: float,
                             window: int | None = None, softcap: float | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of Bd single-token queries q [Bd, heads, d] over their contexts, in one batch.

    Every context is gathered whole-block into a padded [Bd, L, kv_heads, d] layout; positions past a sequence's
    length get -inf scores, hence probability exactly 0, and add exact zeros to the softmax sum and to P @ V. So a
    sequence's result does not depend on what else is in the batch (tests/test_attention_fast.py checks this
    bit for bit). Grouped-query heads share K/V through a broadcast view instead of a repeat. With a `window`, only
    the blocks the window spans are gathered (`DecodePlan.windowed`).
    """
    k_cache, v_cache, k_scale, v_scale = kv_parts(kv_cache)
    if window is not None:
        plan = plan.windowed(window, k_cache.shape[1])
    bd, num_heads, d = q.shape
    kv_heads = k_cache.shape[2]
    nb = plan.block_tables.shape[1]
    flat = plan.block_tables.view(-1)

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        # whole blocks (one contiguous copy each), then [Bd, kv_heads, L, d] made contiguous: bmm over strided
        # operands picks batch-size-dependent kernels whose sums differ in the last bit (measured), which would
        # break batch invariance.
        blocks = gather_blocks(cache, scale, flat, q.dtype).view(bd, nb * cache.shape[1], kv_heads, d)
        return blocks.transpose(1, 2).contiguous()

    k_t = gather(k_cache, k_scale).transpose(-1, -2)  # [Bd, kv_heads, d, L] (a transposed view, native to bmm)
    v_t = gather(v_cache, v_scale)  # [Bd, kv_heads, L, d]
    qg = q.reshape(bd, kv_heads, num_heads // kv_heads, d)  # [Bd, kv_heads, group, d]
    scores = torch.matmul(qg, k_t) * scale  # [Bd, kv_heads, group, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    group_sinks = None if sinks is None else sinks.view(kv_heads, num_heads // kv_heads, 1)
    probs = softmax_with_sinks(scores.masked_fill_(plan.masked, float("-inf")), group_sinks)
    out = torch.matmul(probs, v_t)  # [Bd, kv_heads, group, d]
    return out.reshape(bd, num_heads, d)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: KVCache, meta: AttentionMetadata,
    scale: float,
    *, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model-facing call: write the new tokens' K/V into the cache, then attend, through the step's backend
    (`meta.backend`, chosen once by the runner). q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d].

    Per-layer options: `window` (sliding window in tokens: a query at position p sees keys at positions > p - window;
    None: the whole context), `softcap` (attention logits become softcap * tanh(logits / softcap), Gemma 2) and
    `sinks` (fp32 [heads]: each head's sink logit joins its softmax denominator, gpt-oss; None: none)."""
    if window is not None and meta.window_group is not None:  # the window layers' own KV group
        meta = meta.window_group
    backend = meta.backend
    if k is not None:  # None: a layer attending over another layer's K/V (Gemma 4's KV sharing) writes nothing
        backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = backend.attend(q, kv_cache, meta, scale, window=window, softcap=softcap, sinks=sinks)
    if meta.bidirectional:  # the chunks holding images whose tokens see each other: the torch reference redoes them
        only = list(meta.bidirectional)
        redone = torch_paged_attention(q, kv_cache, meta, scale, only, window=window, softcap=softcap, sinks=sinks)
        starts = [0]
        for n in meta.query_lens_list:
            starts.append(starts[-1] + n)
        for i in only:
            out[starts[i] : starts[i + 1]] = redone[starts[i] : starts[i + 1]]
    return out


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
) -> list[KVCache]:
    """Zeroed caches for every layer: (k, v) pairs in `dtype` ("auto") or the named one ("fp32", "fp16", "bf16"),
    or Int8KVCaches with kv_cache_dtype "int8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "int8":
        return [allocate_int8(num_blocks, block_size, num_kv_heads, head_dim, device) for _ in range(num_layers)]
    dtype = cache_dtype(kv_cache_dtype, dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":  # zeroed huge pages (llmd.model.huge_pages), faulted in as blocks fill
        kv = huge_page_tensors([(shape, dtype)] * (2 * num_layers))
        return [(kv[2 * i], kv[2 * i + 1]) for i in range(num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def with_image_embeds(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The step's input embeddings x [T, hidden] with the rows an image gives replaced by its embeddings (a model
    calls this right after embedding its tokens, scaling included); columns past `hidden` are Qwen3-VL's DeepStack
    features (llmd.model.qwen3_vl), not inputs."""
    if meta is None or meta.input_embeds is None:
        return x
    rows, embeds = meta.input_embeds
    return x.index_copy(0, rows, embeds[:, : x.shape[1]].to(x.dtype))
