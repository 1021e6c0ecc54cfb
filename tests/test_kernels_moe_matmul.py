"""Fused mixture-of-experts kernel (llmd.kernels.moe_matmul): the alignment of (token, slot) pairs into per-expert
blocks, the kernel against its torch reference (the Python grouping path of llmd.model.moe.Experts) for fp and packed
experts of several GGUF types, with 1, 5 and 33 tokens, top 1, 2 and 4, experts taking no, one and many tokens; each
tiling it can pick; a token's output whatever else shares its step; and Experts choosing it. Without CUDA the kernel
runs under the Triton interpreter on tiny shapes (tests/kernel_testing.py); the GPU tests are at the end.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, HAS_CUDA, load_kernel_module, random_gguf_blocks

pytest.importorskip("triton", reason="the kernels need triton (the reference is tested with them)")
gm = load_kernel_module("gguf_matmul")
mm = load_kernel_module("moe_matmul")
# the interpreter's numpy sigmoid overflows (harmlessly: to 0) on the large gates of random blocks
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

SILU, SWIGLU = mm.Activation("silu"), mm.Activation("swiglu_clamped", alpha=1.702, limit=1.5)


def part(kind: str | None, e: int, rows: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, str | None]:
    """One part of a projection: random GGUF blocks of `kind` [e, rows, row bytes], or fp weights (kind None)."""
    if kind is None:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(e, rows, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE), None
    blocks = random_gguf_blocks(gm.TYPES[kind], e * rows, k, seed)
    return torch.from_numpy(blocks).view(e, rows, -1).to(DEVICE), kind


def projection(kinds: list[str | None], e: int, rows: int, k: int, dtype: torch.dtype, bias: bool = False,
               seed: int = 0) -> mm.ExpertWeights:
    """Parts of `rows` rows each, one per kind, side by side."""
    parts = tuple(part(kind, e, rows, k, dtype, seed + i) for i, kind in enumerate(kinds))
    b = None
    if bias:
        b = (torch.randn(e, rows * len(kinds), generator=torch.Generator().manual_seed(seed + 9)) * 0.1).to(dtype)
        b = b.to(DEVICE)
    return mm.ExpertWeights(parts, k, b)


def routing(t: int, k: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] (distinct experts per token) and fp32 weights: expert e - 1 takes no token, expert e - 2 exactly one
    (token 0's last slot), the others the rest at random (many tokens each when t * k is large)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)])
    ids[0, -1] = e - 2
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return ids.to(DEVICE), weights.to(DEVICE)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().clamp_min(1e-6)
    assert ((out.float() - ref.float()).abs().max() / scale) < tol


# name: (gate part kinds, down kind, hidden, intermediate, activation dtype, activation, biases)
SETUPS = {
    "fp32": ([None], None, 64, 32, torch.float32, SILU, False),
    "fp16": ([None], None, 64, 48, torch.float16, SWIGLU, True),  # N = 48: a partial N tile
    "Q8_0": (["Q8_0"], "Q8_0", 96, 64, torch.float32, SILU, True),
    "Q4_0": (["Q4_0"], "Q4_0", 64, 32, torch.float16, SILU, False),
    "Q4_K+Q6_K": (["Q4_K", "Q6_K"], "Q6_K", 256, 256, torch.float32, SILU, False),  # gate and up of two types
    "MXFP4": (["MXFP4"], "MXFP4", 64, 64, torch.float32, SWIGLU, True),  # gpt-oss's experts
}
E = 8


def experts_of(name: str, e: int = E) -> tuple[mm.ExpertWeights, mm.ExpertWeights, torch.dtype, mm.Activation]:
    gate_kinds, down_kind, h, inter, dtype, act, bias = SETUPS[name]
    rows = 2 * inter // len(gate_kinds)
    gate_up = projection(gate_kinds, e, rows, h, dtype, bias, seed=1)
    down = projection([down_kind], e, h, inter, dtype, bias, seed=7)
    return gate_up, down, dtype, act


def test_align_groups_pairs_into_blocks_of_one_expert():
    for t, k, e, bm in ((1, 1, 4, 1), (5, 2, 8, 4), (33, 4, 8, 16), (33, 4, 64, 16), (7, 2, 4, 1)):
        ids, _ = routing(t, k, e, seed=t)
        pairs, block_expert, counts = mm.align(ids, e, bm)
        p = t * k
        flat = ids.reshape(-1).cpu()
        assert counts.cpu().tolist() == torch.bincount(flat, minlength=e).tolist()
        assert pairs.numel() == -(-(p + min(p, e) * (bm - 1)) // bm) * bm and pairs.numel() == block_expert.numel() * bm
        pairs, block_expert = pairs.cpu(), block_expert.cpu()
        real = pairs[pairs < p]
        assert sorted(real.tolist()) == list(range(p))  # every pair once; the rest is the sentinel p
        assert set(pairs[pairs >= p].tolist()) <= {p}
        for b, expert in enumerate(block_expert.tolist()):
            rows = pairs[b * bm:(b + 1) * bm]
            rows = rows[rows < p]
            if expert < 0:
                assert rows.numel() == 0
            else:
                assert rows.numel() > 0 and (flat[rows] == expert).all()
                assert rows.tolist() == sorted(rows.tolist())  # stable: each expert's pairs in pair order
        used = block_expert[block_expert >= 0]
        assert used.tolist() == sorted(used.tolist())  # experts in order, the unused blocks at the end
        assert (block_expert[used.numel():] == -1).all()


@pytest.mark.parametrize("name", list(SETUPS))
def test_kernel_matches_reference(name):
    """T = 1 (GEMV, one pair a program), 5 (GEMV, two pairs a program), 33 (tl.dot, 16-row blocks); experts with no
    token, one token and many; the hits counted per expert."""
    gate_up, down, dtype, act = experts_of(name)
    h = gate_up.in_features
    for t, k in ((1, 1), (5, 2), (33, 4)):
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype).to(DEVICE)
        ids, weights = routing(t, k, E, seed=t)
        hits = torch.zeros(E, dtype=torch.int64, device=DEVICE)
        out = mm.moe_matmul(x, ids, weights, gate_up, down, act, hits)
        _close(out, mm.moe_matmul_ref(x, ids, weights, gate_up, down, act), dtype)
        assert hits.tolist() == torch.bincount(ids.reshape(-1).cpu(), minlength=E).tolist()


def test_every_other_packed_type():
    """The rest of gguf_matmul's types (their dequantizers are gguf_matmul's, tested there), one small step each."""
    others = [kind for kind in gm.TYPES if kind not in ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")]
    assert len(others) == 8
    for kind in others:
        h = inter = 64 if gm.TYPES[kind].block_elems == 32 else 256
        gate_up = projection([kind], 4, 2 * inter, h, torch.float32, seed=1)
        down = projection([kind], 4, h, inter, torch.float32, seed=2)
        x = torch.randn(3, h, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        ids, weights = routing(3, 2, 4, seed=1)
        _close(mm.moe_matmul(x, ids, weights, gate_up, down, SILU),
               mm.moe_matmul_ref(x, ids, weights, gate_up, down, SILU), torch.float32)


@pytest.mark.parametrize("name,tokens,cfg", [
    ("Q8_0", 6, dict(BLOCK_M=4, BLOCK_N=32, T=32, USE_DOT=False)),  # GEMV of 4 pairs, partial blocks
    ("Q8_0", 40, dict(BLOCK_M=32, BLOCK_N=64, T=16, USE_DOT=True)),  # H = 96: a partial N tile of down
    ("fp16", 40, dict(BLOCK_M=16, BLOCK_N=32, T=32, USE_DOT=True)),  # fp K = 64 / 48 over 64-element steps
])
def test_explicit_tilings(name, tokens, cfg):
    gate_up, down, dtype, act = experts_of(name)
    x = torch.randn(tokens, gate_up.in_features, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    ids, weights = routing(tokens, 2, E, seed=5)
    out = mm._run(x, ids, weights, gate_up, down, act, cfg, {})
    _close(out, mm.moe_matmul_ref(x, ids, weights, gate_up, down, act), dtype)


def test_every_autotune_candidate_computes_the_block():
    """Autotuning on the GPU keeps the fastest tiling without looking at its output: each candidate must be right
    (fp16 here: the interpreter's bf16 tl.dot is wrong; the GPU test runs bf16)."""
    gate_up, down, _, act = experts_of("Q4_0")
    for tokens in (1, 16, 40):
        x = torch.randn(tokens, gate_up.in_features, generator=torch.Generator().manual_seed(tokens))
        x = x.to(torch.float16).to(DEVICE)
        ids, weights = routing(tokens, 2, E, seed=tokens)
        ref = mm.moe_matmul_ref(x, ids, weights, gate_up, down, act)
        for cfg, launch in mm.candidates(tokens, gate_up, down):
            _close(mm._run(x, ids, weights, gate_up, down, act, cfg, launch if HAS_CUDA else {}), ref,
                   torch.float16)


def test_a_tokens_output_does_not_depend_on_the_others():
    """33 tokens in one step (tl.dot blocks), each of a few alone (GEMV), and five together: the same rows."""
    gate_up, down, dtype, act = experts_of("MXFP4")
    t, k = 33, 4
    x = torch.randn(t, gate_up.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids, weights = routing(t, k, E, seed=2)
    together = mm.moe_matmul(x, ids, weights, gate_up, down, act)
    scale = together.abs().max()
    for rows in ([0], [17], [32], [3, 4, 9, 20, 31]):
        apart = mm.moe_matmul(x[rows], ids[rows], weights[rows], gate_up, down, act)
        assert ((apart - together[rows]).abs().max() / scale) < 1e-5, rows


def test_empty_step_and_bad_weights_are_refused_by_name():
    gate_up, down, dtype, act = experts_of("Q8_0")
    x = torch.zeros(0, 96, device=DEVICE)
    out = mm.moe_matmul(x, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), torch.zeros(0, 2, device=DEVICE),
                        gate_up, down, act)
    assert out.shape == (0, 96)
    with pytest.raises(ValueError, match=r"expected x of shape \[T, 96\]"):
        mm.moe_matmul(torch.zeros(2, 64, device=DEVICE), *routing(2, 2, E), gate_up, down, act)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        mm.check(gate_up, down, mm.Activation("gelu"), torch.float32, torch.device(DEVICE))
    fp_gate, fp_down, _, _ = experts_of("fp16")
    with pytest.raises(ValueError, match="fp expert weights must be .*float32"):
        mm.check(fp_gate, fp_down, act, torch.float32, torch.device(DEVICE))
    uneven = mm.ExpertWeights((part("Q8_0", E, 48, 96, torch.float32, 0), part("Q8_0", E, 80, 96, torch.float32, 1)),
                              96)
    with pytest.raises(ValueError, match="do not split at the intermediate size"):
        mm.check(uneven, down, act, torch.float32, torch.device(DEVICE))
    iq2 = mm.ExpertWeights(((torch.zeros(E, 128, 66, dtype=torch.uint8, device=DEVICE), "IQ2_XXS"),), 256)
    with pytest.raises(ValueError, match="'IQ2_XXS' has no packed matmul"):
        mm.check(iq2, projection(["Q8_0"], E, 256, 64, torch.float32), act, torch.float32, torch.device(DEVICE))


# ---------------------------------------------------------------------------------------------------------------
# llmd.model.moe.Experts: the kernel over its own weights (fp and packed), against its Python grouping path
# ---------------------------------------------------------------------------------------------------------------

def experts_block(packed: bool, activation: str = "silu", device: str = DEVICE):
    from llmd.model.config import MoEConfig
    from llmd.model.moe import Experts
    from llmd.model.quant.gguf_experts import GGUFExpertLinear

    hidden, inter = 64, 32
    moe = MoEConfig(num_experts=E, top_k=2, intermediate_size=inter, activation=activation, swiglu_limit=1.5)
    block = Experts(hidden, moe, bias=activation != "silu")
    g = torch.Generator().manual_seed(0)
    for proj in (block.gate_up_proj, block.down_proj):
        proj.weight.data = torch.randn(proj.weight.shape, generator=g) / proj.in_features ** 0.5
        if proj.bias is not None:
            proj.bias.data = torch.randn(proj.bias.shape, generator=g) * 0.1
    if packed:  # gate and up as two Q8_0 parts, as a GGUF file's ffn_gate_exps / ffn_up_exps load
        block.gate_up_proj = GGUFExpertLinear(E, hidden, [(inter, "Q8_0"), (inter, "Q8_0")])
        block.down_proj = GGUFExpertLinear(E, inter, [(hidden, "Q8_0")])
        for i, p in enumerate([*block.gate_up_proj.parts, *block.down_proj.parts]):
            p.qweight.copy_(part("Q8_0", E, p.out_features, p.in_features, torch.float32, i)[0].cpu())
    return block.to(device)


@pytest.mark.parametrize("packed,activation", [(False, "swiglu_clamped"), (True, "silu")])
def test_experts_block_through_the_kernel_equals_its_python_path(packed, activation, monkeypatch):
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")  # the CPU's packed kernel on the exact weights, not int8 inputs
    block = experts_block(packed, activation, device="cpu")
    t = 9
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(1))
    ids, weights = (v.cpu() for v in routing(t, 2, E, seed=4))
    python = block(x, ids, weights)
    assert block.prepared and block.kernel is None  # the CPU's choice for unbound ops: the Python grouping
    block = block.to(DEVICE)
    kernel = block.triton_kernel(torch.device(DEVICE), torch.float32)
    assert kernel is not None
    _close(kernel(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)).cpu(), python, torch.float32)
    counted = torch.bincount(ids.reshape(-1).cpu(), minlength=E)
    assert block.hit_counts() == (2 * counted).tolist()  # the Python path's and the kernel's (on its device)


