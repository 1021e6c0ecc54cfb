"""The recurrent layers' C kernels (llmd.kernels.cpu_recurrent: the short causal convolution, the gated delta rule of
Qwen3.5's Gated DeltaNet and Mamba2's selective scan) against their torch references (llmd.model.recurrent's *_ref),
within 1e-5 in fp32, on mixed batches: fresh and continuing sequences, prefill chunks beside decode tokens, slots in
any order, q/k/v and x/B/C as the strided views of the conv's output the model passes, grouped heads, sizes with
vector tails, dt clamped or not. Every slot's state is written back as the reference writes it (the slots outside the
batch untouched); a sequence's outputs and state are the same bits alone and in a batch, with 1 and 2 threads, and in
one chunk or several. llmd.model.recurrent's three functions run the kernels on fp32 CPU tensors and the reference
elsewhere.

Where no C compiler exists no kernel is made; the tests then check that branch instead of skipping."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import cpu_recurrent
from llmd.model import recurrent as rec

HAVE_KERNEL = cpu_recurrent.load() is not None
NUM_SLOTS = 7
# channels 76 = a block of 64 and one of 12 (a vector and a scalar tail); Dk 20 (a vector tail in the L2 norm),
# Dv 44 (a tile of 32 and one of 12, padded); 2 q/k heads for 6 value heads
C, TAPS, HK, HV, DK, DV = 76, 4, 2, 6, 20, 44
# Mamba2: 6 heads of 23 (a tile of 16 rows and one of 7: rows four at a time and three), 2 groups of B/C, a state of
# 13 (a vector and a tail of 5); dt clamped to both families' default limit (0, inf), or to (0.2, 0.9) where a test says
MH, MP, MG, MN = 6, 23, 2, 13
DT_LIMIT = (0.0, float("inf"))
WEIGHTS = ("weight", "bias", "dt_bias", "A", "D")  # per channel or head, not per token


def _batch(lens: list[int], seed: int = 0) -> dict:
    """Random step inputs for sequences of `lens` tokens: the conv's input and weights, q, k, v as views of one
    [T, 2 Hk Dk + Hv Dv] tensor (the model's layout), g <= 0, beta in (0, 1); Mamba2's x, B, C as views of one
    [T, H P + 2 G N] tensor and dt a view of a wider one (the model's), its dt_bias, A < 0 and D."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, 2 * HK * DK + HV * DV, generator=g)
    xbc = torch.randn(t, MH * MP + 2 * MG * MN, generator=g)
    return dict(x=torch.randn(t, C, generator=g), weight=torch.randn(C, TAPS, generator=g) * 0.5,
                bias=torch.randn(C, generator=g) * 0.1,
                q=qkv[:, : HK * DK].view(t, HK, DK), k=qkv[:, HK * DK : 2 * HK * DK].view(t, HK, DK),
                v=qkv[:, 2 * HK * DK :].view(t, HV, DV), g=-torch.rand(t, HV, generator=g) * 0.5,
                beta=torch.rand(t, HV, generator=g),
                xs=xbc[:, : MH * MP].view(t, MH, MP), B=xbc[:, MH * MP : MH * MP + MG * MN].view(t, MG, MN),
                C=xbc[:, MH * MP + MG * MN :].view(t, MG, MN), dt=torch.randn(t, MH + 5, generator=g)[:, 2 : 2 + MH],
                dt_bias=torch.randn(MH, generator=g), A=-torch.rand(MH, generator=g).exp(),
                D=torch.randn(MH, generator=g))


def _states(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conv state, delta-rule state, Mamba2 state) of every slot"""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_SLOTS, C, TAPS - 1, generator=g), torch.randn(NUM_SLOTS, HV, DK, DV, generator=g) * 0.3,
            torch.randn(NUM_SLOTS, MH, MP, MN, generator=g) * 0.3)


def _scan_args(a: dict) -> tuple:
    return a["xs"], a["dt"], a["dt_bias"], a["A"], a["B"], a["C"], a["D"]


def _run(conv, rule, scan, a: dict, meta: rec.StateMetadata, states: tuple, bias: bool = True, silu: bool = True,
         dt_limit: tuple[float, float] = DT_LIMIT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv, the delta rule and the scan of one step (in place on `states`), by llmd.model.recurrent's functions
    (conv, rule, scan: the dispatching ones or the references)."""
    y = conv(a["x"], a["weight"], a["bias"] if bias else None, states[0], meta, silu)
    o = rule(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], meta)
    return y, o, scan(*_scan_args(a), states[2], meta, dt_limit)


def _ref(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True,
         dt_limit: tuple[float, float] = DT_LIMIT):
    return _run(rec.causal_conv1d_ref, rec.gated_delta_rule_ref, rec.mamba2_scan_ref, a, meta, states, bias, silu,
                dt_limit)


def _kernel(a: dict, meta: rec.StateMetadata, states, bias: bool = True, silu: bool = True,
            dt_limit: tuple[float, float] = DT_LIMIT):
    slots, fresh, starts = meta.kernel_tensors()
    y = cpu_recurrent.causal_conv1d(a["x"], a["weight"], a["bias"] if bias else None, states[0], slots, fresh, starts,
                                    silu)
    o = cpu_recurrent.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], states[1], slots, fresh, starts)
    scan = cpu_recurrent.mamba2_scan(*_scan_args(a), states[2], slots, fresh, starts, dt_limit)
    return y, o, scan


