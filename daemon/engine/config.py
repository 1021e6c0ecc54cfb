"""Engine configuration with separate sensible defaults for CPU and for one consumer CUDA GPU."""

from __future__ import annotations

from dataclasses import dataclass

CPU_KV_CACHE_BYTES = 512 * 1024**2
# "auto": the device's default (CUDA: the model's dtype; CPU: CPU_KV_CACHE_DTYPE); fp32/fp16/bf16: that float type;
# int8: per-token, per-head scales (llmd.model.kv_int8)
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8")
# Chosen by measurement (README, "KV cache dtype"): on SmolLM2 up to 8k tokens fp16 K/V keep the fp32 cache's
# next-token distributions (mean KL ~5e-7) at half the bytes, so decode reads half as much.
CPU_KV_CACHE_DTYPE = "fp16"


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = None  # KV pool budget; CPU default CPU_KV_CACHE_BYTES
    kv_cache_fraction: float | None = None  # CUDA: share of free GPU memory after weights (default 0.85)
    num_kv_blocks: int | None = None  # overrides both budgets (tests use tiny pools)
    max_num_seqs: int | None = None  # default 64 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # default 512 on CPU, 2048 on CUDA
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped at 32768)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    cuda_graphs: bool = True  # CUDA only: replay decode steps from CUDA graphs (llmd.engine.cuda_graphs)
    max_queue: int = 1024  # waiting requests beyond this are refused with QueueFull
    seed: int = 0  # seeds the generators of sampled requests that bring no seed of their own
    # speculative decoding (llmd.engine.speculative): off | ngram | draft | auto (adaptive to load and acceptance)
    speculative_mode: str = "off"
    num_speculative_tokens: int = 4
    draft_model: object = None  # a model name/path, "self:N" (the target's first N layers) or a LoadedModel
    spec_max_batch: int | None = None  # auto mode: no speculation above this many sequences per step (default 8)

    def resolved(self, device_type: str, model_max_len: int) -> "EngineConfig":
        """A copy with every None default filled in for the device."""
        cuda = device_type == "cuda"
        c = EngineConfig(**self.__dict__)
        if c.max_num_seqs is None:
            c.max_num_seqs = 256 if cuda else 64
        if c.max_num_batched_tokens is None:
            c.max_num_batched_tokens = 2048 if cuda else 512
        if c.max_model_len is None:
            c.max_model_len = min(model_max_len, 32768)
        if cuda and c.kv_cache_fraction is None and c.kv_cache_bytes is None:
            c.kv_cache_fraction = 0.85
        if not cuda and c.kv_cache_bytes is None:
            c.kv_cache_bytes = CPU_KV_CACHE_BYTES
        if not cuda and c.kv_cache_dtype == "auto":
            c.kv_cache_dtype = CPU_KV_CACHE_DTYPE
        c.validate()
        return c

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"engine setting {name} {why}")

        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", "must be a power of two")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            bad("max_num_seqs", "must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be at least 2")
        if self.kv_cache_fraction is not None and not 0.0 < self.kv_cache_fraction < 1.0:
            bad("kv_cache_fraction", "must be in (0, 1)")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            bad("kv_cache_bytes", "must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", "must be at least 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"is {self.kv_cache_dtype!r}; must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.max_queue < 1:
            bad("max_queue", "must be at least 1")
        if self.speculative_mode not in ("off", "ngram", "draft", "auto"):
            bad("speculative_mode", "must be one of off, ngram, draft, auto")
        if not 1 <= self.num_speculative_tokens <= 16:
            bad("num_speculative_tokens", "must be between 1 and 16")
