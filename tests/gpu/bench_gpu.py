"""GPU figures for the quantized kernels and decode (H200 by default; run by tests/gpu/run_gpu_checks.sh).

1. Per-kernel GB/s and % of peak bandwidth at Llama-3-8B and Qwen2.5-7B linear shapes for M = 1..32: torch bf16
   matmul, int8 (per-channel) and int4 (g128) fused kernels.
2. Prefill attention at Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128): the paged varlen kernel's ms
   and TFLOP/s for 2,048-token prompts (batch 1 and 4, bf16 and int8 cache) and a chunk over a cached prefix, next
   to torch SDPA on the same K/V laid out contiguously; a few tile settings for tuning.
3. End-to-end decode tok/s at batch 1 for a random-weight Llama-3-8B in bf16 / int8 / int4, with achieved GB/s and
   % of the roofline (weight + KV bytes read per token / peak bandwidth).
4. Decode through the engine with CUDA graphs on and off (llmd.engine.cuda_graphs), batch 1 and 8, for the random
   Llama-3-8B and a random Qwen2.5-0.5B (small enough that eager steps are bound by kernel launches).
5. GGUF packed matmul (llmd.kernels.gguf_matmul) per type (Q4_K_M's and MXFP4) at Llama-3-8B shapes for M = 1..16:
   GB/s and % of peak bandwidth, next to bf16 torch matmul at the same shape (section gguf_kernels; run_gpu_checks.sh
   runs it apart, with its own time limit, as --sections gguf_kernels --name gguf_bench).
6. Long-context decode (section long_context; run_gpu_checks.sh runs it apart, as --sections long_context --name
   gpu_long_context): batch 1 after 8k and 32k tokens for the random bf16 Llama-3-8B with a
   bf16 and an int8 KV cache, with achieved GB/s of weights + KV read per step and % of the roofline.
7. Real model shapes (section shapes; run apart as --sections shapes --name gpu_shapes): random-weight Gemma 3 4B
   (text) and Qwen2.5-7B built from their config.json values through llmd's own ModelConfig and model classes, bf16
   and int8: prefill tok/s of a 2k prompt, decode tok/s at batch 1 and 16 after it, GB/s of weights + KV read per
   decode step and % of the roofline, weight and peak GPU memory, as a table. `--models gemma4-e4b,gemma4-31b` runs
   Gemma 4 E4B and 31B instead (run_gpu_checks.sh's gemma4 stage). `--device cpu --scale tiny` runs the same code on
   the CPU at a tiny size of the same families (tests/test_gpu_bench_shapes.py).
8. Fused mixture-of-experts kernel (llmd.kernels.moe_matmul; section moe, run apart as --sections moe --name
   moe_bench) at gpt-oss-20b's experts (MXFP4, biases, clamped SwiGLU) and Qwen3-30B-A3B's (Q4_K), random weights,
   bf16, batch 1, 4 and 16, autotuned: GB/s of the bytes of the experts the batch hit, checked against the torch
   reference. `--device cpu --scale tiny` runs it under the Triton interpreter (tests/test_gpu_bench_shapes.py).
9. The recurrent layers of hybrid models (llmd.kernels.recurrent_triton; section hybrid, run apart as --sections hybrid
   --name hybrid_bench) at one Qwen3.5-9B Gated DeltaNet layer (16 q/k and 32 value heads of 128, a 4-tap conv over
   8192 channels), bf16 activations, fp32 state: the conv and the gated delta rule for a decode step at batch 1 and 16
   (us, GB/s of the state read and written) and for a 2k-token prefill chunk (ms: the chunked kernel, the
   token-by-token one, and the torch reference run once), each result checked against the torch reference; and the
   same for one Granite-4.0-H-Small Mamba2 layer (128 heads of 64, a state of 128 in one group, a 4-tap conv with
   bias over 8448 channels): the conv and the scan.
   `--device cpu --scale tiny` runs it under the Triton interpreter (tests/test_gpu_bench_shapes.py).
Writes JSON and a text table to --out. Imports nothing outside torch/triton/llmd.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmd.model.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

SHAPES = {  # name: [(N, K)] of one decoder layer's projections (q, k/v, o, gate/up, down)
    "llama3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
    "qwen2.5-7b": [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)],
}
LLAMA3_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rope_theta=500000.0, max_position_embeddings=8192)
QWEN25_05B = dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True)


def kernel_bandwidth(peak_gbs: float, ms_list=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    from triton.testing import do_bench

    from llmd.kernels import quant_matmul as qm

    rows = []
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
            s8 = torch.rand(n, 1, device="cuda", dtype=torch.bfloat16) * 0.01
            q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            s4 = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) * 0.01
            z4 = torch.zeros_like(s4)
            for m in ms_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                act = (m * k + m * n) * 2
                cases = {
                    "bf16": (lambda: x @ w.t(), n * k * 2),
                    "int8": (lambda: qm.int8_matmul(x, q8, s8, k), n * k + n * 2),
                    "int4-g128": (lambda: qm.int4_matmul(x, q4, s4, z4, 128), n * k // 2 + 2 * s4.numel() * 2),
                }
                for kind, (fn, wbytes) in cases.items():
                    fn()  # autotune outside the timing
                    ms = do_bench(fn, warmup=10, rep=30)
                    gbs = (wbytes + act) / ms / 1e6
                    rows.append(dict(model=model, N=n, K=k, M=m, kind=kind, us=ms * 1e3, gbs=gbs,
                                     pct_peak=100 * gbs / peak_gbs))
                    print(f"{model:11} N={n:6} K={k:6} M={m:3} {kind:10} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
                          f"{100 * gbs / peak_gbs:5.1f}%", flush=True)
            del w, q8, q4
    return rows


# a Q4_K_M file's types (the GPU tests autotune the same ones), and MXFP4 (gpt-oss's expert weights: its tilings
# compile and autotune here)
GGUF_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "MXFP4"]


def _random_gguf_blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    """Random quants and scale bits with finite scales of ~0.01 (the same recipe as the kernel tests)."""
    from kernel_testing import random_gguf_blocks

    from llmd.kernels.gguf_matmul import TYPES

    return torch.from_numpy(random_gguf_blocks(TYPES[type_name], n, k)).cuda()


def gguf_kernel_bandwidth(peak_gbs: float, ms_list=(1, 2, 4, 8, 16), types=GGUF_TYPES) -> list[dict]:
    """Achieved GB/s (packed weight + activation bytes per call) of gguf_matmul, autotuned, bf16 activations."""
    from triton.testing import do_bench

    from llmd.kernels import gguf_matmul as gm

    rows = []
    for n, k in SHAPES["llama3-8b"]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = {}
        for type_name in ["bf16"] + list(types):
            q = None if type_name == "bf16" else _random_gguf_blocks(type_name, n, k)
            for m in ms_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if q is None:
                    fn, wbytes = (lambda: x @ w.t()), n * k * 2
                else:
                    fn, wbytes = (lambda: gm.gguf_matmul(x, q, type_name, k)), q.numel()
                fn()  # autotune outside the timing
                ms = do_bench(fn, warmup=10, rep=30)
                gbs = (wbytes + (m * k + m * n) * 2) / ms / 1e6
                if q is None:
                    bf16_us[m] = ms * 1e3
                row = dict(N=n, K=k, M=m, kind=type_name, us=ms * 1e3, gbs=gbs, pct_peak=100 * gbs / peak_gbs,
                           bits_per_weight=8 * wbytes / (n * k), speedup_vs_bf16=bf16_us[m] / (ms * 1e3))
                if q is not None:
                    row["tiling"] = gm._best.get((type_name, gm._m_bucket(m), n, k, x.dtype))
                rows.append(row)
                print(f"gguf N={n:6} K={k:6} M={m:3} {type_name:6} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
                      f"{100 * gbs / peak_gbs:5.1f}% of peak  {bf16_us[m] / (ms * 1e3):5.2f}x bf16's speed",
                      flush=True)
            del q
        del w
    torch.cuda.empty_cache()
    for kind in ["bf16"] + list(types):
        cells = []
        for m in ms_list:
            pct = [r["pct_peak"] for r in rows if r["kind"] == kind and r["M"] == m]
            cells.append(f"M={m} {sum(pct) / len(pct):4.1f}%")
        print(f"gguf {kind:6} % of peak, mean over the Llama-3-8B shapes: {'  '.join(cells)}", flush=True)
    return rows


def prefill_case(batch: int, new: int, prefix: int, kv_dtype: str, tiles: dict, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, block_size: int = 16, device: str = "cuda", dtype=torch.bfloat16):
    """One prefill-attention step at the given shape: (kernel, sdpa, flops). Both callables return
    [batch, heads, new, head_dim]. The paged cache's blocks are scattered, as in a busy pool; SDPA gets the same
    queries and K/V (dequantized for int8) gathered contiguous and expanded to all heads, so it runs its flash path.
    FLOPs count only the visible (query, key) pairs: 4 * heads * head_dim per pair."""
    import torch.nn.functional as F

    from llmd.kernels.prefill_attention import paged_prefill_attention
    from llmd.model.attention import AttentionMetadata, gather_context
    from llmd.model.kv_int8 import Int8KVCache, kv_parts, quantize_int8

    scale = head_dim ** -0.5
    seq_len = prefix + new
    per_seq = -(-seq_len // block_size)
    gen = torch.Generator().manual_seed(0)
    order = (torch.randperm(batch * per_seq, generator=gen) + 1).tolist()
    tables = [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    shape = (batch * per_seq + 1, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=dtype)
    v = torch.randn(shape, device=device, dtype=dtype)
    if kv_dtype == "int8":
        (k_q, k_s), (v_q, v_s) = quantize_int8(k), quantize_int8(v)
        cache = Int8KVCache(k_q, v_q, k_s, v_s)
    else:
        cache = (k, v)
    meta = AttentionMetadata.build([new] * batch, [seq_len] * batch, tables, block_size, device=device)
    q = torch.randn(batch * new, heads, head_dim, device=device, dtype=dtype)
    kc, vc, ksc, vsc = kv_parts(cache)

    def kernel():
        out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, new,
                                      k_scale=ksc, v_scale=vsc, **tiles)
        return out.view(batch, new, heads, head_dim).transpose(1, 2)

    ctx = [gather_context(cache, meta.block_tables[b], seq_len, dtype) for b in range(batch)]
    k_c, v_c = (torch.stack([c[i] for c in ctx]).repeat_interleave(heads // kv_heads, 2).transpose(1, 2).contiguous()
                for i in (0, 1))
    q_c = q.view(batch, new, heads, head_dim).transpose(1, 2).contiguous()
    mask, causal = None, True
    if prefix:  # queries at the end of the context: a bottom-right aligned causal mask
        causal = False
        try:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, seq_len)
        except ImportError:  # older torch: an explicit mask (SDPA then leaves its flash path)
            mask = torch.ones(new, seq_len, dtype=torch.bool, device=device).tril(prefix)

    def sdpa():
        return F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=mask, is_causal=causal, scale=scale)

    flops = 4 * heads * head_dim * batch * (new * prefix + new * (new + 1) // 2)
    return kernel, sdpa, flops


def prefill_attention_speed(peak_gbs: float) -> list[dict]:
    """The paged prefill kernel at Llama-3-8B attention shape against torch SDPA, plus a few tile settings."""
    from triton.testing import do_bench

    # (batch, new tokens, cached prefix, kv cache, tile overrides)
    cases = [(1, 2048, 0, "bf16", {}), (4, 2048, 0, "bf16", {}), (1, 512, 1536, "bf16", {}),
             (1, 2048, 0, "int8", {}), (4, 2048, 0, "int8", {})]
    cases += [(4, 2048, 0, "bf16", t) for t in (dict(num_stages=3), dict(block_n=32),
                                                  dict(block_m=64, num_warps=4))]
    rows = []
    for batch, new, prefix, kv_dtype, tiles in cases:
        kernel, sdpa, flops = prefill_case(batch, new, prefix, kv_dtype, tiles)
        max_diff = (kernel().float() - sdpa().float()).abs().max().item()  # also compiles outside the timing
        ms, ms_sdpa = do_bench(kernel, warmup=10, rep=50), do_bench(sdpa, warmup=10, rep=50)
        tflops, tflops_sdpa = flops / ms / 1e9, flops / ms_sdpa / 1e9
        rows.append(dict(batch=batch, new_tokens=new, cached_prefix=prefix, kv_cache=kv_dtype, tiles=tiles,
                         ms=ms, tflops=tflops, sdpa_ms=ms_sdpa, sdpa_tflops=tflops_sdpa,
                         kernel_over_sdpa=ms_sdpa / ms, max_abs_diff=max_diff))
        print(f"prefill attn batch {batch} new {new:5} prefix {prefix:5} {kv_dtype:4} {str(tiles or ''):30} "
              f"{ms:7.3f} ms {tflops:6.1f} TFLOP/s | SDPA {ms_sdpa:7.3f} ms {tflops_sdpa:6.1f} TFLOP/s | "
              f"kernel speed {ms_sdpa / ms:4.2f}x SDPA's, max |diff| {max_diff:.3g}", flush=True)
        del kernel, sdpa
    torch.cuda.empty_cache()
    return rows


def random_model(mode: str, shape: dict | ModelConfig = LLAMA3_8B, device: str = "cuda"):
    """llmd's own model class for `shape` (ModelConfig fields, or a ModelConfig) with random weights, built on the
    meta device and materialised once on `device`: mode "bf16" / "fp32" unquantized in that dtype, else a quant
    mode (int8, int4-g128) over bf16 activations on CUDA and fp32 ones on the CPU."""
    from llmd.model import quant
    from llmd.model.config import ModelConfig
    from llmd.model.weights import build_empty

    config = shape if isinstance(shape, ModelConfig) else ModelConfig(**shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if mode in ("bf16", "fp32"):
        model = build_empty(config, getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[mode]), device)
    else:
        model, _ = quant.build_empty_quantized(config, dtype, device, quant.parse_quant(mode))
    # Gemma 2/3's norms scale by 1 + weight, Gemma 4's (and everyone else's) by weight; Gemma 4's layer scalars by 1
    norm_value = 0.0 if config.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") else 1.0
    gens: dict[str, torch.Generator] = {}  # per device: Gemma 4's per-layer table stays on the host
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        gen = gens.setdefault(t.device.type, torch.Generator(device=t.device).manual_seed(0))
        if t.dtype == torch.uint8:
            t.random_(0, 256, generator=gen)
        elif t.dtype == torch.int8:
            t.random_(-127, 128, generator=gen)
        elif "norm" in name or name.endswith("layer_scalar"):
            t.fill_(norm_value if "norm" in name else 1.0)
        elif name.endswith(("scales",)):
            t.uniform_(0.001, 0.01, generator=gen)
        elif name.endswith("zeros"):
            t.zero_()
        elif t.is_floating_point() and "inv_freq" not in name and "cos" not in name and "sin" not in name:
            t.normal_(0, 0.02, generator=gen)
    return model, config


def weight_bytes(model) -> tuple[int, int]:
    """(bytes the weights occupy, bytes of them one decode step reads). Every parameter and weight buffer counts
    once (a tied head is the embedding table, read whole by the logits); an untied model's embedding table is left
    out of the read (a step reads only its batch's rows), and so is Gemma 4's per-layer table (one row per token).
    The RoPE frequencies (recomputed, a few KB) are left out."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or name.endswith("inv_freq"):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    embed = model.model.embed_tokens.weight
    read = total if model.lm_head is None else total - embed.numel() * embed.element_size()
    per_layer = getattr(model.model, "embed_tokens_per_layer", None)
    if per_layer is not None:
        read -= per_layer.weight.numel() * per_layer.weight.element_size()
    return total, read


def decode_roofline(peak_gbs: float, prompt_len: int = 128, steps: int = 32) -> list[dict]:
    from decode_driver import decode_tokens_per_second

    from llmd.model.attention_backends import choose_backend

    attention = choose_backend(torch.device("cuda")).name == "triton"
    rows = []
    for mode in ("bf16", "int8", "int4-g128"):
        model, config = random_model(mode)
        _, read = weight_bytes(model)  # one embedding row per token, the rest every step
        kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # bf16 K+V
        kv = kv_per_token * (prompt_len + steps // 2)  # mean context read per step
        tok_s = decode_tokens_per_second(model, 1, prompt_len, steps, sync=torch.cuda.synchronize)
        gbs = tok_s * (read + kv) / 1e9
        roof = peak_gbs * 1e9 / (read + kv)
        rows.append(dict(mode=mode, batch=1, tok_s=tok_s, bytes_per_token=read + kv, gbs=gbs,
                         roofline_tok_s=roof, pct_roofline=100 * tok_s / roof, triton_attention=attention,
                         cuda_graphs=False))
        print(f"decode {mode:10} {tok_s:7.1f} tok/s  {gbs:6.0f} GB/s  roofline {roof:6.0f} tok/s "
              f"({100 * tok_s / roof:4.1f}%)", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def verify_cost(peak_gbs: float, prompt_len: int = 512, steps: int = 16) -> list[dict]:
    """Speculation's cost side at real shapes: time of a (k+1)-position verify step vs a 1-token decode step."""
    from decode_driver import decode_tokens_per_second

    from llmd.model.attention_backends import choose_backend

    choose_backend(torch.device("cuda")).name == "triton"
    model, _ = random_model("bf16")
    rows = []
    for batch in (1, 8):
        base = decode_tokens_per_second(model, batch, prompt_len, steps, sync=torch.cuda.synchronize)
        for k in (2, 4, 8):
            verify = decode_tokens_per_second(model, batch, prompt_len, steps, sync=torch.cuda.synchronize,
                                              query_len=k + 1)
            rows.append(dict(batch=batch, k=k, verify_over_decode=base / verify))
            print(f"verify batch {batch} k={k}: {base / verify:4.2f}x the time of a 1-token decode step", flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def engine_decode_tok_s(model, config, batch: int, graphs: bool, prompt_len: int = 128, new_tokens: int = 64,
                        rounds: int = 2) -> tuple[float, dict]:
    """Decode tok/s of `batch` greedy requests through the engine (scheduler, runner, sampler: the daemon's step),
    as batch / mean time per output token; the best of `rounds` after one warm-up round (which compiles the kernels
    and captures the graph). Default max_model_len, so the graph's attention grid is sized for the full context."""
    from llmd.engine import Engine, EngineConfig, SamplingParams
    from llmd.model.loader import LoadedModel

    loaded = LoadedModel(model, None, config, "random", torch.bfloat16, torch.device("cuda"), 0.0)
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=2 * 1024**3, cuda_graphs=graphs))
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for r in range(rounds + 1):
        for i in range(batch):
            engine.add_request(f"r{r}-{i}", torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist(),
                               params)
        tpots = []
        while engine.has_work():
            tpots += [out.timings.tpot for out in engine.step() if out.finished]
        if r > 0:
            best = max(best, batch / (sum(tpots) / len(tpots)))
    graph_info = {}
    if engine.runner.graphs is not None:
        graph_info = {"replays": engine.runner.graphs.replays,
                      "capture_seconds": dict(engine.runner.graphs.capture_seconds)}
    engine.check_no_leaks()
    del engine
    gc.collect()  # the KV pool and the graphs' memory pool go back before the next engine
    torch.cuda.empty_cache()
    return best, graph_info


def decode_cuda_graphs(peak_gbs: float) -> list[dict]:
    """Engine decode with CUDA graphs vs without, side by side (eager is the anchor)."""
    rows = []
    for name, shape in (("qwen2.5-0.5b", QWEN25_05B), ("llama3-8b", LLAMA3_8B)):
        model, config = random_model("bf16", shape)
        for batch in (1, 8):
            eager, _ = engine_decode_tok_s(model, config, batch, graphs=False)
            graphed, info = engine_decode_tok_s(model, config, batch, graphs=True)
            rows.append(dict(model=name, batch=batch, eager_tok_s=eager, graphs_tok_s=graphed,
                             graphs_over_eager=graphed / eager, **info))
            print(f"engine decode {name:12} batch {batch}: eager {eager:7.1f} tok/s | CUDA graphs {graphed:7.1f} tok/s "
                  f"| {graphed / eager:4.2f}x  (capture s: {info.get('capture_seconds')})", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def long_context_decode(peak_gbs: float, contexts=(8192, 32768), steps: int = 16) -> list[dict]:
    from decode_driver import decode_tokens_per_second

    from llmd.model.attention_backends import choose_backend
    from llmd.model.kv_int8 import bytes_per_token

    attention = choose_backend(torch.device("cuda")).name == "triton"
    model, config = random_model("bf16")
    _, read = weight_bytes(model)
    rows = []
    for context in contexts:
        for kv in ("auto", "int8"):  # auto: the model's bf16
            per_token = config.num_hidden_layers * bytes_per_token(config.num_key_value_heads, config.head_dim,
                                                                   torch.bfloat16, kv)
            kv_read = per_token * (context + steps // 2)  # mean context read per step
            tok_s = decode_tokens_per_second(model, 1, context, steps, sync=torch.cuda.synchronize,
                                             kv_cache_dtype=kv, prefill_chunk=4096)
            gbs = tok_s * (read + kv_read) / 1e9
            roof = peak_gbs * 1e9 / (read + kv_read)
            name = "bf16" if kv == "auto" else kv
            rows.append(dict(context=context, kv_cache=name, tok_s=tok_s, weight_bytes=read, kv_bytes=kv_read,
                             gbs=gbs, pct_roofline=100 * tok_s / roof, triton_attention=attention))
            print(f"long-context decode {context:6d} tokens, {name:4} KV: {tok_s:7.1f} tok/s  {gbs:6.0f} GB/s "
                  f"(weights {read / 1e9:.1f} GB + KV {kv_read / 1e9:.2f} GB per step)  {100 * tok_s / roof:4.1f}% "
                  f"of the roofline", flush=True)
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


# Real checkpoints' config.json values (Gemma 3 4B: the text part, Gemma3ForCausalLM), read by the daemon's own
# ModelConfig.from_hf_config, so that the field names and the defaults are the ones a real checkpoint goes through.
GEMMA3_4B_HF = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                    num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                    query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_theta=1_000_000.0,
                    rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                    tie_word_embeddings=True)
QWEN25_7B_HF = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1_000_000.0,
                    max_position_embeddings=32768, sliding_window=131072, use_sliding_window=False,
                    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)
# Gemma 4 E4B and 31B (the text part, Gemma4ForCausalLM): five window layers to a global one with wider heads and
# proportional RoPE; E4B's per-layer embeddings (a [vocab, 42 x 256] table) and its last 18 layers reading the K/V of
# earlier ones; 31B's global layers with 4 KV heads whose V is K (attention_k_eq_v)
_GEMMA4_HF = dict(architectures=["Gemma4ForCausalLM"], vocab_size=262144, head_dim=256, global_head_dim=512,
                  rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
                  tie_word_embeddings=True, rope_parameters={
                      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                         "rope_theta": 1_000_000.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
_GEMMA4_PERIOD = ["sliding_attention"] * 5 + ["full_attention"]
GEMMA4_E4B_HF = _GEMMA4_HF | dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                                  num_attention_heads=8, num_key_value_heads=2, layer_types=_GEMMA4_PERIOD * 7,
                                  sliding_window=512, hidden_size_per_layer_input=256,
                                  vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
                                  max_position_embeddings=131072)
GEMMA4_31B_HF = _GEMMA4_HF | dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                                  num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                                  attention_k_eq_v=True, layer_types=_GEMMA4_PERIOD * 10, sliding_window=1024,
                                  hidden_size_per_layer_input=0, max_position_embeddings=262144)
SHAPE_MODELS = {"gemma3-4b": GEMMA3_4B_HF, "qwen2.5-7b": QWEN25_7B_HF, "gemma4-e4b": GEMMA4_E4B_HF,
                "gemma4-31b": GEMMA4_31B_HF}
# the shapes stage's models; run_gpu_checks.sh's gemma4 stage runs the Gemma 4 ones (--models), in a call of its own
DEFAULT_SHAPE_MODELS = ("gemma3-4b", "qwen2.5-7b")
# --scale tiny: the same families small enough for the CPU in a second. Layers, widths, vocabulary and window shrink;
# the architecture, the GQA ratio, the 5:1 window/global pattern (with the real model's trailing window layers),
# q/k width != hidden (Gemma), qkv bias (Qwen2), the RoPE bases and query_pre_attn_scalar stay.
TINY_SHAPES = {
    "gemma3-4b": dict(num_hidden_layers=7, hidden_size=80, intermediate_size=160, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=16),
    "qwen2.5-7b": dict(num_hidden_layers=2, hidden_size=112, intermediate_size=224, num_attention_heads=7,
                       num_key_value_heads=1, vocab_size=512),
    # two periods, the second half reading the K/V of the first's last layers (as E4B's last 18 of 42 do)
    "gemma4-e4b": dict(num_hidden_layers=12, layer_types=_GEMMA4_PERIOD * 2, num_kv_shared_layers=6, hidden_size=64,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                       global_head_dim=32, hidden_size_per_layer_input=16, vocab_size=512,
                       vocab_size_per_layer_input=512, sliding_window=16),
    "gemma4-31b": dict(num_hidden_layers=6, layer_types=_GEMMA4_PERIOD, hidden_size=80, intermediate_size=160,
                       num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=16,
                       global_head_dim=32, vocab_size=512, sliding_window=16),
}
# what the shapes section runs at each scale: a 2k prompt (past Gemma 3's 1,024-token window), decode after it
SHAPE_RUNS = {"full": dict(prompt_len=2048, steps=32, warmup=2, batches=(1, 16), prefill_chunk=512),
              "tiny": dict(prompt_len=64, steps=4, warmup=1, batches=(1, 16), prefill_chunk=32)}


def shape_config(name: str, scale: str = "full") -> ModelConfig:
    """The ModelConfig of SHAPE_MODELS[name] as the daemon reads it from config.json (tiny: TINY_SHAPES over it)."""
    from llmd.model.config import ModelConfig

    return ModelConfig.from_hf_config({**SHAPE_MODELS[name], **(TINY_SHAPES[name] if scale == "tiny" else {})})


def shape_modes(device: str) -> tuple[str, ...]:
    """The unquantized dtype the device serves in (bf16 on CUDA, fp32 on the CPU), then int8 weights."""
    return ("bf16" if device == "cuda" else "fp32", "int8")


def kv_read_bytes(config: ModelConfig, batch: int, context: int, element_size: int) -> int:
    """K and V bytes one decode step reads for `batch` sequences of `context` tokens: a window layer reads only its
    window's tokens (the Triton decode kernel starts at seq_len - window), a global layer the whole context; each
    layer in its own head shape, a layer that shares another's K/V (Gemma 4) reading it again."""
    return batch * sum(2 * config.layer_num_kv_heads(i) * config.layer_head_dim(i) * element_size
                       * (context if w is None else min(context, w)) for i, w in enumerate(config.layer_windows))


def memory_bytes(device: str) -> tuple[int, int]:
    """(allocated now, peak since the last reset): the CUDA allocator's counts; on the CPU the process's peak RSS
    for both (what the test scale can report)."""
    if device == "cuda":
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return peak, peak


def measure_shape(model, config: ModelConfig, mode: str, peak_gbs: float, device: str, prompt_len: int, steps: int,
                  warmup: int, batches: tuple[int, ...], prefill_chunk: int) -> dict:
    """Prefill tok/s of one prompt_len prompt; decode tok/s at each batch after prompt_len tokens, with the bytes one
    step reads (weights + each sequence's K/V, the mean over the timed steps), the achieved GB/s and % of the
    roofline; the weights' and the peak memory."""
    from decode_driver import decode_tokens_per_second, prefill_tokens_per_second

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    weights_mem, _ = memory_bytes(device)
    resident, read = weight_bytes(model)
    kv_elem = next(p for p in model.parameters() if p.is_floating_point()).element_size()  # KV "auto": the model's
    row = dict(mode=mode, weight_bytes=resident, weight_read_bytes=read,
               prefill_tok_s=prefill_tokens_per_second(model, prompt_len, sync=sync, kv_groups=True),
               prompt_len=prompt_len)
    # the timed decode steps attend over prompt_len + s + 1 tokens, s = warmup .. warmup + steps - 1
    contexts = [prompt_len + s + 1 for s in range(warmup, warmup + steps)]
    for batch in batches:
        kv = sum(kv_read_bytes(config, batch, c, kv_elem) for c in contexts) / steps
        tok_s = decode_tokens_per_second(model, batch, prompt_len, steps, warmup=warmup, sync=sync,
                                         prefill_chunk=prefill_chunk, kv_groups=True)
        gbs = tok_s / batch * (read + kv) / 1e9  # decode steps per second x bytes per step
        row[f"b{batch}"] = dict(tok_s=tok_s, bytes_per_step=read + kv, kv_bytes_per_step=kv, gbs=gbs,
                                pct_roofline=100 * gbs / peak_gbs)
    row["mem_weights_bytes"], row["mem_peak_bytes"] = weights_mem, memory_bytes(device)[1]
    return row


SHAPE_COLUMNS = ("model", "mode", "weights GB", "prefill tok/s", "b1 tok/s", "b1 GB/s", "b1 %roof", "b16 tok/s",
                 "b16 GB/s", "b16 %roof", "b1 GB/step", "b16 GB/step", "mem GB", "peak GB")


def shape_cells(row: dict) -> list:
    """One table row's cells, in SHAPE_COLUMNS' order (bytes in GB)."""
    b1, b16 = row["b1"], row["b16"]
    return [row["model"], row["mode"], row["weight_bytes"] / 1e9, row["prefill_tok_s"], b1["tok_s"], b1["gbs"],
            b1["pct_roofline"], b16["tok_s"], b16["gbs"], b16["pct_roofline"], b1["bytes_per_step"] / 1e9,
            b16["bytes_per_step"] / 1e9, row["mem_weights_bytes"] / 1e9, row["mem_peak_bytes"] / 1e9]


def _cell(value) -> str:
    """A figure to its useful digits: whole numbers from 100 up, 2 decimals from 1, else 4 significant digits (the
    tiny scale's bytes are small fractions of a GB)."""
    if isinstance(value, str):
        return value
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4g}"


def shape_line(cells: list) -> str:
    name, mode, *figures = [_cell(c) for c in cells]
    return f"{name:11} {mode:5} " + " ".join(f"{f:>11}" for f in figures)


def real_shapes(peak_gbs: float, device: str = "cuda", scale: str = "full", models: tuple[str, ...] = ()) -> list[dict]:
    """`models` of SHAPE_MODELS (default: Gemma 3 4B and Qwen2.5-7B) of real shapes (random weights) through llmd's
    model classes, each unquantized and int8: prefill tok/s of a 2k prompt, decode tok/s at batch 1 and 16 after it,
    GB/s of weights + KV read per step and % of the roofline, weight and peak memory. A table line per model and mode
    as each finishes (the unquantized ones first: no autotuning); a failure is recorded in its row (`error`) and the
    next one runs."""
    from llmd.model.attention_backends import choose_backend

    run = SHAPE_RUNS[scale]
    attention = choose_backend(torch.device(device)).name  # as decode_driver picks it
    print(f"shapes ({scale}, {device}, {attention} attention): prompt {run['prompt_len']} tokens, decode "
          f"{run['steps']} steps at batch {', '.join(map(str, run['batches']))} after it; GB/step = weights + K/V "
          "read per step", flush=True)
    print(shape_line(list(SHAPE_COLUMNS)), flush=True)
    rows = []
    for mode in shape_modes(device):
        for name in models or DEFAULT_SHAPE_MODELS:
            config = shape_config(name, scale)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                model, _ = random_model(mode, config, device)
                row = {"model": name, "attention": attention,
                       **measure_shape(model, config, mode, peak_gbs, device, **run)}
                print(shape_line(shape_cells(row)), flush=True)
            except Exception:
                row = dict(model=name, mode=mode, error=traceback.format_exc())
                print(f"{name:11} {mode:5} failed:\n{row['error']}", flush=True)
            rows.append(row)
            model = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# name: (hidden, expert intermediate size, experts, top k, GGUF type of the experts, activation, expert biases)
MOE_SHAPES = {"full": {"gpt-oss-20b": (2880, 2880, 32, 4, "MXFP4", "swiglu_clamped", True),
                       "qwen3-30b-a3b": (2048, 768, 128, 8, "Q4_K", "silu", False)},
              "tiny": {"gpt-oss-20b": (64, 64, 8, 4, "MXFP4", "swiglu_clamped", True),
                       "qwen3-30b-a3b": (256, 256, 8, 4, "Q4_K", "silu", False)}}


def _random_expert_blocks(type_name: str, experts: int, rows: int, k: int, device: str) -> torch.Tensor:
    """uint8 [experts, rows, row bytes]: random quants, fp16 scales of ~0.01, E8M0 exponents 2^-10..2^-7 (the kernel
    tests' recipe, made on the device)."""
    from llmd.kernels.gguf_matmul import TYPES

    t = TYPES[type_name]
    nb = experts * rows * k // t.block_elems
    b = torch.randint(0, 256, (nb, t.block_bytes), dtype=torch.uint8, device=device)
    for off in t.f16_at:
        b[:, off:off + 2] = (torch.randn(nb, device=device) * 0.01).half().view(torch.uint8).view(nb, 2)
    for off in t.e8m0_at:
        b[:, off] = torch.randint(118, 122, (nb,), dtype=torch.uint8, device=device)
    return b.view(experts, rows, -1)


def moe_bandwidth(peak_gbs: float, device: str = "cuda", scale: str = "full", batches=(1, 4, 16),
                  models: tuple[str, ...] = ()) -> list[dict]:
    """Per model shape and batch: the fused kernel's time (autotuned on CUDA; its first call, compiles and autotuning
    included, reported apart), GB/s of the hit experts' bytes (weights and biases), and its largest error relative
    to the torch reference's largest output (a row fails the run past 2e-2)."""
    import os

    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    from llmd.kernels import moe_matmul as mm

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    rows = []
    for model, (hidden, inter, experts, top_k, kind, act, bias) in MOE_SHAPES[scale].items():
        if models and model not in models:
            continue
        gen = torch.Generator(device).manual_seed(0)
        up_bias, down_bias = ((torch.randn(experts, n, device=device, generator=gen) * 0.1).to(dtype) if bias
                              else None for n in (2 * inter, hidden))
        gate_up = mm.ExpertWeights(((_random_expert_blocks(kind, experts, 2 * inter, hidden, device), kind),),
                                   hidden, up_bias)
        down = mm.ExpertWeights(((_random_expert_blocks(kind, experts, hidden, inter, device), kind),), inter,
                                down_bias)
        activation = mm.Activation(act)
        per_expert = sum(w[0].numel() for proj in (gate_up, down) for w, _ in proj.parts) + \
            (sum(p.bias[0].numel() * p.bias.element_size() for p in (gate_up, down)) if bias else 0)
        for batch in batches:
            x = torch.randn(batch, hidden, device=device, generator=gen).to(dtype)
            top, ids = torch.topk(torch.randn(batch, experts, device=device, generator=gen), top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
            fn = functools.partial(mm.moe_matmul, x, ids, weights, gate_up, down, activation)
            start = time.perf_counter()
            out = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            ref = mm.moe_matmul_ref(x, ids, weights, gate_up, down, activation)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            if device == "cuda":
                from triton.testing import do_bench

                ms = do_bench(fn, warmup=10, rep=30)
            else:  # the interpreter has nothing to compile: its first call is its time
                ms = first_s * 1e3
            hit = torch.unique(ids).numel()
            gbs = hit * per_expert / ms / 1e6
            row = dict(model=model, type=kind, batch=batch, experts_hit=hit, us=ms * 1e3, gbs=gbs,
                       pct_peak=100 * gbs / peak_gbs, first_call_s=first_s, rel_err=err,
                       tiling=mm._best.get(mm._key(x, ids, gate_up, down, activation)))
            if not err < 2e-2:
                row["error"] = f"{model} batch {batch}: relative error {err:.2e} against the reference"
            rows.append(row)
            print(f"moe {model:13} {kind:5} batch {batch:2}: {hit:3} experts hit  {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s "
                  f"{100 * gbs / peak_gbs:5.1f}% of peak  (first call {first_s:5.1f} s)  rel err {err:.1e}",
                  flush=True)
    return rows


# (q/k heads, value heads, head dim, conv taps, decode batches, prefill chunk)
HYBRID_SHAPES = {"full": {"qwen3.5-9b": (16, 32, 128, 4, (1, 16), 2048)},
                 "tiny": {"qwen3.5-9b": (2, 4, 32, 4, (1, 3), 40)}}
# (heads, head dim, state size, groups, conv taps, decode batches, prefill chunk) of a Mamba2 layer
MAMBA2_SHAPES = {"full": {"granite-4.0-h-small": (128, 64, 128, 1, 4, (1, 16), 2048)},
                 "tiny": {"granite-4.0-h-small": (4, 16, 16, 1, 4, (1, 3), 40)}}


def _hybrid_step(lens: list[int], shape: tuple, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """One layer's step inputs: the conv's input and weights, its states (slot b for sequence b, continuing), and
    q/k/v as views of the conv's output (the model's layout), g and beta."""
    from llmd.model import recurrent as rec

    hk, hv, d, taps = shape[:4]
    channels, t, b = 2 * hk * d + hv * d, sum(lens), len(lens)
    gen = torch.Generator(device).manual_seed(seed)
    qkv = torch.randn(t, channels, device=device, generator=gen).to(dtype)
    return dict(meta=rec.StateMetadata.build(list(range(b)), [False] * b, lens, device),
                x=torch.randn(t, channels, device=device, generator=gen).to(dtype),
                weight=(torch.randn(channels, taps, device=device, generator=gen) * 0.3).to(dtype),
                conv=torch.randn(b + 1, channels, taps - 1, device=device, generator=gen).to(dtype),
                ssm=torch.randn(b + 1, hv, d, d, device=device, generator=gen) * 0.05,
                q=qkv[:, : hk * d].view(t, hk, d), k=qkv[:, hk * d : 2 * hk * d].view(t, hk, d),
                v=qkv[:, 2 * hk * d :].view(t, hv, d), g=-torch.rand(t, hv, device=device, generator=gen) * 0.3,
                beta=torch.rand(t, hv, device=device, generator=gen).to(dtype))


def _timed(fn, state: torch.Tensor, device: str) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(ms, first call's s, output, state after one call) of fn(state), each call from a copy of `state`"""
    once = state.clone()
    start = time.perf_counter()
    out = fn(once)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    if device == "cuda":
        from triton.testing import do_bench

        scratch = state.clone()  # the timed calls run on from the state they leave
        return do_bench(lambda: fn(scratch), warmup=5, rep=20), first, out, once
    return first * 1e3, first, out, once


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """the largest error relative to the reference's largest value"""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def _hybrid_case(name: str, lens: list[int], shape: tuple, device: str, peak_gbs: float,
                 chunk_from: int | None = None, reference: bool = False) -> dict:
    """The conv and the delta rule on one step (each from the step's initial states), timed, checked against the
    reference (largest error relative to its largest output; the state against the reference's state)."""
    from llmd.kernels import recurrent_triton as rt
    from llmd.model import recurrent as rec

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = _hybrid_step(lens, shape, device, dtype)
    meta = a["meta"]
    kernel_args = (*meta.kernel_tensors(),)
    options = dict(max_len=meta.max_query_len) | ({} if chunk_from is None else dict(chunk_from=chunk_from))

    def conv(state):
        return rt.causal_conv1d(a["x"], a["weight"], None, state, *kernel_args, max_len=meta.max_query_len)

    def rule(state):
        return rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], state, *kernel_args, **options)

    conv_ms, conv_first, y, conv_state = _timed(conv, a["conv"], device)
    rule_ms, rule_first, o, ssm_state = _timed(rule, a["ssm"], device)
    exact = {key: a[key].float() for key in ("x", "weight", "q", "k", "v", "beta")}
    ref_conv, ref_ssm = a["conv"].float(), a["ssm"].clone()
    start = time.perf_counter()
    want_y = rec.causal_conv1d_ref(exact["x"], exact["weight"], None, ref_conv, meta)
    want_o = rec.gated_delta_rule_ref(exact["q"], exact["k"], exact["v"], a["g"], exact["beta"], ref_ssm, meta)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_ms = (time.perf_counter() - start) * 1e3

    errors = dict(conv=_rel(y, want_y), conv_state=_rel(conv_state, ref_conv), rule=_rel(o, want_o),
                  state=_rel(ssm_state, ref_ssm))
    hk, hv, d = shape[:3]
    state_bytes = len(lens) * hv * d * d * 4 * 2  # each sequence's fp32 state, read and written
    row = dict(case=name, tokens=sum(lens), batch=len(lens), conv_us=conv_ms * 1e3, rule_us=rule_ms * 1e3,
               first_call_s=conv_first + rule_first, state_gbs=state_bytes / rule_ms / 1e6,
               pct_peak=100 * state_bytes / rule_ms / 1e6 / peak_gbs, tok_s=sum(lens) / rule_ms * 1e3,
               rel_err=errors)
    if reference:
        row["reference_ms"] = ref_ms
    bad = {k: v for k, v in errors.items() if not v < 2e-2}
    if bad:
        row["error"] = f"{name}: relative error {bad} against the reference"
    return row


def _mamba2_case(name: str, lens: list[int], shape: tuple, device: str, peak_gbs: float,
                 chunk_from: int | None = None, reference: bool = False) -> dict:
    """A Mamba2 layer's conv and scan on one step (each from the step's initial states: slot b for sequence b,
    continuing), timed, checked against the reference as _hybrid_case checks the delta rule."""
    from llmd.kernels import recurrent_triton as rt
    from llmd.model import recurrent as rec

    heads, p, n, groups, taps = shape[:5]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    channels, t, b = heads * p + 2 * groups * n, sum(lens), len(lens)
    gen = torch.Generator(device).manual_seed(0)

    def rand(*size, scale=1.0, shift=0.0):
        return torch.randn(*size, device=device, generator=gen) * scale + shift

    meta = rec.StateMetadata.build(list(range(b)), [False] * b, lens, device)
    x, weight, bias = rand(t, channels).to(dtype), rand(channels, taps, scale=0.3).to(dtype), \
        rand(channels, scale=0.1).to(dtype)
    conv0, ssm0 = rand(b + 1, channels, taps - 1).to(dtype), rand(b + 1, heads, p, n, scale=0.05)
    xbc = rand(t, channels).to(dtype)  # the scan's inputs: views of the conv's output, as the model passes them
    xs, bm, cm = xbc[:, : heads * p].view(t, heads, p), xbc[:, heads * p : heads * p + groups * n].view(t, groups, n), \
        xbc[:, heads * p + groups * n :].view(t, groups, n)
    dt, dt_bias = rand(t, heads, shift=-2.0).to(dtype), rand(heads, scale=0.1).to(dtype)
    a, d = -torch.rand(heads, device=device, generator=gen) * 4.0 - 0.5, rand(heads).to(dtype)
    kernel_args = (*meta.kernel_tensors(),)
    options = dict(max_len=meta.max_query_len) | ({} if chunk_from is None else dict(chunk_from=chunk_from))

    def conv(state):
        return rt.causal_conv1d(x, weight, bias, state, *kernel_args, max_len=meta.max_query_len)

    def scan(state):
        return rt.mamba2_scan(xs, dt, dt_bias, a, bm, cm, d, state, *kernel_args, **options)

    conv_ms, conv_first, y, conv_state = _timed(conv, conv0, device)
    scan_ms, scan_first, o, ssm_state = _timed(scan, ssm0, device)
    ref_conv, ref_ssm = conv0.float(), ssm0.clone()
    start = time.perf_counter()
    want_y = rec.causal_conv1d_ref(x.float(), weight.float(), bias.float(), ref_conv, meta)
    want_o = rec.mamba2_scan_ref(xs.float(), dt.float(), dt_bias.float(), a, bm.float(), cm.float(), d.float(),
                                 ref_ssm, meta)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_ms = (time.perf_counter() - start) * 1e3
    errors = dict(conv=_rel(y, want_y), conv_state=_rel(conv_state, ref_conv), scan=_rel(o, want_o),
                  state=_rel(ssm_state, ref_ssm))
    state_bytes = b * heads * p * n * 4 * 2  # each sequence's fp32 state, read and written
    row = dict(case=name, tokens=t, batch=b, conv_us=conv_ms * 1e3, scan_us=scan_ms * 1e3,
               first_call_s=conv_first + scan_first, state_gbs=state_bytes / scan_ms / 1e6,
               pct_peak=100 * state_bytes / scan_ms / 1e6 / peak_gbs, tok_s=t / scan_ms * 1e3, rel_err=errors)
    if reference:
        row["reference_ms"] = ref_ms
    bad = {k: v for k, v in errors.items() if not v < 2e-2}
    if bad:
        row["error"] = f"{name}: relative error {bad} against the reference"
    return row


def _hybrid_cases(batches: tuple, chunk: int) -> list[tuple[str, list[int], int | None, bool]]:
    """(name, lengths, chunk_from, time the reference): decode steps at each batch (token by token), the prefill chunk
    by the chunked kernel (the reference timed once beside it) and by the token-by-token one."""
    return [(f"decode batch {b}", [1] * b, None, False) for b in batches] + \
        [(f"prefill {chunk} chunked", [chunk], None, True), (f"prefill {chunk} by token", [chunk], chunk + 1, False)]


def hybrid_recurrent(peak_gbs: float, device: str = "cuda", scale: str = "full") -> list[dict]:
    """Per model shape: decode steps at each batch (token by token), the prefill chunk by the chunked kernel and by
    the token-by-token one (and the torch reference's time, one run); the Gated DeltaNet shapes first, then the
    Mamba2 ones."""
    import os

    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    rows = []
    for model, shape in HYBRID_SHAPES[scale].items():
        for name, lens, chunk_from, reference in _hybrid_cases(shape[4], shape[5]):
            row = dict(model=model) | _hybrid_case(name, lens, shape, device, peak_gbs, chunk_from, reference)
            rows.append(row)
            speed = f"{row['tok_s']:9.0f} tok/s" if len(lens) == 1 and lens[0] > 1 else \
                f"state {row['state_gbs']:5.0f} GB/s ({row['pct_peak']:4.1f}% of peak)"
            extra = f"  torch reference {row['reference_ms']:9.1f} ms" if reference else ""
            print(f"hybrid {model} {name:22}: conv {row['conv_us']:9.1f} us  delta rule {row['rule_us']:10.1f} us  "
                  f"{speed}  max rel err {max(row['rel_err'].values()):.1e}  "
                  f"(first calls {row['first_call_s']:4.1f} s){extra}", flush=True)
    for model, shape in MAMBA2_SHAPES[scale].items():
        for name, lens, chunk_from, reference in _hybrid_cases(shape[5], shape[6]):
            row = dict(model=model) | _mamba2_case(name, lens, shape, device, peak_gbs, chunk_from, reference)
            rows.append(row)
            speed = f"{row['tok_s']:9.0f} tok/s" if len(lens) == 1 and lens[0] > 1 else \
                f"state {row['state_gbs']:5.0f} GB/s ({row['pct_peak']:4.1f}% of peak)"
            extra = f"  torch reference {row['reference_ms']:9.1f} ms" if reference else ""
            print(f"hybrid {model} {name:22}: conv {row['conv_us']:9.1f} us  scan {row['scan_us']:10.1f} us  "
                  f"{speed}  max rel err {max(row['rel_err'].values()):.1e}  "
                  f"(first calls {row['first_call_s']:4.1f} s){extra}", flush=True)
    return rows


SECTIONS = {"decode_cuda_graphs": decode_cuda_graphs, "kernels": kernel_bandwidth,
            "prefill_attention": prefill_attention_speed, "decode": decode_roofline, "spec_verify": verify_cost,
            "gguf_kernels": gguf_kernel_bandwidth, "long_context": long_context_decode, "shapes": real_shapes,
            "moe": moe_bandwidth, "hybrid": hybrid_recurrent}
# run_gpu_checks.sh runs these on their own, with their own time limits
APART = ("gguf_kernels", "long_context", "shapes", "moe", "hybrid")
SCALED = ("shapes", "moe", "hybrid")  # the sections that take --device and --scale (the others need CUDA at full size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--peak-gbs", type=float, default=4800.0)  # H200 HBM3e
    parser.add_argument("--sections", default="", help=f"comma-separated, of: {', '.join(SECTIONS)} (default all "
                                                       f"but {', '.join(APART)})")
    parser.add_argument("--name", default="gpu_bench", help="the JSON file's name under --out, without .json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help=f"cpu: only for {', '.join(SCALED)}, to check the code path without a GPU")
    parser.add_argument("--scale", default="full", choices=tuple(SHAPE_RUNS),
                        help=f"tiny: {', '.join(SCALED)} at a size the CPU runs in seconds")
    parser.add_argument("--models", default="",
                        help=f"comma-separated: of {', '.join(SHAPE_MODELS)} (shapes), of "
                             f"{', '.join(MOE_SHAPES['full'])} (moe); default each section's own")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.sections.split(",") if args.sections else [s for s in SECTIONS if s not in APART]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}")
    unknown = [m for m in args.models.split(",") if m and m not in {*SHAPE_MODELS, *MOE_SHAPES["full"]}]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}")
    if (args.device, args.scale) != ("cuda", "full") and any(s not in SCALED for s in chosen):
        parser.error(f"--device cpu and --scale tiny apply only to --sections {','.join(SCALED)}")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict = {"device": device_name, "peak_gbs": args.peak_gbs, "scale": args.scale}
    for name in chosen:
        fn = SECTIONS[name]
        start = time.perf_counter()
        try:
            if name in SCALED:
                models = tuple(m for m in args.models.split(",") if m)  # (shapes and moe take a choice)
                results[name] = fn(args.peak_gbs, device=args.device, scale=args.scale,
                                   **({"models": models} if models else {}))
            else:
                results[name] = fn(args.peak_gbs)
            failed = [r["error"] for r in results[name] if isinstance(r, dict) and "error" in r]
            if failed:  # a row's failure, kept in its row, fails the run
                results[name + "_error"] = "\n".join(failed)
        except Exception:
            results[name + "_error"] = traceback.format_exc()
            print(results[name + "_error"], flush=True)
        results[name + "_seconds"] = time.perf_counter() - start
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    return 0 if not any(k.endswith("_error") for k in results) else 1


if __name__ == "__main__":
    sys.exit(main())
