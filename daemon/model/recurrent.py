"""Recurrent layers' state: the second cache beside the paged KV (Qwen3.5's Gated DeltaNet, Mamba2 hybrids).

A recurrent layer keeps a fixed-size state per sequence instead of a growing KV cache: the last K-1 inputs of its
short causal convolution (`conv`, [slots, channels, K-1] in the model's dtype) and its recurrent state (`ssm`, fp32:
[slots, heads, key_dim, value_dim] for the gated delta rule, [slots, heads, head_dim, state_size] for Mamba2). The
engine gives every running sequence one slot of a pool (llmd.engine.state_pool) and every step's metadata says which
slot each sequence of the flattened batch reads and writes (`StateMetadata.slots`) and which sequences start from a
zero state (their first chunk: `fresh`). A layer's forward is then `mixer(x, state, meta)`: it reads the slot's
state, runs the sequence's new tokens (a prefill chunk, a decode token, or a verified proposal), and writes the state
after the last of them back into the slot. The last slot of every pool is scratch: padding rows write there.

`causal_conv1d`, `gated_delta_rule` and `mamba2_scan` run, by the device and dtype of their inputs: on the CPU in
fp32, the C kernels of llmd.kernels.cpu_recurrent (where the compiled library loads, as llmd.model.ops picks the C
ops); on CUDA, the Triton kernels of llmd.kernels.recurrent_triton; else, or where a kernel does not take the tensors'
layout, the torch reference, kept under its own name (`causal_conv1d_ref`, `gated_delta_rule_ref`, `mamba2_scan_ref`:
one sequence at a time for a chunk, every decode of the step at once). The kernels compute the reference's function
(tests/test_kernels_cpu_recurrent.py, tests/test_kernels_recurrent_triton.py), each sequence by itself: its results
do not depend on the rest of the batch. Mamba2's gated norm is torch code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import cpu_recurrent


@dataclass
class RecurrentState:
    """One recurrent layer's cache: the conv inputs and the recurrent state of every slot."""

    conv: torch.Tensor  # [slots, channels, K - 1]
    ssm: torch.Tensor  # [slots, heads, ...] fp32