def test_experts_block_keeps_its_python_path_for_weights_the_kernel_cannot_take(caplog):
    block = experts_block(False)
    with caplog.at_level("INFO", logger="llmd.model.moe"):
        assert block.triton_kernel(torch.device(DEVICE), torch.float16) is None  # fp32 weights, fp16 activations
    assert "keeps the per-expert path: fp expert weights must be" in caplog.text

def test_cuda_graphs_wait_for_the_fused_kernel():
    """A step through the per-expert path reads counts on the host, which a CUDA graph cannot capture: the runner
    leaves graphs off for such a model (llmd.engine.cuda_graphs.graph_blocker) and on once the kernel is chosen."""
    from llmd.engine.cuda_graphs import graph_blocker
    from llmd.model.attention_backends import TritonBackend

    block = experts_block(False, device="cpu")
    block.prepare(torch.device("cpu"), torch.float32)
    assert "per-expert path" in graph_blocker(block, TritonBackend())
    block.kernel = block.triton_kernel(torch.device("cpu"), torch.float32)  # (interpreted here; CUDA's choice)
    assert block.kernel is not None and graph_blocker(block, TritonBackend()) is None


# ---------------------------------------------------------------------------------------------------------------
# GPU (run by tests/gpu/run_gpu_checks.sh, moe stage): autotuned, bf16, and Experts choosing the kernel on CUDA
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K+Q6_K", "MXFP4", "fp16"])
def test_autotuned_kernel_on_gpu(name):
    """Every tiling autotuning tries (1 to 100 tokens); bf16 activations for the packed experts (fp32 ones would
    take tl.dot's TF32)."""
    gate_up, down, dtype, act = experts_of(name, e=32)
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    for t, k in ((1, 4), (4, 4), (16, 4), (100, 4)):
        x = torch.randn(t, gate_up.in_features, device="cuda").to(dtype)
        ids, weights = routing(t, k, 32, seed=t)
        _close(mm.moe_matmul(x, ids, weights, gate_up, down, act), mm.moe_matmul_ref(x, ids, weights, gate_up,
                                                                                     down, act), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_experts_on_cuda_choose_the_kernel(packed, monkeypatch):
    """Prepared on CUDA, Experts runs the fused kernel (no host sync in its step: it runs while the stream captures
    a CUDA graph) and computes its Python path's result; hits are counted on the device."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")  # the CPU's packed kernel on the exact weights
    block = experts_block(packed).to("cuda")
    x = torch.randn(5, 64, device="cuda")
    ids, weights = routing(5, 2, E, seed=1)
    block.prepare(torch.device("cuda"), torch.float32)
    assert block.kernel is not None
    out = block(x, ids, weights)
    python = experts_block(packed, device="cpu")(x.cpu(), ids.cpu(), weights.cpu())
    _close(out.cpu(), python, torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(x, ids, weights)
    graph.replay()
    torch.cuda.synchronize()
    _close(captured, out, torch.float32)
    assert sum(block.hit_counts()) == 2 * ids.numel()  # the call and the replay (a capture runs nothing)

