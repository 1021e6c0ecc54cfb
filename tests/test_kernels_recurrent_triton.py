"""The recurrent layers' Triton kernels (llmd.kernels.recurrent_triton: the short causal convolution, the gated delta
rule of Qwen3.5's Gated DeltaNet and Mamba2's selective scan, varlen over a step's batch through its state slots)
against their torch references (llmd.model.recurrent's *_ref): fp32 within 1e-5 on mixed batches (fresh and
continuing sequences, a prefill chunk beside decode tokens, slots in any order, sizes that leave partial blocks,
q/k/v and x/B/C as strided views, dt clamped or not), by the token-by-token and the chunked kernels, the state written
back at each slot and nowhere else, a sequence alone == in a batch and one chunk == several, bit for bit; bf16
activations within bf16's rounding. Without CUDA they run under the Triton interpreter on tiny shapes
(tests/kernel_testing.py); the GPU tests at the end (run by tests/gpu/run_gpu_checks.sh, hybrid stage) check
Qwen3.5-9B's and Granite-4.0-H-Small's layer shapes and llmd.model.recurrent choosing the kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, load_kernel_module

from llmd.model import recurrent as rec

pytest.importorskip("triton", reason="the kernels need triton")
rt = load_kernel_module("recurrent_triton")

NUM_SLOTS = 7
# channels 150: a block of 128 and a partial one; Dk 20 and Dv 44: partial key and value tiles; 2 q/k heads for 4
# value heads
C, TAPS, HK, HV, DK, DV = 150, 4, 2, 4, 20, 44
# Mamba2: 4 heads of 20 (a tile of 16 rows and a partial one; one partial tile of 32 in the chunked kernel), 2 groups
# of B/C, a state of 13 (a partial block)
MH, MP, MG, MN = 4, 20, 2, 13
DT_LIMIT = (0.0, float("inf"))
WEIGHTS = ("weight", "bias", "dt_bias", "A", "D")  # per channel or head, not per token
BATCHES = {  # (query lengths, fresh, slots)
    "mixed": ([19, 1, 5, 1, 2], [True, False, False, True, False], [3, 0, 5, 6, 1]),  # 19: two token blocks
    "decodes": ([1, 1, 1], [False, True, False], [4, 2, 0]),
}


def _batch(lens: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, 2 * HK * DK + HV * DV, generator=g).to(dtype).to(DEVICE)
    xbc = torch.randn(t, MH * MP + 2 * MG * MN, generator=g).to(dtype).to(DEVICE)
    return dict(x=torch.randn(t, C, generator=g).to(dtype).to(DEVICE),
                weight=(torch.randn(C, TAPS, generator=g) * 0.5).to(dtype).to(DEVICE),
                bias=(torch.randn(C, generator=g) * 0.1).to(dtype).to(DEVICE),
                q=qkv[:, : HK * DK].view(t, HK, DK), k=qkv[:, HK * DK : 2 * HK * DK].view(t, HK, DK),
                v=qkv[:, 2 * HK * DK :].view(t, HV, DV), g=(-torch.rand(t, HV, generator=g) * 0.5).to(DEVICE),
                beta=torch.rand(t, HV, generator=g).to(dtype).to(DEVICE),
                xs=xbc[:, : MH * MP].view(t, MH, MP), B=xbc[:, MH * MP : MH * MP + MG * MN].view(t, MG, MN),
                C=xbc[:, MH * MP + MG * MN :].view(t, MG, MN),
                dt=torch.randn(t, MH + 5, generator=g).to(dtype).to(DEVICE)[:, 2 : 2 + MH],
                dt_bias=torch.randn(MH, generator=g).to(dtype).to(DEVICE),
                A=-torch.rand(MH, generator=g).exp().to(DEVICE), D=torch.randn(MH, generator=g).to(dtype).to(DEVICE))


def _states(conv_dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conv state, delta-rule state, Mamba2 state) of every slot"""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_SLOTS, C, TAPS - 1, generator=g).to(conv_dtype).to(DEVICE),
            (torch.randn(NUM_SLOTS, HV, DK, DV, generator=g) * 0.3).to(DEVICE),
            (torch.randn(NUM_SLOTS, MH, MP, MN, generator=g) * 0.3).to(DEVICE))


