"""The recurrent layers' Triton kernels (llmd.kernels.recurrent_triton: the short causal convolution and the gated delta
rule of Qwen3.5's Gated DeltaNet, varlen over a step's batch through its state slots) against their torch references
(llmd.model.recurrent's *_ref): fp32 within 1e-5 on mixed batches (fresh and continuing sequences, a prefill chunk
beside decode tokens, slots in any order, sizes that leave partial blocks, q/k/v as strided views), the state written
back at each slot and nowhere else, a sequence alone == in a batch and one chunk == several, bit for bit; bf16
activations within bf16's rounding. Without CUDA they run under the Triton interpreter on tiny shapes
(tests/kernel_testing.py); the GPU tests at the end (run by tests/gpu/run_gpu_checks.sh, hybrid stage) check
Qwen3.5-9B's layer shape and llmd.model.recurrent choosing the kernels on CUDA.
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
BATCHES = {  # (query lengths, fresh, slots)
    "mixed": ([19, 1, 5, 1, 2], [True, False, False, True, False], [3, 0, 5, 6, 1]),  # 19: two token blocks
    "decodes": ([1, 1, 1], [False, True, False], [4, 2, 0]),
}


def _batch(lens: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, 2 * HK * DK + HV * DV, generator=g).to(dtype).to(DEVICE)
    return dict(x=torch.randn(t, C, generator=g).to(dtype).to(DEVICE),
                weight=(torch.randn(C, TAPS, generator=g) * 0.5).to(dtype).to(DEVICE),
                bias=(torch.randn(C, generator=g) * 0.1).to(dtype).to(DEVICE),
                q=qkv[:, : HK * DK].view(t, HK, DK), k=qkv[:, HK * DK : 2 * HK * DK].view(t, HK, DK),
                v=qkv[:, 2 * HK * DK :].view(t, HV, DV), g=(-torch.rand(t, HV, generator=g) * 0.5).to(DEVICE),
                beta=torch.rand(t, HV, generator=g).to(dtype).to(DEVICE))


def _states(conv_dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_SLOTS, C, TAPS - 1, generator=g).to(conv_dtype).to(DEVICE),
            (torch.randn(NUM_SLOTS, HV, DK, DV, generator=g) * 0.3).to(DEVICE))


def _meta(lens, fresh, slots) -> rec.StateMetadata:
    return rec.StateMetadata.build(slots, fresh, lens, DEVICE)


def _kernel(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True,
            chunk_from: int = rt.DELTA_CHUNK):
    y = rt.causal_conv1d(a["x"], a["weight"], a["bias"] if bias else None, states[0], *meta.kernel_tensors(), silu=silu)
    o = rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], *meta.kernel_tensors(),
                            chunk_from=chunk_from)
    return y, o


def _ref(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True):
    y = rec.causal_conv1d_ref(a["x"], a["weight"], a["bias"] if bias else None, states[0], meta, silu)
    o = rec.gated_delta_rule_ref(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], meta)
    return y, o


def _rows(a: dict, lo: int, hi: int) -> dict:
    return {key: value if key in ("weight", "bias") else value[lo:hi] for key, value in a.items()}


# which sequences the delta rule runs by chunks: those of DELTA_CHUNK tokens or more (the default), all, none
CHUNK_FROM = {"by length": rt.DELTA_CHUNK, "all chunked": 1, "all by token": 10 ** 9}


@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("bias,silu,chunks", [(True, True, "by length"), (False, False, "all chunked"),
                                              (True, True, "all by token")])
def test_kernels_compute_the_reference(name, bias, silu, chunks):
    lens, fresh, slots = BATCHES[name]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    states, ref_states = _states(), _states()
    got = _kernel(a, meta, states, bias, silu, CHUNK_FROM[chunks])
    for got, want in zip(got, _ref(a, meta, ref_states, bias, silu)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0], ref_states[0])  # the conv state holds copied inputs: every slot exactly
    torch.testing.assert_close(states[1], ref_states[1], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert all(torch.equal(s[untouched], old[untouched]) for s, old in zip(states, _states()))


def test_a_sequence_alone_and_in_a_batch_bit_for_bit():
    """Each sequence alone, with its own kernel by its length (sequence 0: chunked; the others: token by token)."""
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    states = _states()
    y, o = _kernel(a, meta, states)
    starts = meta.query_start_list
    for b, (n, new, slot) in enumerate(zip(lens, fresh, slots)):
        alone = _states()
        y1, o1 = _kernel(_rows(a, starts[b], starts[b + 1]), _meta([n], [new], [slot]), alone)
        assert torch.equal(y1, y[starts[b] : starts[b + 1]]) and torch.equal(o1, o[starts[b] : starts[b + 1]])
        assert torch.equal(alone[0][slot], states[0][slot]) and torch.equal(alone[1][slot], states[1][slot])


def test_a_prefill_in_chunks_carries_its_state():
    """Sequence 0 (fresh, 19 tokens) in chunks of 2 (fewer than K - 1 inputs), 1 and 16: the conv (and the
    token-by-token delta rule) the bits of one chunk; the chunked delta rule, whose chunks then begin elsewhere, within
    fp32's rounding."""
    a = _rows(_batch(BATCHES["mixed"][0]), 0, 19)
    for chunk_from in (10 ** 9, 1):
        states = _states()
        y, o = _kernel(a, _meta([19], [True], [3]), states, chunk_from=chunk_from)
        parts, got = _states(seed=5), []
        for lo, hi in ((0, 2), (2, 3), (3, 19)):
            got.append(_kernel(_rows(a, lo, hi), _meta([hi - lo], [lo == 0], [3]), parts, chunk_from=chunk_from))
        assert torch.equal(torch.cat([g[0] for g in got]), y[:19]) and torch.equal(parts[0][3], states[0][3])
        tol = dict(rtol=0, atol=0) if chunk_from > 1 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([g[1] for g in got]), o[:19], **tol)
        torch.testing.assert_close(parts[1][3], states[1][3], **tol)


def test_bf16_activations_within_their_rounding():
    """bf16 activations and conv state (the model's dtype on CUDA), fp32 recurrent state: the kernels compute in fp32
    and round once (the chunked delta rule's products in tf32 on the GPU), against the fp32 reference of the same
    values."""
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens, torch.bfloat16), _meta(lens, fresh, slots)
    states = _states(torch.bfloat16)
    exact = {key: value.float() for key, value in a.items()}
    ref_states = (states[0].float(), states[1].clone())
    got, want = _kernel(a, meta, states), _ref(exact, meta, ref_states)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2)
    assert torch.equal(states[0].float(), ref_states[0])
    torch.testing.assert_close(states[1], ref_states[1], rtol=1e-2, atol=2e-3)


def test_layouts_the_kernels_do_not_take_are_left_to_the_reference():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), _meta(lens, fresh, slots)
    conv, ssm = _states()
    s, f, q = meta.kernel_tensors()
    assert rt.causal_conv1d(a["x"].t().contiguous().t(), a["weight"], None, conv, s, f, q) is None
    assert rt.causal_conv1d(a["x"], a["weight"], None, conv.transpose(1, 2).contiguous(), s, f, q) is None
    assert rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm.half(), s, f, q) is None
    assert rt.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm, s, f.long(), q) is None


# GPU (run by tests/gpu/run_gpu_checks.sh, hybrid stage): Qwen3.5-9B's layer shape, bf16, and the model's functions
# choosing the kernels on CUDA
QWEN35_9B = dict(hk=16, hv=32, dk=128, dv=128, taps=4)


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
