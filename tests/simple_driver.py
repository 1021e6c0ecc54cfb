"""A minimal single-sequence driver for tests and scripts: feeds tokens through the paged KV cache without the engine.

    session = SingleSequence(loaded.model, max_tokens=128)
    logits = session.feed([1, 2, 3])        # [3, vocab] fp32: logits after each fed token
    logits = session.feed([4])              # next step, attends to the cached 1, 2, 3

    prefill_logits(loaded, ids, chunk_sizes=[5])     # logits for every prompt token, prompt fed as chunks 5 + rest
    greedy_generate(loaded, ids, 32)                 # 32 argmax tokens (does not stop at EOS)

The block table is deliberately not the identity (blocks are used in reverse order), so tests also exercise the
indirection through block tables.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from llmd.model.attention import AttentionMetadata, allocate_kv_cache
from llmd.model.cpu_stack import CompiledCpuForward
from llmd.model.recurrent import StateMetadata, allocate_states, layer_caches


def _model_of(model_or_loaded: Any) -> torch.nn.Module:
    """Accept a LoadedModel or the bare model (note CausalLM itself has a `.model` submodule)."""
    return model_or_loaded if isinstance(model_or_loaded, torch.nn.Module) else model_or_loaded.model


class SingleSequence:
    """One sequence with its own small KV cache of `ceil(max_tokens / block_size)` blocks."""

    def __init__(self, model_or_loaded: Any, max_tokens: int, block_size: int = 16, kv_cache_dtype: str = "auto"):
        self.model = _model_of(model_or_loaded)
        cfg = self.model.config
        param = next(self.model.parameters())
        self.device = param.device
        num_blocks = max(1, -(-max_tokens // block_size))
        self.block_size = block_size
        self.max_tokens = num_blocks * block_size
        self.block_table = list(reversed(range(num_blocks)))
        kv_caches = {i: allocate_kv_cache(1, num_blocks, block_size, cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i),
                                          dtype=param.dtype, device=self.device, kv_cache_dtype=kv_cache_dtype)[0]
                     for i in cfg.kv_layers}
        # a hybrid's recurrent layers: slot 0 is this sequence's state (llmd.model.recurrent)
        self.kv_caches = layer_caches(cfg, kv_caches, allocate_states(cfg, 1, param.dtype, self.device))
        self.length = 0  # tokens already in the cache
        # as the engine's runner does: on the CPU, the layers in one C call where that applies
        self.forward = CompiledCpuForward.try_build(self.model) if self.device.type == "cpu" else None
        self.forward = self.forward or self.model

    @torch.inference_mode()
    def feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append tokens; return fp32 logits [len(token_ids), vocab] (row i predicts the token after token_ids[i])."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("feed needs at least one token")
        if self.length + n > self.max_tokens:
            raise ValueError(f"sequence would exceed its cache of {self.max_tokens} tokens")
        new_len = self.length + n
        meta = AttentionMetadata.build([n], [new_len], [self.block_table], self.block_size, device=self.device)
        meta.state = StateMetadata.build([0], [self.length == 0], [n], self.device)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, new_len, dtype=torch.long, device=self.device)
        hidden = self.forward(ids, positions, self.kv_caches, meta)
        self.length = new_len
        return self.model.compute_logits(hidden)


def prefill_logits(
    model_or_loaded: Any, token_ids: Sequence[int], chunk_sizes: Sequence[int] = (), block_size: int = 16,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] for the prompt fed in chunks of `chunk_sizes` (then the rest in one chunk)."""
    session = SingleSequence(model_or_loaded, len(token_ids), block_size, kv_cache_dtype)
    pieces, start = [], 0
    for size in list(chunk_sizes) + [len(token_ids)]:
        end = min(len(token_ids), start + size)
        if end > start:
            pieces.append(session.feed(token_ids[start:end]))
        start = end
    return torch.cat(pieces)


def greedy_generate(
    model_or_loaded: Any, token_ids: Sequence[int], max_new_tokens: int,
    chunk_sizes: Sequence[int] = (), block_size: int = 16, stop_ids: Sequence[int] = (),
) -> list[int]:
    """Argmax continuation of `token_ids`: up to `max_new_tokens` new ids, stopping early only on `stop_ids`."""
    session = SingleSequence(model_or_loaded, len(token_ids) + max_new_tokens, block_size)
    start = 0
    logits = None
    for size in list(chunk_sizes) + [len(token_ids)]:
        end = min(len(token_ids), start + size)
        if end > start:
            logits = session.feed(token_ids[start:end])
        start = end
    out: list[int] = []
    while logits is not None and len(out) < max_new_tokens:
        next_id = int(logits[-1].argmax())
        out.append(next_id)
        if next_id in stop_ids or len(out) == max_new_tokens:
            break
        logits = session.feed([next_id])
    return out