@dataclass
class StateMetadata:
    """Which state slot each of the step's B sequences uses (the order of AttentionMetadata's sequences)."""

    slots: torch.Tensor  # [B] long
    slots_list: list[int]
    fresh_list: list[bool]  # True: the sequence's first chunk, it starts from a zero state
    query_start_list: list[int]  # [B + 1] offsets of each sequence's new tokens in the flat batch
    # the kernels' copies of fresh_list (bool) and query_start_list (long), on the slots' device (made on first use
    # when not given)
    fresh: torch.Tensor | None = field(default=None, repr=False, compare=False)
    query_start: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, slots: list[int], fresh: list[bool], query_lens: list[int],
              device: torch.device | str = "cpu") -> "StateMetadata":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = cls(torch.tensor(slots, dtype=torch.long, device=device), list(slots), list(fresh), starts)
        meta.kernel_tensors()
        return meta

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, fresh, query_start) as tensors on the slots' device, for the kernels."""
        if self.fresh is None or self.query_start is None:
            device = self.slots.device
            self.fresh = torch.tensor(self.fresh_list, dtype=torch.bool, device=device)
            self.query_start = torch.tensor(self.query_start_list, dtype=torch.long, device=device)
        return self.slots, self.fresh, self.query_start

    @property
    def is_decode_only(self) -> bool:
        q = self.query_start_list
        return all(q[i + 1] - q[i] == 1 for i in range(len(q) - 1))

    @property
    def max_query_len(self) -> int:
        q = self.query_start_list
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the gated delta rule's q/k normalisation)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _initial(state: torch.Tensor, slot: int, fresh: bool) -> torch.Tensor:
    return torch.zeros_like(state[slot]) if fresh else state[slot]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  meta: StateMetadata, silu: bool = True) -> torch.Tensor:
    """causal_conv1d_ref's function, by the kernel for x's device and dtype where one takes the tensors."""
    out = None
    if x.is_cuda:
        from ..kernels import recurrent_triton
        if recurrent_triton.available():
            out = recurrent_triton.causal_conv1d(x, weight, bias, conv_state, *meta.kernel_tensors(), silu=silu,
                                                 max_len=meta.max_query_len)
    elif x.dtype is torch.float32:
        out = cpu_recurrent.causal_conv1d(x, weight, bias, conv_state, *meta.kernel_tensors(), silu=silu)
    return out if out is not None else causal_conv1d_ref(x, weight, bias, conv_state, meta, silu)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """gated_delta_rule_ref's function, by the kernel for the inputs' device and dtype where one takes the tensors."""
    out = None
    if v.is_cuda:
        from ..kernels import recurrent_triton
        if recurrent_triton.available():
            out = recurrent_triton.gated_delta_rule(q, k, v, g, beta, state, *meta.kernel_tensors(),
                                                    max_len=meta.max_query_len)
    elif v.dtype is torch.float32:
        out = cpu_recurrent.gated_delta_rule(q, k, v, g, beta, state, *meta.kernel_tensors())
    return out if out is not None else gated_delta_rule_ref(q, k, v, g, beta, state, meta)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      meta: StateMetadata, silu: bool = True) -> torch.Tensor:
    """Depthwise causal convolution of x [T, C] with weight [C, K] over each sequence's tokens, the K-1 inputs
    before them read from (and the last K-1 written back to) conv_state [slots, C, K-1]; then SiLU."""
    k = weight.shape[1]
    out = torch.empty_like(x)
    q = meta.query_start_list
    for b, (slot, fresh) in enumerate(zip(meta.slots_list, meta.fresh_list)):
        xs = x[q[b] : q[b + 1]].t()  # [C, n]
        window = torch.cat((_initial(conv_state, slot, fresh).to(xs.dtype), xs), dim=1)  # [C, K - 1 + n]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(xs.dtype), bias, groups=weight.shape[0])[0]
        conv_state[slot] = window[:, window.shape[1] - (k - 1) :]
        out[q[b] : q[b + 1]] = y.t()
    return F.silu(out) if silu else out


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The gated delta rule over each sequence's new tokens, token by token in fp32, as Qwen3.5 / Qwen3-Next define
    it: with q, k L2-normalised and q scaled by key_dim^-0.5, for each token
        S <- S * exp(g);  S <- S + k (beta * (v - S^T k))^T;  o = S^T q
    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (each q/k head serves Hv / Hk consecutive value heads); g (log decay, <= 0) and
    beta: [T, Hv]; state: [slots, Hv, Dk, Dv] fp32, read and written at each sequence's slot. Returns [T, Hv, Dv] in
    v's dtype."""
    hv, dk = v.shape[1], q.shape[2]
    rep = hv // q.shape[1]
    qf = l2norm(q.float()).repeat_interleave(rep, dim=1) * dk ** -0.5
    kf = l2norm(k.float()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float().exp(), beta.float()
    out = torch.empty_like(vf)
    if meta.is_decode_only:  # one token per sequence: every sequence at once
        s = torch.where(torch.tensor(meta.fresh_list, device=state.device)[:, None, None, None],
                        torch.zeros((), device=state.device), state[meta.slots])
        out = _delta_step(s, qf, kf, vf, gf, bf)
        state[meta.slots] = s
        return out.to(v.dtype)
    qs = meta.query_start_list
    for b, (slot, fresh) in enumerate(zip(meta.slots_list, meta.fresh_list)):
        s = _initial(state, slot, fresh).clone()
        for t in range(qs[b], qs[b + 1]):
            rows = slice(t, t + 1)
            out[rows] = _delta_step(s.unsqueeze(0), qf[rows], kf[rows], vf[rows], gf[rows], bf[rows])
        state[slot] = s
    return out.to(v.dtype)


def _delta_step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One token for each of the N rows of s [N, H, Dk, Dv], updated in place. Returns o [N, H, Dv]."""
    s.mul_(decay[:, :, None, None])
    memory = (s * k.unsqueeze(-1)).sum(dim=-2)  # S^T k: [N, H, Dv]
    delta = (v - memory) * beta.unsqueeze(-1)
    s.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (s * q.unsqueeze(-1)).sum(dim=-2)


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, meta: StateMetadata,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """mamba2_scan_ref's function, by the kernel for the inputs' device and dtype where one takes the tensors."""
    out = None
    if x.is_cuda:
        from ..kernels import recurrent_triton
        if recurrent_triton.available():
            out = recurrent_triton.mamba2_scan(x, dt, dt_bias, A, B, C, D, state, *meta.kernel_tensors(),
                                               dt_limit=dt_limit, max_len=meta.max_query_len)
    elif x.dtype is torch.float32:
        out = cpu_recurrent.mamba2_scan(x, dt, dt_bias, A, B, C, D, state, *meta.kernel_tensors(), dt_limit=dt_limit)
    return out if out is not None else mamba2_scan_ref(x, dt, dt_bias, A, B, C, D, state, meta, dt_limit)


def mamba2_scan_ref(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, meta: StateMetadata,
                    dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """The Mamba2 selective scan over each sequence's new tokens, token by token in fp32, as Granite 4 and Nemotron-H
    define it: with dt = clamp(softplus(dt + dt_bias), *dt_limit), for each token and head h
        S <- S * exp(dt A);  S <- S + dt x B^T;  y = S C + D x
    x: [T, H, P]; dt: [T, H] (before the bias); dt_bias, A (negative, -exp(A_log)), D: [H]; B, C: [T, G, N], group g
    serving the H / G consecutive heads g * H / G ...; state: [slots, H, P, N] fp32, read and written at each
    sequence's slot. Returns y [T, H, P] in x's dtype (the gated norm after it is the caller's).

    transformers clamps dt to time_step_limit in its chunked prefill only, not in its one-token decode; both
    families' limit is (0, inf) by default, where the clamp changes nothing. Here it applies to every token."""
    heads = x.shape[1]
    rep = heads // B.shape[1]
    xf = x.float()
    dtf = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])  # [T, H]
    decay = (dtf * A.float()).exp()
    bf = B.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    cf = C.float().repeat_interleave(rep, dim=1)
    skip = D.float()[:, None] * xf  # [T, H, P]
    if meta.is_decode_only:  # one token per sequence: every sequence at once
        s = torch.where(torch.tensor(meta.fresh_list, device=state.device)[:, None, None, None],
                        torch.zeros((), device=state.device), state[meta.slots])
        out = _mamba2_step(s, xf, dtf, decay, bf, cf)
        state[meta.slots] = s
        return (out + skip).to(x.dtype)
    out = torch.empty_like(xf)
    qs = meta.query_start_list
    for b, (slot, fresh) in enumerate(zip(meta.slots_list, meta.fresh_list)):
        s = _initial(state, slot, fresh).clone().unsqueeze(0)
        for t in range(qs[b], qs[b + 1]):
            rows = slice(t, t + 1)
            out[rows] = _mamba2_step(s, xf[rows], dtf[rows], decay[rows], bf[rows], cf[rows])
        state[slot] = s[0]
    return (out + skip).to(x.dtype)