def _rows(a: dict, lo: int, hi: int) -> dict:
    return {key: value if key in WEIGHTS else value[lo:hi] for key, value in a.items()}


def _clone(states):
    return tuple(s.clone() for s in states)


# (query lengths, fresh, slots): a fresh prefill chunk beside continuing decodes and a continuing chunk; a fresh decode;
# decodes only (the reference's batched path); one long chunk alone
BATCHES = {
    "mixed": ([7, 1, 5, 1, 1], [True, False, False, True, False], [3, 0, 5, 6, 1]),
    "decodes": ([1, 1, 1], [False, True, False], [4, 2, 0]),
    "one chunk": ([40], [False], [2]),
}


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler: the torch branch is checked below")
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("bias,silu,dt_limit", [(True, True, DT_LIMIT), (False, True, (0.2, 0.9)),
                                                (True, False, DT_LIMIT)])
def test_kernels_compute_the_reference(name, bias, silu, dt_limit):
    lens, fresh, slots = BATCHES[name]
    a, meta = _batch(lens), rec.StateMetadata.build(slots, fresh, lens)
    ref_states, states = _states(), _states()
    want = _ref(a, meta, ref_states, bias, silu, dt_limit)
    got = _kernel(a, meta, states, bias, silu, dt_limit)
    for g, w in zip(got, want):
        assert g is not None and g.shape == w.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[0], ref_states[0], rtol=0, atol=0)  # conv inputs are copied, not computed
    torch.testing.assert_close(states[1], ref_states[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[2], ref_states[2], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    before = _states()
    for got_state, old in zip(states, before):
        assert torch.equal(got_state[untouched], old[untouched])


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_a_sequence_alone_and_in_a_batch_and_on_1_or_2_threads_bit_for_bit():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), rec.StateMetadata.build(slots, fresh, lens)
    results = {}
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            states = _states()
            results[threads] = (*_kernel(a, meta, states), *states)
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(x, y) for x, y in zip(results[1], results[2]))
    outs, ends = results[2][:3], results[2][3:]
    starts = meta.query_start_list
    for b, (n, new, slot) in enumerate(zip(lens, fresh, slots)):
        rows = slice(starts[b], starts[b + 1])
        states = _states()
        alone = _kernel(_rows(a, starts[b], starts[b + 1]), rec.StateMetadata.build([slot], [new], [n]), states)
        assert all(torch.equal(one, out[rows]) for one, out in zip(alone, outs))
        assert all(torch.equal(one[slot], end[slot]) for one, end in zip(states, ends))


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_a_prefill_in_chunks_equals_it_in_one_bit_for_bit():
    """The state carried from chunk to chunk (the first fresh, then continuing) is the state one chunk would have."""
    a = _batch([23])
    whole = _states()
    want = _kernel(a, rec.StateMetadata.build([4], [True], [23]), whole)
    parts = _states(seed=5)  # other initial values: the first chunk is fresh
    got = []
    for lo, hi in ((0, 9), (9, 10), (10, 12), (12, 23)):
        got.append(_kernel(_rows(a, lo, hi), rec.StateMetadata.build([4], [lo == 0], [hi - lo]), parts))
    for i in range(3):
        assert torch.equal(torch.cat([g[i] for g in got]), want[i]) and torch.equal(parts[i][4], whole[i][4])


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_qwen35_head_shape_tiles():
    """Dk = Dv = 128 (Qwen3.5's heads: four whole tiles of 32 value columns), one chunk and a decode."""
    g = torch.Generator().manual_seed(3)
    t, hk, hv, d = 6, 1, 2, 128
    q, k, v = torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g), torch.randn(t, hv, d, generator=g)
    gate, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    meta = rec.StateMetadata.build([1, 0], [False, False], [5, 1])
    state = torch.randn(2, hv, d, d, generator=g) * 0.1
    ref_state = state.clone()
    want = rec.gated_delta_rule_ref(q, k, v, gate, beta, ref_state, meta)
    got = cpu_recurrent.gated_delta_rule(q, k, v, gate, beta, state, *meta.kernel_tensors())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_granite_4_head_shape_tiles():
    """P = 64, N = 128 (Granite 4.0-H's Mamba2 heads: four whole tiles of 16 rows, whole vectors), one group for
    both heads, one chunk and a decode."""
    g = torch.Generator().manual_seed(4)
    t, h, p, n = 6, 2, 64, 128
    x, dt = torch.randn(t, h, p, generator=g), torch.randn(t, h, generator=g)
    b, c = torch.randn(t, 1, n, generator=g), torch.randn(t, 1, n, generator=g)
    dt_bias, a, d = torch.randn(h, generator=g), -torch.rand(h, generator=g).exp(), torch.randn(h, generator=g)
    meta = rec.StateMetadata.build([1, 0], [False, False], [5, 1])
    state = torch.randn(2, h, p, n, generator=g) * 0.1
    ref_state = state.clone()
    want = rec.mamba2_scan_ref(x, dt, dt_bias, a, b, c, d, ref_state, meta)
    got = cpu_recurrent.mamba2_scan(x, dt, dt_bias, a, b, c, d, state, *meta.kernel_tensors())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


