"""The CPU glue ops of a decoder layer (llmd.kernels.cpu_ops) against the torch code they replace, at SmolLM2-135M
shapes (hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64, blocks of 16 tokens). Prints figures.

    python tests/benchmarks/bench_cpu_ops.py [--threads 1] [--budget 0.3]

For each op and size it prints microseconds per call (best of repeated calls, Python wrapper included) for the C op
and for llmd's torch path, and their ratio. Decode attention runs B sequences of L cached tokens each; prefill
attention one chunk of N new tokens whose context then holds C.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmd.kernels import cpu_ops
from llmd.model.attention import AttentionMetadata, DecodePlan, batched_decode_attention, torch_paged_attention
from llmd.model.ops import apply_rope

HIDDEN, INTER, HEADS, KV_HEADS, D, BLOCK = 576, 1536, 9, 3, 64, 16


def best_us(fn, budget_s: float) -> float:
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def cases(rows: int):
    """(name, C op, torch code) at `rows` tokens."""
    x, w = torch.randn(rows, HIDDEN), torch.rand(HIDDEN) + 0.5
    gate_up = torch.randn(rows, 2 * INTER)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * D)
    angles = torch.rand(rows, 1, D // 2) * 6.28  # a true rotation: repeated in-place calls keep the values' size
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    qk = qkv[:, : (HEADS + KV_HEADS) * D]
    return [
        ("rms_norm", lambda: cpu_ops.rms_norm(x, w, 1e-5), lambda: F.rms_norm(x, (HIDDEN,), w, 1e-5)),
        ("silu_mul", lambda: cpu_ops.silu_mul(gate_up, INTER),
         lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]),
        ("rope", lambda: cpu_ops.rope_(qkv, cos, sin, HEADS + KV_HEADS, D),
         lambda: apply_rope(qk.view(rows, HEADS + KV_HEADS, D), cos, sin)),
    ]


def attention_case(batch: int, length: int):
    nb = (length + BLOCK - 1) // BLOCK
    k_cache = torch.randn(batch * nb + 1, BLOCK, KV_HEADS, D)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [length] * batch, tables, BLOCK)
    plan = DecodePlan.build(meta)
    q, out = torch.randn(batch, HEADS, D), torch.empty(batch, HEADS, D)
    k, v = torch.randn(batch, KV_HEADS, D), torch.randn(batch, KV_HEADS, D)

    def c_op():
        cpu_ops.write_kv(k, v, (k_cache, v_cache), meta.slot_mapping)
        cpu_ops.decode_attention(q, (k_cache, v_cache), plan.block_tables, plan.seq_lens, None, 0.125, out)

    def torch_code():  # the torch backend's write_kv and attend (llmd.model.attention_backends)
        k_cache.view(-1, KV_HEADS, D).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, KV_HEADS, D).index_copy_(0, meta.slot_mapping, v)
        batched_decode_attention(q, (k_cache, v_cache), plan, 0.125)

    return c_op, torch_code


def prefill_case(new: int, context: int):
    nb = (context + BLOCK - 1) // BLOCK
    k_cache, v_cache = torch.randn(nb + 1, BLOCK, KV_HEADS, D), torch.randn(nb + 1, BLOCK, KV_HEADS, D)
    table = torch.arange(nb)
    meta = AttentionMetadata.build([new], [context], [table.tolist()], BLOCK)
    q, out = torch.randn(new, HEADS, D), torch.empty(new, HEADS, D)
    return (lambda: cpu_ops.prefill_attention(q, (k_cache, v_cache), table, context, 0.125, out),
            lambda: torch_paged_attention(q, (k_cache, v_cache), meta, 0.125))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of repeated calls per figure")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        print("llmd's CPU ops are unavailable here (see the log line above): nothing to compare")
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s); microseconds per call, best of repeats")
    print(f"{'op':28} {'C op':>9} {'torch':>9} {'torch / C':>10}")
    rows_cases = [(f"{name} ({rows} rows)", c, t) for rows in (1, 16, 512) for name, c, t in cases(rows)]
    attn_cases = [(f"write_kv + attention {b}x{n}", *attention_case(b, n))
                  for b, n in ((1, 100), (1, 2000), (16, 100), (16, 400))]
    attn_cases += [(f"prefill attention {n} of {c}", *prefill_case(n, c)) for n, c in ((512, 512), (488, 1000))]
    with torch.inference_mode():
        for name, c_op, torch_code in rows_cases + attn_cases:
            c_us, t_us = best_us(c_op, args.budget), best_us(torch_code, args.budget)
            print(f"{name:28} {c_us:9.1f} {t_us:9.1f} {t_us / c_us:9.1f}x", flush=True)


if __name__ == "__main__":
    main()