def _mamba2_step(s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor) -> torch.Tensor:
    """One token for each of the N rows of s [N, H, P, Ns], updated in place. Returns S C [N, H, P]."""
    s.mul_(decay[:, :, None, None])
    s.add_((dt[:, :, None] * x).unsqueeze(-1) * b.unsqueeze(-2))
    return (s * c.unsqueeze(-2)).sum(dim=-1)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                           eps: float) -> torch.Tensor:
    """Mamba2's gated RMSNorm: h = y * silu(z) in fp32, each of `groups` equal slices of the channels normalised by
    its own RMS, cast to y's dtype, times weight. y, z: [T, channels]; weight: [channels]."""
    h = y.float() * F.silu(z.float())
    g = h.view(h.shape[0], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(y.dtype)


def state_bytes_per_sequence(config, dtype: torch.dtype) -> int:
    """One sequence's state over every recurrent layer: its conv inputs (model dtype) and recurrent state (fp32)."""
    r = config.recurrent
    if r is None:
        return 0
    layers = sum(config.is_recurrent(i) for i in range(config.num_hidden_layers))
    conv = r.conv_channels * (r.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
    ssm = 4
    for n in r.state_shape:
        ssm *= n
    return layers * (conv + ssm)


def allocate_states(config, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> dict[int, RecurrentState]:
    """Zeroed state for `num_slots` slots of every recurrent layer, by layer index."""
    r = config.recurrent
    out = {}
    for i in range(config.num_hidden_layers):
        if config.is_recurrent(i):
            out[i] = RecurrentState(
                torch.zeros(num_slots, r.conv_channels, r.conv_kernel - 1, dtype=dtype, device=device),
                torch.zeros(num_slots, *r.state_shape, dtype=torch.float32, device=device))
    return out


def layer_caches(config, kv_caches: dict[int, Any], states: dict[int, RecurrentState]) -> list:
    """Per layer, what its forward reads: its state for a recurrent layer, None for a layer that keeps nothing
    (Nemotron-H's MLP-only layers), else the KV cache of the layer whose K/V it attends over (its own, or the one it
    shares: config.kv_source); kv_caches by KV-holding layer index."""
    return [states[i] if i in states else None if config.is_mixerless(i) else kv_caches[config.kv_source(i)]
            for i in range(config.num_hidden_layers)]