def _scan_args(a: dict) -> tuple:
    return a["xs"], a["dt"], a["dt_bias"], a["A"], a["B"], a["C"], a["D"]


def _meta(lens, fresh, slots) -> rec.StateMetadata:
    return rec.StateMetadata.build(slots, fresh, lens, DEVICE)


def _kernel(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True,
            chunk_from: int = rt.DELTA_CHUNK, dt_limit: tuple[float, float] = DT_LIMIT):
    """The conv, the delta rule and the scan of one step (in place on `states`); chunk_from: the fewest tokens a
    sequence runs the chunked delta rule and the chunked scan with."""
    y = rt.causal_conv1d(a["x"], a["weight"], a["bias"] if bias else None, states[0], *meta.kernel_tensors(), silu=silu)
    o = rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], *meta.kernel_tensors(),
                            chunk_from=chunk_from)
    scan = rt.mamba2_scan(*_scan_args(a), states[2], *meta.kernel_tensors(), dt_limit=dt_limit, chunk_from=chunk_from)
    return y, o, scan


def _ref(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True,
         dt_limit: tuple[float, float] = DT_LIMIT):
    y = rec.causal_conv1d_ref(a["x"], a["weight"], a["bias"] if bias else None, states[0], meta, silu)
    o = rec.gated_delta_rule_ref(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], meta)
    return y, o, rec.mamba2_scan_ref(*_scan_args(a), states[2], meta, dt_limit)


def _rows(a: dict, lo: int, hi: int) -> dict:
    return {key: value if key in WEIGHTS else value[lo:hi] for key, value in a.items()}


# which sequences the delta rule and the scan run by chunks: those of DELTA_CHUNK tokens or more (the delta rule's
# default; sequence 0 of the mixed batch), all, none
CHUNK_FROM = {"by length": rt.DELTA_CHUNK, "all chunked": 1, "all by token": 10 ** 9}


@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("bias,silu,chunks,dt_limit", [(True, True, "by length", DT_LIMIT),
                                                       (False, False, "all chunked", (0.2, 0.9)),
                                                       (True, True, "all by token", (0.2, 0.9))])
