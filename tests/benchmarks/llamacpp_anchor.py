"""llama.cpp (llama-cpp-python) as the side-by-side anchor of the CPU benchmarks.

Greedy decode of B sequences through the low-level llama_batch API: the prompts are prefilled in one llama_decode,
then every step feeds one token per sequence (n_seq_max = B), EOS ignored, so the token count is fixed. Prefill and
decode are timed apart. Optional: `make bench-anchor` builds it; when it is missing, load() returns None and the
benchmark prints MISSING and runs the rest.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MISSING = "llama.cpp: not installed (make bench-anchor)"


@dataclass
class Timing:
    batch: int
    prefill_s: float
    decode_s: float
    steps: int  # timed decode steps, each one token per sequence

    @property
    def decode_tok_s(self) -> float:
        return self.batch * self.steps / self.decode_s

    @property
    def request_tok_s(self) -> float:
        """Tokens per second over prefill and decode, as an engine's whole request counts them: the prefill yields the
        first token, each step one more (use with warmup=0)."""
        return self.batch * (self.steps + 1) / (self.prefill_s + self.decode_s)


class LlamaCpp:
    def __init__(self, lib, path: Path, threads: int):
        self.lib, self.threads = lib, threads
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def weight_bytes(self) -> int:
        return self.lib.llama_model_size(self.model)

    def cpu_features(self) -> str:
        """The instruction sets this build uses, e.g. 'AVX2 = 1 | FMA = 1 | ...' (no AMX/AVX512 expected)."""
        info = self.lib.llama_print_system_info().decode().replace("CPU :", "")
        return " | ".join(f.strip() for f in info.split("|") if f.strip().endswith("= 1"))

    def close(self) -> None:
        self.lib.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], steps: int, warmup: int = 0, **context) -> Timing:
        """Prefill every prompt, then warmup + steps greedy decode steps; the first `warmup` steps are not timed.
        `context`: llama_context_params fields to set (type_k, type_v, flash_attn_type, rope_freq_scale, ...)."""
        lib, batch = self.lib, len(prompts)
        per_seq = max(len(p) for p in prompts) + warmup + steps + 1
        params = lib.llama_context_default_params()
        params.n_seq_max = batch
        params.n_ctx = batch * -(-per_seq // 256) * 256  # split evenly over the sequences, padded to 256 per sequence
        params.n_batch = params.n_ubatch = max(512, sum(len(p) for p in prompts))
        params.n_threads = params.n_threads_batch = self.threads
        for name, value in context.items():
            setattr(params, name, value)
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        tokens = lib.llama_batch_init(params.n_batch, 0, 1)
        try:
            entries = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
            t0 = time.perf_counter()
            logits = self._decode(ctx, tokens, entries)
            prefill_s = time.perf_counter() - t0
            lengths = [len(p) for p in prompts]
            decode_s = 0.0
            for step in range(warmup + steps):
                t0 = time.perf_counter()
                ids = logits.argmax(-1)
                logits = self._decode(ctx, tokens, [(int(ids[s]), lengths[s] + step, s, True) for s in range(batch)])
                if step >= warmup:
                    decode_s += time.perf_counter() - t0
            return Timing(batch, prefill_s, decode_s, steps)
        finally:
            lib.llama_batch_free(tokens)
            lib.llama_free(ctx)

    def _decode(self, ctx, tokens, entries) -> np.ndarray:
        """One llama_decode of (token, position, sequence, wants_logits) entries; returns the requested logits rows."""
        for i, (tok, pos, seq, wants_logits) in enumerate(entries):
            tokens.token[i], tokens.pos[i], tokens.n_seq_id[i] = tok, pos, 1
            tokens.seq_id[i][0], tokens.logits[i] = seq, wants_logits
        tokens.n_tokens = len(entries)
        if (rc := self.lib.llama_decode(ctx, tokens)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(rows, self.n_vocab))


def load(path: Path, threads: int) -> LlamaCpp | None:
    """The GGUF loaded in llama.cpp with `threads` threads, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose
    except ImportError:
        return None
    set_verbose(False)  # llama.cpp's own log: errors only
    return LlamaCpp(llama_cpp, path, threads)


def same_prompts(vocab_size: int, batch: int, prompt_len: int) -> list[list[int]]:
    """The random prompt tokens decode_driver.decode_tokens_per_second feeds llmd (same generator, same seed)."""
    import torch

    return torch.randint(0, vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
