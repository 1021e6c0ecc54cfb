"""One recurrent layer's ops on the CPU, the torch reference (llmd.model.recurrent's *_ref) vs the C kernels
(llmd.kernels.cpu_recurrent), for a prefill chunk of one sequence and a decode step of a batch, each sequence
continuing from a state it already has: a Gated DeltaNet layer at Qwen3.5-4B's (and 9B's) shape and a Mamba2 layer at
Granite 4.0-H-Small's.

    python tests/benchmarks/bench_cpu_recurrent.py [--layers qwen3.5,granite4-h] [--threads 2] [--chunk 512]
                                                   [--batch 4] [--repeat 3]

Shape: 16 q/k heads and 32 value heads of 128 (Dk = Dv = 128), a 4-tap convolution over 2 * 16 * 128 + 32 * 128 = 8192
channels (Qwen3.5-4B and 9B alike). Prints the best of --repeat runs, in ms, of causal_conv1d and gated_delta_rule on
each path, the C recurrence's GFLOP/s (7 Dk Dv flops per token and value head: the decay, S^T k, the update and S^T q),
and, for the prefill chunk, transformers' torch form of the chunked (matmul) algorithm
(`torch_chunk_gated_delta_rule`, chunks of 64, torch's matmuls) where transformers is installed, and the chunked form's
bound (its flops at the rate torch's matmul reaches on its products): the figures behind keeping the recurrence in C. The paths' outputs are compared as they run (largest difference printed). No asserts on
speed: the figures are for reading.

Mamba2 (--layers granite4-h): 128 heads of 64, a state of 128, one group of B/C, a 4-tap convolution (with bias) over
128 * 64 + 2 * 128 = 8448 channels (Granite-4.0-H-Small; H-Tiny has 48 such heads). Prints the conv and the scan on each
path, the C scan's GFLOP/s (5 P N flops per token and head: the decay, the update and S C) and, for a decode step, its
states' GB/s (each sequence's fp32 state read and written once: what bounds it), and, for the prefill chunk,
transformers' torch chunked (SSD) scan (`mamba2_chunk_scan`, chunks of 64) where transformers is installed, and the
chunked form's bound at torch's matmul rate: its flops are about the recurrence's (4 P N + 2 L P per token and head
against 5 P N), so the two rates decide whether a chunked C form would pay (one core: 61 against 65 to 88 GFLOP/s,
1.4x at most; cpu_recurrent.c).
"""

from __future__ import annotations

import argparse
import time

import torch

from llmd.kernels import cpu_recurrent
from llmd.model import recurrent as rec

HK, HV, DK, DV, TAPS = 16, 32, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV
# Granite-4.0-H-Small's Mamba2 layer: heads, head dim, state size, groups (the conv's taps: TAPS)
MH, MP, MN, MG = 128, 64, 128, 1
MAMBA_CHANNELS = MH * MP + 2 * MG * MN


def inputs(tokens: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, CHANNELS, generator=g)
    q = qkv[:, : HK * DK].view(tokens, HK, DK)  # views of the conv's output, as the model passes them
    k = qkv[:, HK * DK : 2 * HK * DK].view(tokens, HK, DK)
    v = qkv[:, 2 * HK * DK :].view(tokens, HV, DV)
    return dict(x=torch.randn(tokens, CHANNELS, generator=g), weight=torch.randn(CHANNELS, TAPS, generator=g) * 0.3,
                q=q, k=k, v=v, g=-torch.rand(tokens, HV, generator=g) * 0.2,
                beta=torch.rand(tokens, HV, generator=g))


