"""A mixture-of-experts layer's packed GGUF experts in one C call (llmd.kernels.cpu_moe, chosen by
llmd.model.moe.Experts.prepare) against the Python grouping it replaces (Experts.grouped: one GGUFKernel per expert
hit, the C SiLU * up, the weighted sum in slot order), bit for bit: several types (gate, up and down of one type, and
Q4_K_M's mixes), 1, 3 and 64 tokens, 1, 2 and 8 experts per token, experts hit by no token, one and many, on each
activation path (fp32, int8, int16 where the types take it), with several thread counts. A row's output does not
depend on its step; the expert counts add up; bad ids are refused; the compiled path is chosen only where it applies.

Where no C compiler exists no kernel is made; the tests then check that branch instead of skipping."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from test_gguf_blocks import random_blocks

from llmd.kernels import cpu_gemm, cpu_moe
from llmd.model.config import MoEConfig
from llmd.model.moe import Experts
from llmd.model.ops import CPU_OPS, TORCH_OPS
from llmd.model.quant.gguf_experts import GGUFExpertLinear

HAVE_KERNEL = cpu_gemm.available()
NUM_EXPERTS = 16
# (gate, up, down): one type throughout (MXFP4: gpt-oss's experts), and Q4_K_M's mixes (down in Q6_K; a gate and an
# up of different types)
TYPES = [("Q8_0",) * 3, ("Q4_0",) * 3, ("Q4_K",) * 3, ("Q6_K",) * 3, ("MXFP4",) * 3, ("Q4_K", "Q4_K", "Q6_K"),
         ("Q4_K", "Q6_K", "Q8_0")]


def _packed(num_experts: int, k: int, parts: list[tuple[int, str]], seed: int) -> GGUFExpertLinear:
    layer = GGUFExpertLinear(num_experts, k, parts)
    for i, (part, (n, type_name)) in enumerate(zip(layer.parts, parts)):
        blocks = random_blocks(type_name, num_experts * n, k, seed=seed + i, scale=0.002)
        part.qweight.copy_(torch.from_numpy(blocks).view(part.qweight.shape))
    return layer


def _experts(types: tuple[str, str, str], hidden: int = 256, inter: int = 256, seed: int = 0) -> Experts:
    """An MoE layer's experts with random packed blocks, its ops the C ones (as the loader binds them on the CPU)."""
    experts = Experts(hidden, MoEConfig(num_experts=NUM_EXPERTS, top_k=8, intermediate_size=inter))
    experts.gate_up_proj = _packed(NUM_EXPERTS, hidden, [(inter, types[0]), (inter, types[1])], seed)
    experts.down_proj = _packed(NUM_EXPERTS, inter, [(hidden, types[2])], seed + 7)
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.float32)
    return experts


def _routing(t: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] (distinct per token) and softmax weights: expert 0 taken by every token, expert 1 by the first token
    only (k > 1), experts 12-15 by none, the others at random."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(t):
        chosen = [0, 1] if i == 0 else [0]
        pool = torch.arange(2, 12)
        rows.append(torch.cat([torch.tensor(chosen), pool[torch.randperm(len(pool), generator=g)]])[:k])
    ids = torch.stack(rows)[:, torch.randperm(k, generator=g)]  # expert 0 in any slot
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return ids, weights