def test_kernels_compute_the_reference(name, bias, silu, chunks, dt_limit):
    lens, fresh, slots = BATCHES[name]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    states, ref_states = _states(), _states()
    got = _kernel(a, meta, states, bias, silu, CHUNK_FROM[chunks], dt_limit)
    for got, want in zip(got, _ref(a, meta, ref_states, bias, silu, dt_limit)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0], ref_states[0])  # the conv state holds copied inputs: every slot exactly
    torch.testing.assert_close(states[1], ref_states[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[2], ref_states[2], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert all(torch.equal(s[untouched], old[untouched]) for s, old in zip(states, _states()))


def test_a_sequence_alone_and_in_a_batch_bit_for_bit():
    """Each sequence alone, with its own kernel by its length (sequence 0: chunked; the others: token by token)."""
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    states = _states()
    outs = _kernel(a, meta, states)
    starts = meta.query_start_list
    for b, (n, new, slot) in enumerate(zip(lens, fresh, slots)):
        alone = _states()
        ones = _kernel(_rows(a, starts[b], starts[b + 1]), _meta([n], [new], [slot]), alone)
        assert all(torch.equal(one, out[starts[b] : starts[b + 1]]) for one, out in zip(ones, outs))
        assert all(torch.equal(one[slot], end[slot]) for one, end in zip(alone, states))


def test_a_prefill_in_chunks_carries_its_state():
    """Sequence 0 (fresh, 19 tokens) in chunks of 2 (fewer than K - 1 inputs), 1 and 16: the conv (and the
    token-by-token delta rule and scan) the bits of one chunk; the chunked delta rule and scan, whose chunks then begin
    elsewhere, within fp32's rounding."""
    a = _rows(_batch(BATCHES["mixed"][0]), 0, 19)
    for chunk_from in (10 ** 9, 1):
        states = _states()
        whole = _kernel(a, _meta([19], [True], [3]), states, chunk_from=chunk_from)
        parts, got = _states(seed=5), []
        for lo, hi in ((0, 2), (2, 3), (3, 19)):
            got.append(_kernel(_rows(a, lo, hi), _meta([hi - lo], [lo == 0], [3]), parts, chunk_from=chunk_from))
        assert torch.equal(torch.cat([g[0] for g in got]), whole[0]) and torch.equal(parts[0][3], states[0][3])
        tol = dict(rtol=0, atol=0) if chunk_from > 1 else dict(rtol=1e-5, atol=1e-5)
        for i in (1, 2):
            torch.testing.assert_close(torch.cat([g[i] for g in got]), whole[i], **tol)
            torch.testing.assert_close(parts[i][3], states[i][3], **tol)


def test_bf16_activations_within_their_rounding():
    """bf16 activations and conv state (the model's dtype on CUDA), fp32 recurrent state: the kernels compute in fp32
    and round once (the chunked delta rule's products in tf32 on the GPU), against the fp32 reference of the same
    values."""
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens, torch.bfloat16), _meta(lens, fresh, slots)
    states = _states(torch.bfloat16)
    exact = {key: value.float() for key, value in a.items()}
    ref_states = (states[0].float(), states[1].clone(), states[2].clone())
    got, want = _kernel(a, meta, states), _ref(exact, meta, ref_states)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2)
    assert torch.equal(states[0].float(), ref_states[0])
    torch.testing.assert_close(states[1], ref_states[1], rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(states[2], ref_states[2], rtol=1e-2, atol=2e-3)


def test_layouts_the_kernels_do_not_take_are_left_to_the_reference():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    conv, ssm, mamba = _states()
    s, f, q = meta.kernel_tensors()
    assert rt.causal_conv1d(a["x"].t().contiguous().t(), a["weight"], None, conv, s, f, q) is None
    assert rt.causal_conv1d(a["x"], a["weight"], None, conv.transpose(1, 2).contiguous(), s, f, q) is None
    assert rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm.half(), s, f, q) is None
    assert rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm, s, f.long(), q) is None
    xs, dt, dt_bias, A, B, Cm, D = _scan_args(a)
    assert rt.mamba2_scan(xs, dt, dt_bias, A, B, Cm, D, mamba.half(), s, f, q) is None
    assert rt.mamba2_scan(xs, dt, dt_bias, A, B, Cm, D, mamba.transpose(2, 3), s, f, q) is None
    assert rt.mamba2_scan(xs.transpose(1, 2), dt, dt_bias, A, B, Cm, D, mamba, s, f, q) is None
    assert rt.mamba2_scan(xs[:, :3], dt[:, :3], dt_bias[:3], A[:3], B, Cm, D[:3], mamba[:, :3].contiguous(), s, f,
                          q) is None  # 3 heads for 2 groups


# GPU (run by tests/gpu/run_gpu_checks.sh, hybrid stage): Qwen3.5-9B's and Granite-4.0-H-Small's layer shapes, bf16,
# and the model's functions choosing the kernels on CUDA
QWEN35_9B = dict(hk=16, hv=32, dk=128, dv=128, taps=4)
GRANITE_4_H_SMALL = dict(heads=128, head_dim=64, state=128, groups=1, taps=4)


