"""Engine configuration with separate sensible defaults for CPU and for one consumer CUDA GPU.

Torch-free: the settings (llmd.config) check engine fields with `EngineConfig.validate`, so every bound and every
choice of an engine knob is written here once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .types import KvCacheDtype, SpecMode, choices

CPU_KV_CACHE_BYTES = 512 * 1024**2
DEFAULT_SPEC_MAX_BATCH = 8
# Chosen by measurement (README, "KV cache dtype"): on SmolLM2 up to 8k tokens fp16 K/V keep the fp32 cache's
# next-token distributions (mean KL ~5e-7) at half the bytes, so decode reads half as much.
CPU_KV_CACHE_DTYPE = KvCacheDtype.FP16.value

# Inclusive (low, high) bounds of the numeric fields; None: unbounded on that side.
BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "block_size": (1, 1024),  # and a power of two
    "kv_cache_bytes": (1, None),
    "kv_cache_fraction": (0.01, 0.99),
    "num_kv_blocks": (1, None),
    "max_num_seqs": (1, 4096),
    "max_num_batched_tokens": (1, 1 << 20),
    "max_model_len": (2, 1 << 24),  # room for one prompt token and one output token
    "max_queue": (1, 1_000_000),
    "num_speculative_tokens": (1, 16),
    "spec_max_batch": (1, 4096),
    "threads": (1, 1024),
}
CHOICES: dict[str, tuple[str, ...]] = {"kv_cache_dtype": choices(KvCacheDtype),
                                       "speculative_mode": choices(SpecMode)}


class EngineConfigError(ValueError):
    """A bad engine setting: `field` names it, `why` says what it must be."""

    def __init__(self, field: str, why: str):
        super().__init__(f"engine setting {field} {why}")
        self.field, self.why = field, why


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
    kv_cache_dtype: str = KvCacheDtype.AUTO.value  # a KvCacheDtype
    cuda_graphs: bool = True  # CUDA only: replay decode steps from CUDA graphs (llmd.engine.cuda_graphs)
    max_queue: int = 1024  # waiting requests beyond this are refused with QueueFull
    seed: int = 0  # seeds the generators of sampled requests that bring no seed of their own
    # speculative decoding (llmd.engine.speculative): a SpecMode
    speculative_mode: str = SpecMode.OFF.value
    num_speculative_tokens: int = 4
    # a model name/path, "self:N" (the target's first N layers), "mtp" (its MTP head) or a LoadedModel
    draft_model: object = None
    spec_max_batch: int | None = None  # auto mode: no speculation above this many sequences per step (default 8;
    # a hybrid model verifies at most this many proposals per step in every mode)
    # CPU threads of each step: torch's intra-op pool and the C kernels' OpenMP teams in the thread that steps
    # (Engine.use_threads); None: that thread's count as it is
    threads: int | None = None

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
        """Raise EngineConfigError for the first field outside its bounds or choices (None: the device default)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                check_field(f.name, value)


def check_field(name: str, value: object) -> None:
    """One engine field's bounds and choices (the settings call this for each engine field they read)."""
    if name in CHOICES and value not in CHOICES[name]:
        raise EngineConfigError(name, f"must be one of {', '.join(CHOICES[name])}")
    if name not in BOUNDS or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high = BOUNDS[name]
    if (low is not None and value < low) or (high is not None and value > high):
        raise EngineConfigError(name, f"must be between {'-inf' if low is None else low} and "
                                      f"{'inf' if high is None else high}")
    if name == "block_size" and int(value) & (int(value) - 1):
        raise EngineConfigError(name, "must be a power of two")