def _x(t: int, hidden: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, hidden, generator=torch.Generator().manual_seed(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (t + 0.0).view(torch.int32)  # + 0.0: -0 and +0 are one value of a product sum


@pytest.mark.parametrize("act", ["int8", "fp32", "int16"])
@pytest.mark.parametrize("types", TYPES, ids="-".join)
def test_compiled_experts_equal_the_python_grouping_bit_for_bit(types, act, monkeypatch):
    monkeypatch.setitem(cpu_gemm.ACTIVATIONS, "gguf", act)  # what a packed layer takes, both paths alike
    experts = _experts(types)
    if not HAVE_KERNEL:
        assert experts.kernel is None
        return
    kernel = experts.kernel
    assert isinstance(kernel, cpu_moe.MoEKernel)
    # int16 only where a projection's every type takes it (Q8_0, Q6_K), as GGUFKernel chooses
    q16 = [all(t in ("Q8_0", "Q6_K") for t in ts) for ts in (types[:2], types[2:])]
    assert kernel.acts == tuple("int16" if ok else "fp32" for ok in q16) if act == "int16" else (act, act)
    for t in (1, 3, 64):
        x = _x(t)
        for k in (1, 2, 8):
            ids, weights = _routing(t, k, seed=t + k)
            before = experts.hits.clone()
            ref = experts.grouped(x, ids, weights)
            counted = experts.hits - before
            assert counted[12:].sum() == 0 and counted[1] == (k > 1) and counted[0] == t  # none, one, many
            for threads in (1, 2, 3):
                before = experts.hits.clone()
                got = kernel(x, ids, weights, experts.hits, threads)
                assert torch.equal(_bits(got), _bits(ref)), (t, k, threads)
                assert torch.equal(experts.hits - before, counted)  # each call counts its pairs
            assert torch.equal(_bits(experts(x, ids, weights)), _bits(ref))  # forward takes the compiled path


def test_a_tokens_output_does_not_depend_on_its_step():
    experts = _experts(("Q4_K", "Q4_K", "Q6_K"))
    if not HAVE_KERNEL:
        return
    x, (ids, weights) = _x(40), _routing(40, 8)
    full = experts(x, ids, weights)
    for rows in ([0], [5], [39], [3, 17, 22], list(range(20, 40))):
        assert torch.equal(_bits(experts(x[rows], ids[rows], weights[rows])), _bits(full[rows]))


def test_bad_ids_and_shapes_are_refused():
    experts = _experts(("Q8_0",) * 3)
    if not HAVE_KERNEL:
        return
    x, (ids, weights) = _x(3), _routing(3, 2)
    hits = experts.hits.clone()
    for bad in (NUM_EXPERTS, -1):
        wrong = ids.clone()
        wrong[1, 1] = bad
        with pytest.raises(ValueError, match="refused ids"):
            experts.kernel(x, wrong, weights, experts.hits)
    assert torch.equal(experts.hits, hits)  # nothing counted
    with pytest.raises(ValueError, match="do not fit"):
        experts.kernel(x, ids[:2], weights[:2])
    with pytest.raises(ValueError, match="expected x of shape"):
        experts.kernel(x[:, :128], ids, weights)
    assert experts.kernel(x[:0], ids[:0], weights[:0]).shape == (0, 256)


def test_the_compiled_path_is_chosen_only_where_it_applies(monkeypatch):
    experts = _experts(("Q4_K",) * 3)
    assert (experts.kernel is not None) == HAVE_KERNEL
    experts.ops = TORCH_OPS  # torch's SiLU: the Python grouping computes it, so the C call would differ
    experts.prepare(torch.device("cpu"), torch.float32)
    assert experts.kernel is None
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.bfloat16)
    assert experts.kernel is None
    experts.moe = dataclasses.replace(experts.moe, activation="swiglu_clamped")  # gpt-oss
    experts.prepare(torch.device("cpu"), torch.float32)
    assert experts.kernel is None
    experts.moe = dataclasses.replace(experts.moe, activation="silu")
    monkeypatch.setenv("LLMD_CPU_GEMM", "0")
    experts.prepare(torch.device("cpu"), torch.float32)
    assert experts.kernel is None
    monkeypatch.delenv("LLMD_CPU_GEMM")
    fp = Experts(256, MoEConfig(num_experts=NUM_EXPERTS, top_k=2, intermediate_size=256))  # fp experts
    fp.ops = CPU_OPS
    fp.prepare(torch.device("cpu"), torch.float32)
    assert fp.kernel is None
    experts.prepare(torch.device("cpu"), torch.float32)
    assert (experts.kernel is not None) == HAVE_KERNEL
    experts.float()  # a move or cast drops the kernel (it holds the blocks' addresses); the next call prepares again
    assert experts.kernel is None and not experts.prepared


def _silu_mul(lib, gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """That library's own C SiLU * up (llmd.kernels.cpu_ops binds the default library's)."""
    lib.llmd_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_int64]
    y = torch.empty(gate_up.shape[0], n)
    lib.llmd_silu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), n, gate_up.shape[0], n)
    return y


def test_portable_build_computes_the_same_bits(tmp_path, monkeypatch):
    """The scalar code (built without SIMD flags) runs the same steps: its MoE call equals the Python grouping over
    its own per-expert kernels and SiLU, on both paths, for signed and super-block types."""
    if not HAVE_KERNEL:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS + ["-fopenmp"]))
    assert lib.llmd_cpu_gemm_simd() == 0
    experts = _experts(("Q4_0", "Q4_K", "Q6_K"))
    gate_up = [(p.qweight, p.type_name) for p in experts.gate_up_proj.parts]
    down = [(p.qweight, p.type_name) for p in experts.down_proj.parts]
    t, k = 20, 8
    x, (ids, weights) = _x(t), _routing(t, k)
    flat = ids.reshape(-1)
    for act in ("fp32", "int8"):
        slots = torch.empty(t * k, 256)
        for e in flat.unique().tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            h = cpu_gemm.GGUFKernel(lib, [(q[e], ty) for q, ty in gate_up], 256, act=act)(x[pairs // k], 2)
            slots[pairs] = cpu_gemm.GGUFKernel(lib, [(q[e], ty) for q, ty in down], 256, act=act)(
                _silu_mul(lib, h, 256), 2)
        slots = slots.view(t, k, 256)
        ref = slots[:, 0] * weights[:, :1]
        for j in range(1, k):
            ref = ref + slots[:, j] * weights[:, j:j + 1]
        kernel = cpu_moe.MoEKernel(lib, gate_up, down, act=act)
        got = kernel(x, ids, weights, threads=2)
        assert torch.equal(_bits(got), _bits(ref)), act
        assert torch.equal(_bits(kernel(x[7:8], ids[7:8], weights[7:8], threads=1)), _bits(got[7:8]))