def best_ms(fn, repeat: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best, out


def run(name: str, lens: list[int], repeat: int) -> None:
    batch = len(lens)
    meta = rec.StateMetadata.build(list(range(batch)), [False] * batch, lens)
    a = inputs(sum(lens))
    gen = torch.Generator().manual_seed(1)
    conv0 = torch.randn(batch + 1, CHANNELS, TAPS - 1, generator=gen)
    ssm0 = torch.randn(batch + 1, HV, DK, DV, generator=gen) * 0.05
    conv_args = (a["x"], a["weight"], None)
    rule_args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    figures = {}
    for path, conv, rule in (("torch", rec.causal_conv1d_ref, rec.gated_delta_rule_ref),
                             ("C", rec.causal_conv1d, rec.gated_delta_rule)):
        # each run starts from the same states (copied outside the timing)
        states = [(conv0.clone(), ssm0.clone()) for _ in range(repeat)]
        it = iter(states)
        ms_conv, y_conv = best_ms(lambda: conv(*conv_args, next(it)[0], meta), repeat)
        it = iter(states)
        ms_rule, y_rule = best_ms(lambda: rule(*rule_args, next(it)[1], meta), repeat)
        figures[path] = (ms_conv, ms_rule, y_conv, y_rule)
    t = sum(lens)
    gflop = 7 * DK * DV * HV * t / 1e9
    (tc, tr, tyc, tyr), (cc, cr, cyc, cyr) = figures["torch"], figures["C"]
    print(f"{name}: {t} tokens")
    print(f"  causal_conv1d     torch {tc:9.2f} ms   C {cc:8.2f} ms   x{tc / cc:6.1f}   "
          f"max diff {(tyc - cyc).abs().max().item():.1e}")
    print(f"  gated_delta_rule  torch {tr:9.2f} ms   C {cr:8.2f} ms   x{tr / cr:6.1f}   "
          f"max diff {(tyr - cyr).abs().max().item():.1e}   C {gflop / cr * 1e3:5.1f} GFLOP/s")
    if batch == 1 and t > 1:
        chunked(rule_args, ssm0[0], repeat, cyr)


# the chunked form's multiply-adds per token and value head, as full products, chunks of CHUNK: K K^T, Q K^T, the
# two products by the inverse (W and U), W S, Q S, the masked Q K^T by u, K^T u (the chunk's triangular inverse,
# ~CHUNK^2 / 3 more, left out)
CHUNK = 64
CHUNKED_FLOP = 2 * (CHUNK * DK * 2 + CHUNK * DK + CHUNK * DV * 2 + DK * DV * 3)


def chunked(rule_args: tuple, state: torch.Tensor, repeat: int, want: torch.Tensor) -> None:
    """The chunked (matmul) form on the same chunk: its bound at the rate torch's matmul reaches on its largest
    products (a batch of [64, 128] x [128, 128], one per value head) next to the C recurrence's rate, both the best
    of 20 short calls (a 64-token piece of the chunk for the recurrence, continuing a state), so that a busy machine
    slows both alike; and transformers' torch code of the chunked form on the whole chunk."""
    t = rule_args[0].shape[0]
    a, b = torch.randn(HV, CHUNK, DK), torch.randn(HV, DK, DV)
    ms, _ = best_ms(lambda: torch.bmm(a, b), 20)
    rate = 2 * HV * CHUNK * DK * DV / ms / 1e6  # GFLOP/s
    piece = [x[:CHUNK] for x in rule_args]
    meta, ssm = rec.StateMetadata.build([0], [False], [CHUNK]), state[None].clone()
    c_ms, _ = best_ms(lambda: rec.gated_delta_rule(*piece, ssm, meta), 20)
    c_rate = 7 * DK * DV * HV * CHUNK / c_ms / 1e6
    print(f"  chunked form: {CHUNKED_FLOP / (7 * DK * DV):.2f}x the recurrence's flops; at torch's matmul rate on its "
          f"products ({rate:.0f} GFLOP/s) at least {CHUNKED_FLOP * HV * t / rate / 1e6:.2f} ms for the chunk; the C "
          f"recurrence at its rate ({c_rate:.0f} GFLOP/s) {7 * DK * DV * HV * t / c_rate / 1e6:.2f} ms")
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError:
        print("  (transformers not installed: no figure of its torch chunked form)")
        return
    q, k, v, g, beta = rule_args
    fn = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    ms, (out, _) = best_ms(lambda: fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True), repeat)
    print(f"  chunked form as transformers writes it in torch: {ms:8.2f} ms   "
          f"max diff to C {(out[0] - want).abs().max().item():.1e}")


def mamba2_inputs(tokens: int, seed: int = 0) -> dict:
    """The conv's input, weight and bias, and x, B, C as views of the conv's output (the model's layout), dt, dt_bias,
    A < 0 and D."""
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(tokens, MAMBA_CHANNELS, generator=g)
    return dict(conv_x=torch.randn(tokens, MAMBA_CHANNELS, generator=g),
                weight=torch.randn(MAMBA_CHANNELS, TAPS, generator=g) * 0.3,
                bias=torch.randn(MAMBA_CHANNELS, generator=g) * 0.1, x=xbc[:, : MH * MP].view(tokens, MH, MP),
                B=xbc[:, MH * MP : MH * MP + MG * MN].view(tokens, MG, MN),
                C=xbc[:, MH * MP + MG * MN :].view(tokens, MG, MN), dt=torch.randn(tokens, MH, generator=g) - 2.0,
                dt_bias=torch.randn(MH, generator=g) * 0.1, A=-torch.rand(MH, generator=g) * 4.0 - 0.5,
                D=torch.randn(MH, generator=g))


