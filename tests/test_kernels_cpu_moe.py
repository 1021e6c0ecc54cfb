"""A mixture-of-experts layer's packed GGUF experts in one C call (llmd.kernels.cpu_moe, chosen by
llmd.model.moe.Experts.prepare) against the Python grouping it replaces (Experts.grouped: one GGUFKernel per expert
hit, the C SiLU * up, the weighted sum in slot order), bit for bit: several types (gate, up and down of one type, and
Q4_K_M's mixes), 1, 3 and 64 tokens, 1, 2 and 8 experts per token, experts hit by no token, one and many, on each
activation path (fp32, int8, int16 where the types take it), with several thread counts; and gpt-oss's experts
(biases on both projections, the clamped SwiGLU of the C ops) in MXFP4 and Q8_0, with 1, 2 and 4 experts per token;
and Nemotron-H's ungated squared-ReLU experts.
A row's output does not depend on its step; the expert counts add up; bad ids are refused; the compiled path is chosen
only where it applies.

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


def _packed(num_experts: int, k: int, parts: list[tuple[int, str]], seed: int, bias: bool = False
            ) -> GGUFExpertLinear:
    layer = GGUFExpertLinear(num_experts, k, parts, bias=bias)
    for i, (part, (n, type_name)) in enumerate(zip(layer.parts, parts)):
        blocks = random_blocks(type_name, num_experts * n, k, seed=seed + i, scale=0.002)
        part.qweight.copy_(torch.from_numpy(blocks).view(part.qweight.shape))
    if layer.bias is not None:
        layer.bias.zero_()
    return layer


def _experts(types: tuple[str, str, str], hidden: int = 256, inter: int = 256, seed: int = 0, bias: bool = False,
             **moe) -> Experts:
    """An MoE layer's experts with random packed blocks (and zero biases), its ops the C ones (as the loader binds them
    on the CPU); moe: MoEConfig fields."""
    experts = Experts(hidden, MoEConfig(num_experts=NUM_EXPERTS, top_k=8, intermediate_size=inter, **moe), bias=bias)
    experts.gate_up_proj = _packed(NUM_EXPERTS, hidden, [(inter, types[0]), (inter, types[1])], seed, bias)
    experts.down_proj = _packed(NUM_EXPERTS, inter, [(hidden, types[2])], seed + 7, bias)
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.float32)
    return experts


def _gpt_oss(types: tuple[str, str, str], activation: str = "swiglu_clamped") -> Experts:
    """gpt-oss's experts: random biases on both projections, of their outputs' size, and the clamped SwiGLU whose limit
    a third of _x's gate and up values cross (both ways)."""
    experts = _experts(types, bias=True, activation=activation)
    g = torch.Generator().manual_seed(5)
    x = _x(64)
    gate_up = experts.gate_up_proj
    gate_up.bias.copy_(torch.randn(gate_up.bias.shape, generator=g) * gate_up.expert(0, x).std())
    y = gate_up.expert(0, x)
    limit = y.abs().quantile(0.67).item()
    experts.moe = dataclasses.replace(experts.moe, swiglu_limit=limit)
    if activation == "swiglu_clamped":
        gate, up = y.split(256, dim=-1)
        assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()
    down = experts.down_proj
    down.bias.copy_(torch.randn(down.bias.shape, generator=g) * down.expert(0, experts.activation(y)).std())
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


@pytest.mark.parametrize("act", ["int8", "fp32", "int16"])
@pytest.mark.parametrize("types,activation", [(("MXFP4",) * 3, "swiglu_clamped"), (("Q8_0",) * 3, "swiglu_clamped"),
                                              (("Q4_K", "Q4_K", "Q6_K"), "silu")], ids=["MXFP4", "Q8_0", "silu"])
def test_gpt_oss_experts_biases_and_clamped_swiglu_equal_the_python_grouping(types, activation, act, monkeypatch):
    """gpt-oss's experts (a bias on each projection, the clamped SwiGLU) in the one C call; and a SiLU layer with a
    bias on down only (the biases are independent)."""
    monkeypatch.setitem(cpu_gemm.ACTIVATIONS, "gguf", act)
    experts = _gpt_oss(types, activation)
    if activation == "silu":
        experts.gate_up_proj.bias = None
        experts.prepare(torch.device("cpu"), torch.float32)
    if not HAVE_KERNEL:
        assert experts.kernel is None
        return
    kernel = experts.kernel
    assert isinstance(kernel, cpu_moe.MoEKernel) and kernel.activation == activation
    assert (kernel.moe.gate_up_bias is not None) == (activation != "silu") and kernel.moe.down_bias is not None
    for t in (1, 3, 64):
        x = _x(t)
        for k in (1, 2, 4):
            ids, weights = _routing(t, k, seed=t + k)
            ref = experts.grouped(x, ids, weights)
            for threads in (1, 2, 3):
                assert torch.equal(_bits(kernel(x, ids, weights, threads=threads)), _bits(ref)), (t, k, threads)
            assert torch.equal(_bits(experts(x, ids, weights)), _bits(ref))  # forward takes the compiled path