@pytest.mark.gpu
def test_qwen35_9b_layer_shape_on_gpu():
    hk, hv, d, taps = QWEN35_9B["hk"], QWEN35_9B["hv"], QWEN35_9B["dk"], QWEN35_9B["taps"]
    channels = 2 * hk * d + hv * d
    lens, fresh, slots = [300, 1, 1, 40, 1], [True, False, False, False, True], [2, 0, 5, 1, 3]
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, channels, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(channels, taps, device="cuda", generator=g) * 0.3).bfloat16()
    conv = torch.randn(6, channels, taps - 1, device="cuda", generator=g).bfloat16()
    ssm = torch.randn(6, hv, d, d, device="cuda", generator=g) * 0.05
    gate = -torch.rand(t, hv, device="cuda", generator=g) * 0.3
    beta = torch.rand(t, hv, device="cuda", generator=g).bfloat16()
    meta = rec.StateMetadata.build(slots, fresh, lens, "cuda")
    ref_conv, ref_ssm = conv.float(), ssm.clone()
    qkv = rec.causal_conv1d(x, weight, None, conv, meta)  # the dispatch: the Triton kernels on CUDA
    want_qkv = rec.causal_conv1d_ref(x.float(), weight.float(), None, ref_conv, meta)
    torch.testing.assert_close(qkv.float(), want_qkv, rtol=2e-2, atol=2e-2)
    assert torch.equal(conv.float(), ref_conv)
    q = qkv[:, : hk * d].view(t, hk, d)
    k = qkv[:, hk * d : 2 * hk * d].view(t, hk, d)
    v = qkv[:, 2 * hk * d :].view(t, hv, d)
    out = rec.gated_delta_rule(q, k, v, gate, beta, ssm, meta)
    want = rec.gated_delta_rule_ref(q.float(), k.float(), v.float(), gate, beta.float(), ref_ssm, meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-2, atol=2e-3)  # the chunked kernel's products in tf32


@pytest.mark.gpu
def test_granite_4_h_small_layer_shape_on_gpu():
    """A Mamba2 layer's conv (with bias) and scan through llmd.model.recurrent on CUDA (the Triton kernels), bf16
    activations and conv state, fp32 recurrent state: a 300-token fresh prefill chunk and a 40-token continuing one
    (chunked scan) beside decode tokens (token by token), against the fp32 reference of the same values."""
    h, p, n, grp, taps = (GRANITE_4_H_SMALL[k] for k in ("heads", "head_dim", "state", "groups", "taps"))
    channels = h * p + 2 * grp * n
    lens, fresh, slots = [300, 1, 1, 40, 1], [True, False, False, False, True], [2, 0, 5, 1, 3]
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, channels, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(channels, taps, device="cuda", generator=g) * 0.3).bfloat16()
    bias = (torch.randn(channels, device="cuda", generator=g) * 0.1).bfloat16()
    conv = torch.randn(6, channels, taps - 1, device="cuda", generator=g).bfloat16()
    ssm = torch.randn(6, h, p, n, device="cuda", generator=g) * 0.05
    dt = (torch.randn(t, h, device="cuda", generator=g) - 2.0).bfloat16()
    dt_bias = (torch.randn(h, device="cuda", generator=g) * 0.1).bfloat16()
    a = -torch.rand(h, device="cuda", generator=g) * 4.0 - 0.5
    d = torch.randn(h, device="cuda", generator=g).bfloat16()
    meta = rec.StateMetadata.build(slots, fresh, lens, "cuda")
    ref_conv, ref_ssm = conv.float(), ssm.clone()
    xbc = rec.causal_conv1d(x, weight, bias, conv, meta)  # the dispatch: the Triton kernels on CUDA
    want_xbc = rec.causal_conv1d_ref(x.float(), weight.float(), bias.float(), ref_conv, meta)
    torch.testing.assert_close(xbc.float(), want_xbc, rtol=2e-2, atol=2e-2)
    assert torch.equal(conv.float(), ref_conv)
    xs = xbc[:, : h * p].view(t, h, p)
    b = xbc[:, h * p : h * p + grp * n].view(t, grp, n)
    c = xbc[:, h * p + grp * n :].view(t, grp, n)
    out = rec.mamba2_scan(xs, dt, dt_bias, a, b, c, d, ssm, meta)
    want = rec.mamba2_scan_ref(xs.float(), dt.float(), dt_bias.float(), a, b.float(), c.float(), d.float(), ref_ssm,
                               meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-2, atol=2e-3 * ref_ssm.abs().max().item())  # products in tf32
