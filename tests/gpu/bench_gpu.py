"""GPU figures for the quantized kernels and decode (H200 by default; run by tests/gpu/run_gpu_checks.sh).

1. Per-kernel GB/s and % of peak bandwidth at Llama-3-8B and Qwen2.5-7B linear shapes for M = 1..32: torch bf16
   matmul, int8 (per-channel) and int4 (g128) fused kernels.
2. End-to-end decode tok/s at batch 1 for a random-weight Llama-3-8B in bf16 / int8 / int4, with achieved GB/s and
   % of the roofline (weight + KV bytes read per token / peak bandwidth).
Writes JSON and a text table to --out. Imports nothing outside torch/triton/llmd.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

SHAPES = {  # name: [(N, K)] of one decoder layer's projections (q, k/v, o, gate/up, down)
    "llama3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
    "qwen2.5-7b": [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)],
}
LLAMA3_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rope_theta=500000.0, max_position_embeddings=8192)


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


def random_model(mode: str):
    from llmd.model import quant
    from llmd.model.config import ModelConfig
    from llmd.model.weights import build_empty

    config = ModelConfig(**LLAMA3_8B)
    if mode == "bf16":
        model = build_empty(config, torch.bfloat16, "cuda")
    else:
        model, _ = quant.build_empty_quantized(config, torch.bfloat16, "cuda", quant.parse_quant(mode))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.dtype == torch.uint8:
            t.random_(0, 256, generator=gen)
        elif t.dtype == torch.int8:
            t.random_(-127, 128, generator=gen)
        elif "norm" in name:
            t.fill_(1.0)
        elif name.endswith(("scales",)):
            t.uniform_(0.001, 0.01, generator=gen)
        elif name.endswith("zeros"):
            t.zero_()
        elif t.is_floating_point() and "inv_freq" not in name and "cos" not in name and "sin" not in name:
            t.normal_(0, 0.02, generator=gen)
    return model, config


def decode_roofline(peak_gbs: float, prompt_len: int = 128, steps: int = 32) -> list[dict]:
    from decode_driver import decode_tokens_per_second

    from llmd.kernels.paged_attention import enable_cuda_attention

    attention = enable_cuda_attention()
    rows = []
    for mode in ("bf16", "int8", "int4-g128"):
        model, config = random_model(mode)
        seen, total = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        embed = model.model.embed_tokens.weight
        read = total - embed.numel() * embed.element_size()  # one embedding row per token, the rest every step
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

    from llmd.kernels.paged_attention import enable_cuda_attention

    enable_cuda_attention()
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--peak-gbs", type=float, default=4800.0)  # H200 HBM3e
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "peak_gbs": args.peak_gbs}
    for name, fn in (("kernels", kernel_bandwidth), ("decode", decode_roofline), ("spec_verify", verify_cost)):
        start = time.perf_counter()
        try:
            results[name] = fn(args.peak_gbs)
        except Exception:
            results[name + "_error"] = traceback.format_exc()
            print(results[name + "_error"], flush=True)
        results[name + "_seconds"] = time.perf_counter() - start
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    return 0 if not any(k.endswith("_error") for k in results) else 1


if __name__ == "__main__":
    sys.exit(main())