def run_mamba2(name: str, lens: list[int], repeat: int) -> None:
    batch, t = len(lens), sum(lens)
    meta = rec.StateMetadata.build(list(range(batch)), [False] * batch, lens)
    a = mamba2_inputs(t)
    gen = torch.Generator().manual_seed(1)
    conv0 = torch.randn(batch + 1, MAMBA_CHANNELS, TAPS - 1, generator=gen)
    ssm0 = torch.randn(batch + 1, MH, MP, MN, generator=gen) * 0.05
    scan_args = (a["x"], a["dt"], a["dt_bias"], a["A"], a["B"], a["C"], a["D"])
    figures = {}
    for path, conv, scan in (("torch", rec.causal_conv1d_ref, rec.mamba2_scan_ref),
                             ("C", rec.causal_conv1d, rec.mamba2_scan)):
        states = [(conv0.clone(), ssm0.clone()) for _ in range(repeat)]  # each run from the same states
        it = iter(states)
        ms_conv, y_conv = best_ms(lambda: conv(a["conv_x"], a["weight"], a["bias"], next(it)[0], meta), repeat)
        it = iter(states)
        ms_scan, y_scan = best_ms(lambda: scan(*scan_args, next(it)[1], meta), repeat)
        figures[path] = (ms_conv, ms_scan, y_conv, y_scan)
    gflop = 5 * MP * MN * MH * t / 1e9
    (tc, ts, tyc, tys), (cc, cs, cyc, cys) = figures["torch"], figures["C"]
    print(f"{name}: {t} tokens")
    print(f"  causal_conv1d     torch {tc:9.2f} ms   C {cc:8.2f} ms   x{tc / cc:6.1f}   "
          f"max diff {(tyc - cyc).abs().max().item():.1e}")
    print(f"  mamba2_scan       torch {ts:9.2f} ms   C {cs:8.2f} ms   x{ts / cs:6.1f}   "
          f"max rel diff {((tys - cys).abs().max() / tys.abs().max()).item():.1e}   C {gflop / cs * 1e3:5.1f} GFLOP/s"
          + (f", states {batch * MH * MP * MN * 8 / cs / 1e6:4.1f} GB/s" if t == batch else ""))
    if batch == 1 and t > 1:
        mamba2_chunked(scan_args, ssm0[0], repeat, cys, cs)


def mamba2_chunked(scan_args: tuple, state: torch.Tensor, repeat: int, want: torch.Tensor, c_ms: float) -> None:
    """The chunked (SSD) form's bound at torch's matmul rate on its largest products (a batch of [64, 128] x [128, 64],
    one per head: C S^T), and transformers' torch code of the chunked form on the whole chunk."""
    t = scan_args[0].shape[0]
    a, b = torch.randn(MH, CHUNK, MN), torch.randn(MH, MN, MP)
    ms, _ = best_ms(lambda: torch.bmm(a, b), 20)
    rate = 2 * MH * CHUNK * MN * MP / ms / 1e6  # GFLOP/s
    flop = (4 * MP * MN + 2 * CHUNK * MP) * MH * t
    print(f"  chunked form: {flop / (5 * MP * MN * MH * t):.2f}x the recurrence's flops; at torch's matmul rate on its "
          f"products ({rate:.0f} GFLOP/s) at least {flop / rate / 1e6:.2f} ms for the chunk (the C recurrence: "
          f"{c_ms:.2f} ms)")
    try:
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan
    except ImportError:
        print("  (transformers not installed: no figure of its torch chunked form)")
        return
    x, dt, dt_bias, A, B, C, D = scan_args
    fn = getattr(mamba2_chunk_scan, "__wrapped__", mamba2_chunk_scan)
    ms, (out, _) = best_ms(lambda: fn(x[None], dt[None], A, B[None], C[None], chunk_size=CHUNK, D=D, dt_bias=dt_bias,
                                      initial_states=state[None], dt_softplus=True, return_final_states=True), repeat)
    print(f"  chunked form as transformers writes it in torch: {ms:8.2f} ms   "
          f"max rel diff to C {((out[0] - want).abs().max() / want.abs().max()).item():.1e}")


LAYERS = ("qwen3.5", "granite4-h")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of: {', '.join(LAYERS)}")
    args = parser.parse_args()
    layers = args.layers.split(",")
    if any(layer not in LAYERS for layer in layers):
        parser.error(f"--layers: choose from {', '.join(LAYERS)}")
    torch.set_num_threads(args.threads)
    if cpu_recurrent.load() is None:
        raise SystemExit("the C kernels are unavailable here (no compiler, or LLMD_CPU_GEMM=0)")
    if "qwen3.5" in layers:
        print(f"Qwen3.5-4B Gated DeltaNet layer (Hk {HK}, Hv {HV}, Dk {DK}, Dv {DV}, conv {CHANNELS} x {TAPS}), "
              f"{args.threads} threads, best of {args.repeat}")
        run(f"prefill chunk of {args.chunk}", [args.chunk], args.repeat)
        run(f"decode step, batch {args.batch}", [1] * args.batch, max(args.repeat, 10))
    if "granite4-h" in layers:
        print(f"Granite-4.0-H-Small Mamba2 layer ({MH} heads of {MP}, state {MN}, {MG} group, conv {MAMBA_CHANNELS} x "
              f"{TAPS}), {args.threads} threads, best of {args.repeat}")
        run_mamba2(f"prefill chunk of {args.chunk}", [args.chunk], args.repeat)
        run_mamba2(f"decode step, batch {args.batch}", [1] * args.batch, max(args.repeat, 10))


if __name__ == "__main__":
    main()
