"""Compile the GGUF matmul kernel for a CUDA target without a GPU (Triton's compile API and bundled ptxas) and print
each tiling's resources: shared memory, registers, spills (cuobjdump), and the global loads in its PTX.

    python tests/gpu/compile_offline.py [--arch 90] [--types Q4_K,Q6_K] [--jobs 2]
    python tests/gpu/compile_offline.py --attention [--arch 90]
    python tests/gpu/compile_offline.py --moe [--arch 90]
    python tests/gpu/compile_offline.py --recurrent [--arch 90]

Every (type, tiling) that `gguf_matmul.candidates` can pick for M = 1, 2, 4, 16 and 512 with bf16 activations is
compiled once (the binary does not depend on M or SPLIT_K). Exits non-zero if any compile fails or spills.

--attention: the paged decode and prefill attention kernels instead, with bf16 caches, at the head shapes of
bench_gpu.py's models (Llama-3-8B, and the shapes stage's Gemma 3 4B and Qwen2.5-7B), soft-capped at Gemma 2 9B's
(SOFTCAP) and with attention sinks at gpt-oss-20b's (SINKS), with the tiles their launchers
pick for a 2k-token prompt and its decode steps. Exits non-zero if any compile fails; spills are printed, not
failed (they cost speed, which the GPU stage measures).

--moe: the fused mixture-of-experts kernels (llmd.kernels.moe_matmul) with bf16 activations, every tiling
`moe_matmul.candidates` picks for 1, 4, 16 and 512 tokens, gate_up (gated) and down, at gpt-oss-20b's experts (MXFP4,
biases, clamped SwiGLU), Qwen3-30B-A3B's (Q4_K, a Q4_K_M file's Q6_K down) and bf16 fp experts; and the slot sum.
Exits non-zero if any compile fails or spills.

--recurrent: the recurrent layers' kernels (llmd.kernels.recurrent_triton) at Qwen3.5-9B's Gated DeltaNet layer (16 q/k
and 32 value heads of 128, a 4-tap conv over 8192 channels) and Granite-4.0-H-Small's Mamba2 layer (128 heads of 64, a
state of 128 in one group, a 4-tap conv with bias over 8448 channels) with bf16 activations, as the launchers pick
their constexprs: the conv and its state write, the delta rule and the scan token by token and by chunks. Exits
non-zero if any compile fails; spills are printed, not failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)


def _variants(types: list[str]) -> list[tuple[str, dict, dict]]:
    from llmd.kernels import gguf_matmul as gm

    seen, out = set(), []
    for name in types:
        for m in (1, 2, 4, 16, 512):
            for cfg, launch in gm.candidates(m, name, 4096):
                key = (name, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["T"], cfg["USE_DOT"], cfg["SPLIT_K"] > 1,
                       launch["num_warps"], launch["num_stages"])
                if key not in seen:
                    seen.add(key)
                    out.append((name, cfg, launch))
    return out


def _compile(arch: int, name: str, cfg: dict, launch: dict) -> dict:
    import triton
    from llmd.kernels import gguf_matmul as gm
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = gm.TYPES[name]
    kernel = gm._gguf_mm_kernel if cfg["USE_DOT"] else gm._gguf_gemv_kernel
    split = cfg["SPLIT_K"] > 1
    values = dict(
        x_ptr="*bf16", w_ptr="*u8", out_ptr="*fp32" if split else "*bf16",
        M="i32", N="i32", K="i32", row_bytes="i32", stride_xm="i32", stride_om="i32", SPLIT_K="i32",
    )
    consts = dict(TYPE=t.code, QK=t.block_elems, BYTES=t.block_bytes, G=t.group, BLOCK_M=cfg["BLOCK_M"],
                  BLOCK_N=cfg["BLOCK_N"], T=cfg["T"], ATOMIC=split, ROW64=False)
    params = [p.name for p in kernel.params]
    signature = {p: values.get(p, "constexpr") for p in params}
    constexprs = {(i,): consts[p] for i, p in enumerate(params) if p in consts}
    # as the launcher specializes them: pointers and the shape ints of Llama-3-8B layers are multiples of 16
    aligned = {"x_ptr", "w_ptr", "out_ptr", "N", "K", "row_bytes", "stride_xm", "stride_om"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    row = dict(type=name, **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "T", "USE_DOT")}, atomic=split, **launch)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch)
    except Exception as e:  # report and go on: one failure must not hide the others
        return dict(row, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    row["shared"] = compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    row["loads"] = {k: len(re.findall(rf"ld\.global(?:\.\w+)*\.{k}\b", ptx)) for k in ("v4", "v2")}
    row["loads"]["all"] = len(re.findall(r"ld\.global", ptx))
    row.update(_resources(compiled.asm["cubin"]))
    return row


# (model, query heads per KV head, head_dim, sliding window, soft-capped, attention sinks) of bench_gpu.py's models,
# and gpt-oss-20b's (sinks on every layer, a 128-token window on every other)
ATTENTION_SHAPES = [("llama3-8b", 4, 128, None, False, False), ("gemma3-4b", 2, 256, 1024, False, False),
                    ("gemma3-4b", 2, 256, None, False, False), ("qwen2.5-7b", 7, 128, None, False, False),
                    ("gemma2-9b", 2, 256, 4096, True, False), ("gemma2-9b", 2, 256, None, True, False),
                    ("gpt-oss-20b", 8, 64, 128, False, True), ("gpt-oss-20b", 8, 64, None, False, True)]


def _attention_variants() -> list[tuple[str, dict, dict, dict]]:
    """(what, constexprs, launch options, runtime int values that decide divisibility) per compile: the decode
    kernel without and with splits (SPLIT is a constexpr; 8 stands for any split count) and the prefill kernel
    with its 2k-prompt tile (block_m 128), as paged_decode_attention / paged_prefill_attention launch them."""
    from llmd.kernels.prefill_attention import _next_pow2

    out = []
    for model, group, head_dim, window, softcap, sinks in ATTENTION_SHAPES:
        kind = f"{model} {'window' if window else 'global'}{' softcap' if softcap else ''}{' sinks' if sinks else ''}"
        if window is None or model == "gemma3-4b":  # the decode kernel takes the window at run time
            for split in (1, 8):
                out.append((f"decode  {kind} split={split}", dict(
                    GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim,
                    D_PAD=max(16, _next_pow2(head_dim)), BLOCK_T=64, SPLIT=split, QUANT=False, SOFTCAP=softcap,
                    SINKS=sinks), dict(num_warps=4, num_stages=2), dict(split=split)))
        out.append((f"prefill {kind}", dict(
            GROUP=group, GROUP_PAD=_next_pow2(group), HEAD_DIM=head_dim, D_PAD=max(16, _next_pow2(head_dim)),
            BLOCK_M=128, BLOCK_N=64, QUANT=False, WINDOWED=window is not None, SOFTCAP=softcap, SINKS=sinks),
            dict(num_warps=8, num_stages=2), {}))
    return out


def _compile_attention(arch: int, what: str, consts: dict, launch: dict, extra: dict) -> dict:
    from llmd.kernels import paged_attention, prefill_attention
    from triton.compiler import ASTSource

    decode = what.startswith("decode")
    kernel = paged_attention._paged_decode_kernel if decode else prefill_attention._paged_prefill_kernel
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
                "bt_ptr": "*i32", "sl_ptr": "*i32", "qsl_ptr": "*i32", "sinks_ptr": "*fp32", "m_ptr": "*fp32",
                "l_ptr": "*fp32",
                "out_ptr": "*fp32" if decode and extra.get("split", 1) > 1 else "*bf16"}
    floats = ("scale", "qk_scale", "softcap", "cap_scale")
    unspecialized = ("num_seqs", "stride_btb")  # do_not_specialize in the kernels
    params = [p.name for p in kernel.params]
    signature = {p: "constexpr" if p in consts else pointers.get(p) or ("fp32" if p in floats else "i32")
                 for p in params}
    constexprs = {(i,): consts[p] for i, p in enumerate(params) if p in consts}
    # as the launcher specializes them at these shapes: every pointer, stride (heads x head_dim multiples, or 0),
    # block size (16), window (1024 or 0) and min split (256) is a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and p not in floats and p not in unspecialized}
    return _compiled_row(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), arch,
                         dict(what=what, **launch), launch)


def attention_main(arch: int, jobs: int) -> int:
    variants = _attention_variants()
    print(f"sm_{arch}: {len(variants)} attention compiles", flush=True)
    failed = 0
    with ProcessPoolExecutor(jobs) as pool:
        for r in [f.result() for f in [pool.submit(_compile_attention, arch, *v) for v in variants]]:
            if "error" in r:
                failed += 1
                print(f"{r['what']:44} FAILED {r['error']}", flush=True)
                continue
            spill = r["stack"] > 0 or r["local"] > 0
            print(f"{r['what']:44} warps={r['num_warps']}  shared {r['shared']:6} B  regs {r['regs']:3}  "
                  f"stack {r['stack']:4}  local {r['local']}{'  SPILLS' if spill else ''}", flush=True)
    return 1 if failed else 0


# (model, gate/up type, down type, hidden, expert intermediate size, top k, activation, biases)
MOE_SHAPES = [("gpt-oss-20b", "MXFP4", "MXFP4", 2880, 2880, 4, "swiglu_clamped", True),
              ("qwen3-30b-a3b", "Q4_K", "Q4_K", 2048, 768, 8, "silu", False),
              ("qwen3-30b-a3b", "Q4_K", "Q6_K", 2048, 768, 8, "silu", False),
              ("qwen3-30b-a3b", None, None, 2048, 768, 8, "silu", False)]


def _moe_variants() -> list[tuple[str, dict, dict, dict]]:
    """(what, constexprs, launch options, runtime values) per compile of the two grouped kernels."""
    import torch
    from llmd.kernels import moe_matmul as mm

    seen, out = set(), []
    for model, up_kind, down_kind, hidden, inter, _, act, bias in MOE_SHAPES:
        def weights(kind, rows, k):
            if kind is None:
                return mm.ExpertWeights(((torch.empty(1, rows, k, dtype=torch.bfloat16, device="meta"), None),), k)
            row = mm.gguf_type(kind)
            blocks = torch.empty(1, rows, k // row.block_elems * row.block_bytes, dtype=torch.uint8, device="meta")
            return mm.ExpertWeights(((blocks, kind),), k)

        gate_up, down = weights(up_kind, 2 * inter, hidden), weights(down_kind, hidden, inter)
        for tokens in (1, 4, 16, 512):
            for cfg, launch in mm.candidates(tokens, gate_up, down):
                for gated, proj in ((True, gate_up), (False, down)):
                    kind = proj.parts[0][1]
                    key = (kind, gated, act if gated else "", bias, tuple(sorted(cfg.items())), launch["num_warps"])
                    if key in seen:
                        continue
                    seen.add(key)
                    t = mm._type_args(kind, cfg["T"])
                    block_n = max(16, cfg["BLOCK_N"] // 2) if gated else cfg["BLOCK_N"]  # as _launch halves it
                    consts = dict(TYPE_G=t[0], QK_G=t[1], BYTES_G=t[2], G_G=t[3], TYPE_U=t[0], QK_U=t[1],
                                  BYTES_U=t[2], G_U=t[3], GATED=gated, ACT=mm.ACTIVATIONS.index(act),
                                  HAS_BIAS=bias, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, T=cfg["T"], IEEE=False)
                    what = (f"{model:13} {'gate_up' if gated else 'down':7} {kind or 'bf16':5} BM={cfg['BLOCK_M']:3} "
                            f"BN={block_n:3} T={cfg['T']:3} dot={int(cfg['USE_DOT'])}")
                    w = proj.parts[0][0]
                    n, k = (inter, hidden) if gated else (hidden, inter)
                    ints = dict(N=n, K=k, stride_xm=k if gated else inter, stride_om=n, row_g=w.stride(1),
                                row_u=w.stride(1), expert_g=w.stride(0), expert_u=w.stride(0),
                                bias_stride=proj.out_features if bias else 0, up_bias=inter if gated else 0)
                    out.append((what, consts, launch, dict(dot=cfg["USE_DOT"], fp=kind is None, ints=ints)))
    for top_k in (4, 8):
        out.append((f"slot sum top {top_k}", dict(TOP_K=top_k, BLOCK=256), dict(num_warps=4, num_stages=3),
                    dict(sum=True)))
    return out


def _compile_moe(arch: int, what: str, consts: dict, launch: dict, extra: dict) -> dict:
    from llmd.kernels import moe_matmul as mm
    from triton.compiler import ASTSource

    if extra.get("sum"):
        kernel = mm._moe_sum_kernel
    else:
        kernel = mm._moe_dot_kernel if extra["dot"] else mm._moe_gemv_kernel
    weight = "*bf16" if extra.get("fp") else "*u8"
    types = {"x_ptr": "*bf16", "wg_ptr": weight, "wu_ptr": weight, "b_ptr": "*bf16", "out_ptr": "*bf16",
             "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "slots_ptr": "*bf16", "w_ptr": "*fp32",
             "alpha": "fp32", "limit": "fp32"}
    params = [p.name for p in kernel.params]
    signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    constexprs = {(i,): consts[p] for i, p in enumerate(params) if p in consts}
    # as the launcher specializes them at these shapes: pointers, and the ints that are multiples of 16 there (the
    # row bytes of 2880 MXFP4 elements, 1530, are not)
    ints = extra.get("ints", dict(H=2048))
    aligned = {"x_ptr", "wg_ptr", "wu_ptr", "b_ptr", "out_ptr", "pairs_ptr", "block_expert_ptr", "slots_ptr",
               "w_ptr"} | {name for name, value in ints.items() if value % 16 == 0}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in aligned}
    return _compiled_row(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), arch,
                         dict(what=what, **launch), launch)


def moe_main(arch: int, jobs: int) -> int:
    variants = _moe_variants()
    print(f"sm_{arch}: {len(variants)} MoE compiles", flush=True)
    bad = 0
    with ProcessPoolExecutor(jobs) as pool:
        for r in [f.result() for f in [pool.submit(_compile_moe, arch, *v) for v in variants]]:
            if "error" in r:
                bad += 1
                print(f"{r['what']:62} FAILED {r['error']}", flush=True)
                continue
            spill = r["stack"] > 0 or r["local"] > 0
            bad += spill
            print(f"{r['what']:62} warps={r['num_warps']}  shared {r['shared']:6} B  regs {r['regs']:3}  "
                  f"stack {r['stack']:4}  local {r['local']}{'  SPILLS' if spill else ''}", flush=True)
    return 1 if bad else 0


def _recurrent_variants() -> list[tuple[str, dict, dict]]:
    """(kernel name, constexprs, launch options) per compile, at Qwen3.5-9B's and Granite-4.0-H-Small's layer shapes
    (the chunked delta rule and scan with bf16's and with fp32's product precision)."""
    import torch
    from llmd.kernels import recurrent_triton as rt

    hk, hv, d, taps = 16, 32, 128, 4
    delta = dict(HV=hv, REP=hv // hk, DK=d, DV=d, BK=d, BV=rt.DELTA_BLOCK_V)
    heads, head_dim, state, groups = 128, 64, 128, 1
    scan = dict(H=heads, REP=heads // groups, P=head_dim, N=state, BN=state)
    chunked_scan = scan | dict(BP=rt.MAMBA2_CHUNK_P, BT=rt.MAMBA2_CHUNK)
    return [("_conv_kernel", dict(K=taps, HAS_BIAS=False, SILU=True, BLOCK_T=rt.CONV_BLOCK_T,
                                  BLOCK_C=rt.CONV_BLOCK_C), dict(num_warps=4)),
            ("_conv_state_kernel", dict(K=taps, KP=rt._pow2(taps - 1), BLOCK_C=rt.CONV_BLOCK_C), dict(num_warps=4)),
            ("_delta_rule_kernel", delta, dict(num_warps=4)),
            ("_delta_rule_chunk_kernel", delta | dict(BT=rt.DELTA_CHUNK, PREC=rt.dot_precision(torch.bfloat16)),
             dict(num_warps=4)),
            ("_delta_rule_chunk_kernel", delta | dict(BT=rt.DELTA_CHUNK, PREC=rt.dot_precision(torch.float32)),
             dict(num_warps=4)),
            ("_conv_kernel", dict(K=taps, HAS_BIAS=True, SILU=True, BLOCK_T=rt.CONV_BLOCK_T,
                                  BLOCK_C=rt.CONV_BLOCK_C), dict(num_warps=4)),
            ("_mamba2_scan_kernel", scan | dict(BP=rt.MAMBA2_BLOCK_P), dict(num_warps=4)),
            ("_mamba2_chunk_kernel", chunked_scan | dict(PREC=rt.dot_precision(torch.bfloat16)), dict(num_warps=8)),
            ("_mamba2_chunk_kernel", chunked_scan | dict(PREC=rt.dot_precision(torch.float32)), dict(num_warps=8))]


def _compile_recurrent(arch: int, name: str, consts: dict, launch: dict) -> dict:
    from llmd.kernels import recurrent_triton as rt
    from triton.compiler import ASTSource

    kernel = getattr(rt, name)
    fp32_state = "conv" not in name  # the delta rule's and the scan's state is fp32; the conv's, the activations' dtype
    floats = ("scale", "dt_min", "dt_max")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*fp32" if fp32_state else "*bf16",
             "out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32",
             "beta_ptr": "*bf16", "dt_ptr": "*bf16", "dt_bias_ptr": "*bf16", "a_ptr": "*fp32", "b_ptr": "*bf16",
             "c_ptr": "*bf16", "d_ptr": "*bf16", "slots_ptr": "*i64", "fresh_ptr": "*i1", "start_ptr": "*i64"}
    params = [p.name for p in kernel.params]
    signature = {p: "constexpr" if p in consts else "fp32" if p in floats else types.get(p, "i32") for p in params}
    constexprs = {(i,): consts[p] for i, p in enumerate(params) if p in consts}
    # pointers, channel counts and row strides are multiples of 16 at these shapes (chunk_from, 16 or 32, too)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts and p not in floats}
    return _compiled_row(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), arch,
                         dict(what=f"{name} {consts.get('PREC', '')}", **launch), launch)


def recurrent_main(arch: int, jobs: int) -> int:
    variants = _recurrent_variants()
    print(f"sm_{arch}: {len(variants)} recurrent-layer compiles", flush=True)
    failed = 0
    with ProcessPoolExecutor(jobs) as pool:
        for r in [f.result() for f in [pool.submit(_compile_recurrent, arch, *v) for v in variants]]:
            if "error" in r:
                failed += 1
                print(f"{r['what']:34} FAILED {r['error']}", flush=True)
                continue
            spill = r["stack"] > 0 or r["local"] > 0
            print(f"{r['what']:34} warps={r['num_warps']}  shared {r['shared']:6} B  regs {r['regs']:3}  "
                  f"stack {r['stack']:4}  local {r['local']}{'  SPILLS' if spill else ''}", flush=True)
    return 1 if failed else 0


def _compiled_row(src, arch: int, row: dict, launch: dict) -> dict:
    """`row` with the compiled kernel's shared memory and resources, or the error (reported, the others go on)."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch)
    except Exception as e:  # report and go on
        return dict(row, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    row["shared"] = compiled.metadata.shared
    row.update(_resources(compiled.asm["cubin"]))
    return row


def _resources(cubin: bytes) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return dict(regs=int(found.get("REG", -1)), stack=int(found.get("STACK", -1)), local=int(found.get("LOCAL", -1)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--types", default="")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--attention", action="store_true",
                        help="the attention kernels at bench_gpu's head shapes instead of the GGUF matmul")
    parser.add_argument("--moe", action="store_true",
                        help="the fused mixture-of-experts kernels at gpt-oss-20b's and Qwen3-30B-A3B's shapes")
    parser.add_argument("--recurrent", action="store_true",
                        help="the recurrent layers' kernels (conv, gated delta rule, Mamba2 scan) at Qwen3.5-9B's "
                             "and Granite-4.0-H-Small's shapes")
    args = parser.parse_args()
    if args.recurrent:
        return recurrent_main(args.arch, args.jobs)
    if args.attention:
        return attention_main(args.arch, args.jobs)
    if args.moe:
        return moe_main(args.arch, args.jobs)
    from llmd.kernels import gguf_matmul as gm

    types = args.types.split(",") if args.types else list(gm.TYPES)
    variants = _variants(types)
    print(f"sm_{args.arch}: {len(variants)} compiles", flush=True)
    bad = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_compile, args.arch, *v) for v in variants]
        for fut in futures:
            r = fut.result()
            tiling = f"{r['type']:6} BM={r['BLOCK_M']:3} BN={r['BLOCK_N']:3} T={r['T']:3} dot={int(r['USE_DOT'])} " \
                     f"atomic={int(r['atomic'])} warps={r['num_warps']}"
            if "error" in r:
                bad += 1
                print(f"{tiling}  FAILED {r['error']}", flush=True)
                continue
            spill = r["stack"] > 0 or r["local"] > 0
            bad += spill
            print(f"{tiling}  shared {r['shared']:6} B  regs {r['regs']:3}  stack {r['stack']}  local {r['local']}  "
                  f"global loads {r['loads']['all']:4} (v4 {r['loads']['v4']}, v2 {r['loads']['v2']})"
                  f"{'  SPILLS' if spill else ''}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
