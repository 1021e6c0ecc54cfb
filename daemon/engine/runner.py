"""Model runner: owns the KV pool and runs one forward per step over a flattened batch of decodes and prefill chunks.

Logits are computed only for rows that are sampled (the last token of a chunk that completes its sequence's token
list), since the vocabulary projection is the most expensive matmul of a small model.

On CUDA, attention runs through the Triton kernels (llmd.kernels), and decode-only steps of up to 32 sequences are
replayed from CUDA graphs (llmd.engine.cuda_graphs; EngineConfig.cuda_graphs, `llmd serve --no-cuda-graphs`), with
one scratch KV block past the pool's end for the padding rows. Everything else runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from ..model.attention import AttentionMetadata, allocate_kv_cache
from ..model.attention_backends import AttentionBackend, CpuBackend, choose_backend
from ..model.cpu_stack import CompiledCpuForward
from ..model.kv_int8 import bytes_per_token, cache_dtype
from .config import EngineConfig
from .cuda_graphs import Capture, CudaGraphRunner, cuda_graph_capture, graph_blocker
from .scheduler import ScheduledSeq

log = logging.getLogger(__name__)

# CPU BLAS picks another kernel (another summation order) for a matmul of fewer rows than this, so a step that pools
# embeddings is padded up to it: an input's vector is then bit-identical alone or in a batch (tests/test_embed.py).
MIN_POOLING_ROWS = 16


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block across all layers: K and V, plus the int8 cache's per-token scales."""
    c = model_config
    per_token = bytes_per_token(c.num_key_value_heads, c.head_dim, dtype, kv_cache_dtype)
    return c.num_hidden_layers * block_size * per_token


