"""One-shot generation for `llmd generate`: load a model, run one request through the engine, stream its text."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterator

from .engine.types import DTYPE_NAMES
from .errors import InvalidRequest, LlmdError

# `llmd generate` is greedy by default: a one-shot command should give the same answer every time, and small models
# drift when sampled (SmolLM2-135M answers "Paris" to the README question greedily, but only ~half the time at 0.8).
# With --temperature > 0 the other knobs default to llama.cpp's values (Ollama's are close). The HTTP dialects keep
# their own defaults.
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_MAX_TOKENS = 256

def torch_dtype(name: str | None):
    """'bf16' -> torch.bfloat16 (None stays None: the loader's default for the device)."""
    if name is None:
        return None
    import torch

    if name.lower() not in DTYPE_NAMES:
        raise InvalidRequest(f"unknown dtype {name!r}: use one of {', '.join(DTYPE_NAMES)}", field="dtype")
    return getattr(torch, DTYPE_NAMES[name.lower()])


def check_device(name: str | None) -> None:
    """Refuse a device this machine does not have, before the model load rather than inside it."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidRequest(f"unknown device {name!r}: use cpu, cuda or cuda:N", field="device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r}: no CUDA GPU is available here (use --device cpu)", field="device")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"device {name!r} is not supported: use cpu or cuda", field="device")


def set_threads(threads: int | None) -> None:
    """Use this many CPU threads for the model's math (None: leave torch's default, one per core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def prompt_token_ids(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Instruct models (those with a chat template) get the prompt as one user turn, unless `raw`."""
    if not raw and tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=True)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0

    @property
    def tokens_per_second(self) -> float | None:
        decode = self.total_s - (self.ttft_s or 0.0)
        if self.generated_tokens < 2 or decode <= 0:
            return None
        return (self.generated_tokens - 1) / decode


def generate_stream(loaded, prompt_ids: list[int], params, stats: GenerationStats | None = None,
                    kv_cache_dtype: str = "auto") -> Iterator[str]:
    """Run one request on a private engine sized for it and yield text deltas as the engine produces them."""
    from .engine import Engine, EngineConfig

    stats = stats if stats is not None else GenerationStats()
    max_len = loaded.config.max_position_embeddings
    if len(prompt_ids) >= max_len:
        raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens; the model's context is {max_len}", "prompt")
    params.max_tokens = min(params.max_tokens, max_len - len(prompt_ids))
    params.validate()
    needed = len(prompt_ids) + params.max_tokens
    block_size = 16
    # One sequence: a KV pool just big enough for it, rather than the serving default.
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=math.ceil(needed / block_size) + 1,
        max_num_seqs=1,
        max_model_len=needed,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(loaded, config)
    stats.prompt_tokens = len(prompt_ids)
    start = time.perf_counter()
    engine.add_request("generate", list(prompt_ids), params)
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise LlmdError(f"generation failed: {out.error}")
            if out.new_token_ids and stats.ttft_s is None:
                stats.ttft_s = time.perf_counter() - start
            stats.generated_tokens += len(out.new_token_ids)
            if out.text_delta:
                yield out.text_delta
            if out.finished:
                stats.total_s = time.perf_counter() - start
                return
    stats.total_s = time.perf_counter() - start
