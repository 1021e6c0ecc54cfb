"""A minimal batched decode loop over the model API (no engine): B sequences, each with its own blocks, prefilled
together, then decoded one token per sequence per step. Used by the quantization benchmarks on CPU and GPU."""

from __future__ import annotations

import time

import torch

from llmd.model.attention import AttentionMetadata, allocate_kv_cache
from llmd.model.attention_backends import choose_backend
from llmd.model.cpu_stack import CompiledCpuForward
from llmd.model.ops import greedy_tokens


def paged_kv(model, batch: int, max_len: int, block_size: int = 16, kv_cache_dtype: str = "auto",
             kv_groups: bool = False):
    """Zeroed KV caches for `batch` sequences of up to `max_len` tokens, each with its own blocks, and
    build(query_lens, seq_lens) -> the step's AttentionMetadata over them. kv_groups: in a model mixing window and
    global layers, the window layers' K/V in a pool of their own with their own block tables (meta.window_group),
    as the engine's runner keeps them."""
    cfg = model.config
    param = next(p for p in model.parameters())
    device, dtype = param.device, (param.dtype if param.is_floating_point() else torch.float32)
    backend = choose_backend(device)  # as the engine's runner picks it (Triton on CUDA where it runs)
    per_seq = -(-max_len // block_size)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    windows = cfg.layer_windows
    grouped = kv_groups and any(w is None for w in windows) and any(w is not None for w in windows)

    def pool(blocks: int, layer: int):  # one layer's cache, in its own head shape (Gemma 4's differ by layer)
        return allocate_kv_cache(1, blocks, block_size, cfg.layer_num_kv_heads(layer), cfg.layer_head_dim(layer),
                                 dtype, device, kv_cache_dtype=kv_cache_dtype)[0]

    # grouped: the window layers' caches in a pool of another size (one more block), with tables of other ids; a
    # layer that reads another's K/V (Gemma 4's KV sharing) is given that layer's cache, as the engine's runner does
    kv = [pool(batch * per_seq + (2 if grouped and w is not None else 1), i) if cfg.kv_source(i) == i else None
          for i, w in enumerate(windows)]
    kv = [cache if cache is not None else kv[cfg.kv_source(i)] for i, cache in enumerate(kv)]
    window_tables = [[b + 1 for b in t] for t in tables] if grouped else None

    def build(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device, backend=backend)
        if window_tables is not None:
            meta.window_group = AttentionMetadata.build(query_lens, seq_lens, window_tables, block_size,
                                                        device=device, backend=backend)
        return meta

    return kv, build


@torch.inference_mode()
def prefill_tokens_per_second(model, tokens: int, block_size: int = 16, rounds: int = 2, warmup: int = 1,
                              sync=lambda: None, kv_cache_dtype: str = "auto", kv_groups: bool = False) -> float:
    """A `tokens`-long prompt in one forward into an empty cache, plus the logits of its last position: tokens / the
    best of `rounds` timed forwards, after `warmup` untimed ones (on CUDA the first compiles the kernels)."""
    cfg = model.config
    device = next(p for p in model.parameters()).device
    forward = CompiledCpuForward.try_build(model) or model
    kv, build = paged_kv(model, 1, tokens, block_size, kv_cache_dtype, kv_groups)
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(tokens, device=device)
    best = float("inf")
    for r in range(warmup + rounds):
        sync()
        t0 = time.perf_counter()
        hidden = forward(prompt, positions, kv, build([tokens], [tokens]))
        model.compute_logits(hidden[-1:])
        sync()
        if r >= warmup:
            best = min(best, time.perf_counter() - t0)
    return tokens / best


@torch.inference_mode()
def decode_tokens_per_second(model, batch: int, prompt_len: int, steps: int, block_size: int = 16,
                             warmup: int = 2, sync=lambda: None, query_len: int = 1, kv_cache_dtype: str = "auto",
                             prefill_chunk: int | None = None, kv_groups: bool = False) -> float:
    """Steps per second times batch. query_len > 1 feeds that many positions per sequence per step, the shape of a
    speculative verify (k proposals + 1), so its cost can be compared with a plain decode step. prefill_chunk: feed
    the prompts in chunks of that many positions (a long prompt in one forward needs its activations at once).
    kv_groups: the window layers' K/V in a pool of their own (paged_kv). Timed step s (of warmup + steps) attends
    over prompt_len + (s + 1) * query_len tokens per sequence."""
    cfg = model.config
    device = next(p for p in model.parameters()).device
    forward = CompiledCpuForward.try_build(model) or model  # and, on the CPU, the layers in one C call
    max_len = prompt_len + query_len * (steps + warmup) + 1
    kv, build = paged_kv(model, batch, max_len, block_size, kv_cache_dtype, kv_groups)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)
    chunk = prefill_chunk or prompt_len
    for lo in range(0, prompt_len, chunk):
        hi = min(lo + chunk, prompt_len)
        meta = build([hi - lo] * batch, [hi] * batch)
        pos = torch.arange(lo, hi).repeat(batch).to(device)
        hidden = forward(prompt[:, lo:hi].flatten().to(device), pos, kv, meta)
    last = hidden.view(batch, hi - lo, -1)[:, -1]
    length = prompt_len
    elapsed = 0.0
    for step in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        ids = greedy_tokens(model.compute_logits(last)).repeat_interleave(query_len)  # as the engine's sampler
        length += query_len
        meta = build([query_len] * batch, [length] * batch)
        positions = torch.arange(length - query_len, length, device=device).repeat(batch)
        last = forward(ids, positions, kv, meta).view(batch, query_len, -1)[:, -1]
        sync()
        if step >= warmup:
            elapsed += time.perf_counter() - t0
    return batch * steps / elapsed