def sequences_that_fit(model_config, budget_bytes: int, block_size: int, dtype: torch.dtype,
                       tokens: int = 8192) -> dict[str, int]:
    """How many sequences of `tokens` tokens a KV budget holds, per KV cache dtype ("fp32", "fp16", "bf16", "int8"):
    the trade between long contexts and batch size."""
    blocks = -(-tokens // block_size)
    return {kind: int(budget_bytes // (blocks * kv_bytes_per_block(model_config, block_size, dtype, kind)))
            for kind in ("fp32", "fp16", "bf16", "int8")}


def activation_headroom_bytes(model_config, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous estimate of the transient memory of one forward (kept free when sizing the pool on CUDA)."""
    elem = torch.empty((), dtype=dtype).element_size()
    c = model_config
    t = config.max_num_batched_tokens
    per_token = (4 * c.hidden_size + 3 * c.intermediate_size + 2 * c.num_attention_heads * c.head_dim) * elem
    logits = config.max_num_seqs * c.vocab_size * 4 * 3
    return 2 * t * per_token + logits + 256 * 1024**2


def plan_num_blocks(model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype)
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    else:
        free, _total = torch.cuda.mem_get_info(device)
        budget = int((free - activation_headroom_bytes(model_config, config, dtype)) * config.kv_cache_fraction)
    num = budget // per_block - 1  # the scratch block (see ModelRunner) is paid from the budget too
    if num < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) is smaller than two blocks ({per_block / 2**20:.1f} MiB "
            "each: one for sequences, one for padding rows)"
        )
    return int(num)


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig, graph_capture: Capture | None = None,
                 attention: AttentionBackend | None = None):
        """graph_capture: how decode steps are captured; None picks CUDA graphs on CUDA when config.cuda_graphs
        is on (tests on CPU pass llmd.engine.cuda_graphs.eager_capture to run the same static-buffer path).
        attention: this model's attention backend; None picks it for the device (llmd.model.attention_backends).
        Each runner (a draft model's too) keeps its own."""
        self.model = loaded.model
        self.model_config = loaded.config
        param = next(self.model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = config.block_size
        self.kv_cache_dtype = config.kv_cache_dtype
        self.num_blocks = plan_num_blocks(self.model_config, config, self.dtype, self.device)
        self.attention = attention or choose_backend(self.device, self.model_config, self.dtype,
                                                     config.kv_cache_dtype)
        # what runs a step: the model, or on the CPU its layers as one C call where that applies (llmd.model.llama)
        compiled = CompiledCpuForward.try_build(self.model) if isinstance(self.attention, CpuBackend) else None
        self.forward = compiled or self.model
        if self.device.type == "cuda" and graph_capture is None and config.cuda_graphs:
            graph_capture = cuda_graph_capture()
        if graph_capture is not None and (why := graph_blocker(self.model, self.attention)) is not None:
            log.info("CUDA graphs off: %s", why)
            graph_capture = None
        # the block manager hands out blocks 0..num_blocks-1; padding rows (graphs', embedding steps') write to one more
        self.scratch_block = self.num_blocks
        pool_blocks = self.num_blocks + 1
        c = self.model_config
        self.kv_caches = allocate_kv_cache(
            c.num_hidden_layers, pool_blocks, self.block_size, c.num_key_value_heads, c.head_dim,
            dtype=self.dtype, device=self.device, kv_cache_dtype=self.kv_cache_dtype,
        )
        self.kv_cache_bytes = pool_blocks * kv_bytes_per_block(c, self.block_size, self.dtype, self.kv_cache_dtype)
        self.kv_element = cache_dtype(self.kv_cache_dtype, self.dtype)  # what the pool holds
        kind = "int8 + scales" if self.kv_cache_dtype == "int8" else str(self.kv_element).removeprefix("torch.")
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB, %s)", self.num_blocks, self.block_size,
                 self.kv_cache_bytes / 2**20, kind)
        self.graphs: CudaGraphRunner | None = None
        if graph_capture is not None:
            self.graphs = CudaGraphRunner(
                self.model, self.kv_caches, max_num_seqs=config.max_num_seqs or 32,
                max_model_len=config.max_model_len or c.max_position_embeddings, block_size=self.block_size,
                scratch_block=self.num_blocks, capture=graph_capture, attention=self.attention)
            log.info("CUDA graphs: decode steps of up to %d sequences (batch sizes %s), captured on first use",
                     self.graphs.sizes[-1], ", ".join(map(str, self.graphs.sizes)))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the batch; return fp32 logits [rows, vocab]: for each scheduled chunk that samples, its last
        `num_logits` positions (one, or 1 + k for a speculative proposal of k), in the order of `scheduled`.
        An embedding chunk (`s.pools`) gets the final hidden states of all its positions in `s.hidden` instead."""
        if self.graphs is not None and not any(s.pools for s in scheduled) and self.graphs.can_run(scheduled):
            logits = self.graphs.execute(scheduled)
            if logits is not None:
                return logits
        return self.execute_eager(scheduled)

    @torch.inference_mode()
    def execute_eager(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """`execute` without graphs: any mix of prefill chunks, decodes and verifies."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, sample_rows = [], [], [], []
        pooled: list[tuple[ScheduledSeq, int]] = []  # embedding chunks and their first row
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            if s.pools:
                pooled.append((s, len(input_ids)))
            input_ids.extend(seq.token_ids[start : start + s.num_new_tokens])
            input_ids.extend(s.spec)  # a speculative proposal runs right after its decode token
            n = s.num_tokens
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if s.samples:
                end = len(input_ids)
                sample_rows.extend(range(end - min(s.num_logits, n), end))
        if pooled and len(input_ids) < MIN_POOLING_ROWS:  # a padding query of its own, on the scratch block
            pad = MIN_POOLING_ROWS - len(input_ids)
            input_ids.extend([0] * pad)
            positions.extend(range(pad))
            query_lens.append(pad)
            seq_lens.append(pad)
            tables.append([self.scratch_block] * -(-pad // self.block_size))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device=self.device,
                                       backend=self.attention)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.forward(ids, pos, self.kv_caches, meta)
        for s, first in pooled:
            s.hidden = hidden[first : first + s.num_new_tokens].clone()
        if not sample_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