@pytest.mark.parametrize("act", ["int8", "fp32", "int16"])
@pytest.mark.parametrize("types", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K")], ids="-".join)
def test_nemotron_h_ungated_squared_relu_experts_equal_the_python_grouping(types, act, monkeypatch):
    """Nemotron-H's experts: no gate, gate_up_proj holding the up rows alone (one part), relu(up)^2; with random
    biases on both projections (the C call's gate_up width is then inter, not 2 * inter)."""
    monkeypatch.setitem(cpu_gemm.ACTIVATIONS, "gguf", act)
    experts = Experts(256, MoEConfig(num_experts=NUM_EXPERTS, top_k=8, intermediate_size=256, activation="relu2"),
                      bias=True)
    experts.gate_up_proj = _packed(NUM_EXPERTS, 256, [(256, types[0])], 0, bias=True)
    experts.down_proj = _packed(NUM_EXPERTS, 256, [(256, types[1])], 7, bias=True)
    g = torch.Generator().manual_seed(3)
    for layer in (experts.gate_up_proj, experts.down_proj):
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.01)
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.float32)
    if not HAVE_KERNEL:
        assert experts.kernel is None
        return
    kernel = experts.kernel
    assert isinstance(kernel, cpu_moe.MoEKernel) and kernel.activation == "relu2" and kernel.inter == 256
    for t in (1, 3, 64):
        x = _x(t)
        for k in (1, 2, 8):
            ids, weights = _routing(t, k, seed=t + k)
            ref = experts.grouped(x, ids, weights)
            assert (experts.activation(experts.gate_up_proj.expert(0, x)) == 0).any()  # relu cuts some
            for threads in (1, 3):
                assert torch.equal(_bits(kernel(x, ids, weights, threads=threads)), _bits(ref)), (t, k, threads)
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
    experts.moe = dataclasses.replace(experts.moe, activation="swiglu_clamped")  # gpt-oss: the C op of the table
    experts.prepare(torch.device("cpu"), torch.float32)
    assert (experts.kernel is not None) == HAVE_KERNEL
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


def _activation(lib, gate_up: torch.Tensor, n: int, moe: MoEConfig) -> torch.Tensor:
    """That library's own C activation (llmd.kernels.cpu_ops binds the default library's)."""
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    y = torch.empty(gate_up.shape[0], n)
    call = (gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), n, gate_up.shape[0], n)
    if moe.activation == "silu":
        lib.llmd_silu_mul.argtypes = args
        lib.llmd_silu_mul(*call)
    else:
        lib.llmd_swiglu_clamped_mul.argtypes = args + [ctypes.c_float, ctypes.c_float]
        lib.llmd_swiglu_clamped_mul(*call, moe.swiglu_alpha, moe.swiglu_limit)
    return y


def test_portable_build_computes_the_same_bits(tmp_path, monkeypatch):
    """The scalar code (built without SIMD flags) runs the same steps: its MoE call equals the Python grouping over
    its own per-expert kernels and activation, on both paths, for signed and super-block types, and for gpt-oss's
    experts (biases, the clamped SwiGLU)."""
    if not HAVE_KERNEL:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS + ["-fopenmp"]))
    assert lib.llmd_cpu_gemm_simd() == 0
    t, k = 20, 8
    x, (ids, weights) = _x(t), _routing(t, k)
    flat = ids.reshape(-1)
    for experts in (_experts(("Q4_0", "Q4_K", "Q6_K")), _gpt_oss(("MXFP4",) * 3)):
        gate_up = [(p.qweight, p.type_name) for p in experts.gate_up_proj.parts]
        down = [(p.qweight, p.type_name) for p in experts.down_proj.parts]
        biases, moe = (experts.gate_up_proj.bias, experts.down_proj.bias), experts.moe
        for act in ("fp32", "int8"):
            slots = torch.empty(t * k, 256)
            for e in flat.unique().tolist():
                pairs = (flat == e).nonzero().squeeze(1)
                h = cpu_gemm.GGUFKernel(lib, [(q[e], ty) for q, ty in gate_up], 256, act=act)(x[pairs // k], 2)
                h = h if biases[0] is None else h + biases[0][e]
                y = cpu_gemm.GGUFKernel(lib, [(q[e], ty) for q, ty in down], 256, act=act)(
                    _activation(lib, h, 256, moe), 2)
                slots[pairs] = y if biases[1] is None else y + biases[1][e]
            slots = slots.view(t, k, 256)
            ref = slots[:, 0] * weights[:, :1]
            for j in range(1, k):
                ref = ref + slots[:, j] * weights[:, j:j + 1]
            kernel = cpu_moe.MoEKernel(lib, gate_up, down, act=act, biases=biases, activation=moe.activation,
                                       alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
            got = kernel(x, ids, weights, threads=2)
            assert torch.equal(_bits(got), _bits(ref)), (moe.activation, act)
            assert torch.equal(_bits(kernel(x[7:8], ids[7:8], weights[7:8], threads=1)), _bits(got[7:8]))