def test_model_functions_run_the_kernels_on_fp32_cpu_tensors_and_the_reference_elsewhere():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), rec.StateMetadata.build(slots, fresh, lens)
    states, direct = _states(), _states()
    got = _run(rec.causal_conv1d, rec.gated_delta_rule, rec.mamba2_scan, a, meta, states)
    want = _kernel(a, meta, direct) if HAVE_KERNEL else _ref(a, meta, direct)
    assert all(torch.equal(x, y) for x, y in zip((*got, *states), (*want, *direct)))
    # bf16 (not a layout the C kernels take): the reference, bit for bit
    half = {key: value.to(torch.bfloat16) for key, value in a.items()} | {"g": a["g"], "A": a["A"]}
    conv, ssm, mamba = _states()
    states = (conv.to(torch.bfloat16), ssm, mamba)
    ref_states = _clone(states)
    got = _run(rec.causal_conv1d, rec.gated_delta_rule, rec.mamba2_scan, half, meta, states)
    ref = _ref(half, meta, ref_states)
    assert all(torch.equal(x, y) for x, y in zip((*got, *states), (*ref, *ref_states)))
    assert got[1].dtype == got[2].dtype == torch.bfloat16


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_layouts_the_kernels_do_not_take_are_left_to_the_reference():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), rec.StateMetadata.build(slots, fresh, lens)
    conv, ssm, mamba = _states()
    s, f, q = meta.kernel_tensors()
    assert cpu_recurrent.causal_conv1d(a["x"].t().contiguous().t(), a["weight"], None, conv, s, f, q) is None
    assert cpu_recurrent.causal_conv1d(a["x"], a["weight"], None, conv.transpose(1, 2).contiguous(), s, f, q) is None
    assert cpu_recurrent.causal_conv1d(a["x"].double(), a["weight"], None, conv, s, f, q) is None
    assert cpu_recurrent.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm.transpose(2, 3), s, f, q) \
        is None
    assert cpu_recurrent.gated_delta_rule(a["q"], a["k"], a["v"][:, :5], a["g"][:, :5], a["beta"][:, :5],
                                          ssm[:, :5].contiguous(), s, f, q) is None  # 5 value heads for 2 q/k heads
    assert cpu_recurrent.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm, s.int(), f, q) is None
    xs, dt, dt_bias, A, B, Cm, D = _scan_args(a)
    assert cpu_recurrent.mamba2_scan(xs, dt, dt_bias, A, B, Cm, D, mamba.transpose(2, 3), s, f, q) is None
    assert cpu_recurrent.mamba2_scan(xs.transpose(1, 2), dt, dt_bias, A, B, Cm, D, mamba, s, f, q) is None
    assert cpu_recurrent.mamba2_scan(xs[:, :5], dt[:, :5], dt_bias[:5], A[:5], B, Cm, D[:5],
                                     mamba[:, :5].contiguous(), s, f, q) is None  # 5 heads for 2 groups
    assert cpu_recurrent.mamba2_scan(xs, dt, dt_bias, A.double(), B, Cm, D, mamba, s, f, q) is None


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_a_slot_outside_the_pool_or_offsets_outside_the_batch_are_refused():
    a = _batch([3, 1])
    conv, ssm, mamba = _states()
    for slots, lens in (([0, NUM_SLOTS], [3, 1]), ([0, -1], [3, 1]), ([0, 1], [3, 2])):
        meta = rec.StateMetadata.build(slots, [False, False], lens)
        with pytest.raises(IndexError):
            cpu_recurrent.causal_conv1d(a["x"], a["weight"], None, conv, *meta.kernel_tensors())
        with pytest.raises(IndexError):
            cpu_recurrent.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], ssm, *meta.kernel_tensors())
        with pytest.raises(IndexError):
            cpu_recurrent.mamba2_scan(*_scan_args(a), mamba, *meta.kernel_tensors())


@pytest.mark.skipif(HAVE_KERNEL, reason="the compiled kernels are available")
def test_without_a_compiler_the_kernels_decline():
    lens, fresh, slots = BATCHES["mixed"]
    a, meta = _batch(lens), rec.StateMetadata.build(slots, fresh, lens)
    assert _kernel(a, meta, _states()) == (None, None, None)
