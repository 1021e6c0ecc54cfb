"""The mixture-of-experts block every MoE family shares (Mixtral, Qwen2/3-MoE, GLM-4.5; gpt-oss, Gemma 4,
Qwen3.5-MoE and Nemotron-H reuse it): a router picks each token's top-k experts and their weights, the chosen experts'
MLPs run (SwiGLU and its kin, or Nemotron-H's ungated squared ReLU), and their outputs are summed by weight; an
optional shared expert runs on every token. Nemotron 3's latent experts take their input through fc1_latent_proj
(hidden -> MoEConfig.latent_size) and give their weighted sum back through fc2_latent_proj.

Experts are one [E, out, in] tensor per projection (`experts.gate_up_proj`, gate rows then up rows, or the up rows
alone for an ungated activation, and `experts.down_proj`), fp here or packed GGUF blocks
(llmd.model.quant.gguf_experts.GGUFExpertLinear): either way a projection answers `expert(e, x)`, x holding only
the rows routed to expert e. The step's (token, slot) pairs are grouped by expert, so each expert reads its weights
once per step whatever the number of tokens. Packed GGUF experts on the CPU in fp32 run the whole layer's experts as
one C call per step instead (llmd.kernels.cpu_moe, chosen once by Experts.prepare), with the Python grouping's very
bits. On CUDA where the Triton kernels load, they run as the fused kernel of llmd.kernels.moe_matmul (pairs sorted
by expert on the device, one grouped launch per projection, no host sync, so decode steps are captured in CUDA graphs;
equal to the grouping within rounding; not for Nemotron-H's squared ReLU yet, which keeps the grouping there). The
grouping stays the reference and the path elsewhere.

Exactness: a token's k expert outputs land in their slots and are summed in slot order (the router's order), never in
the order experts happen to run, and every expert kernel computes a row independently of the other rows; so a
token's output never depends on which other tokens share its step (batched == alone, bit for bit on the CPU).

Checkpoint names (CausalLM.route): per-expert tensors (`mlp.experts.7.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.7.w1.weight`) fill one expert's rows; stacked ones (a GGUF file's `ffn_gate_exps`, named
`mlp.experts.gate_proj.weight` here) fill every expert's; transformers 5's fused `mlp.experts.gate_up_proj` loads as
is. The per-expert names are the canonical parts (`expert_parts`), a stacked tensor `covers` all of them.
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, MoEConfig
from .linear import make_linear
from .ops import CPU_OPS, TORCH_OPS, Ops

log = logging.getLogger(__name__)

# checkpoint spellings of the MoE parts -> ours
_ALIASES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),
            (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
            (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
            (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
            (re.compile(r"\.mlp\.router\."), ".mlp.gate."),
            (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
            (re.compile(r"\.mlp\.gate\.e_score_correction[._]bias$"), ".mlp.gate.selection_bias"),
            (re.compile(r"\.experts\.(gate_up_proj|down_proj)$"), r".experts.\1.weight"),
            (re.compile(r"\.experts\.(gate_up_proj|down_proj)_bias$"), r".experts.\1.bias"))
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj)\.(weight|bias)$")


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in this module's spelling (Mixtral's w1/w2/w3, gpt-oss's router, ...)."""
    if ".experts." not in name and ".block_sparse_moe." not in name and ".mlp." not in name:
        return name
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


class Router(nn.Module):
    """Scores [T, E] -> each token's top-k experts (ids [T, k]) and their weights (fp32 [T, k]), as MoEConfig says.
    Computed in fp32 whatever the model's dtype, as transformers does for the routers that care."""

    def __init__(self, hidden: int, moe: MoEConfig, bias: bool = False):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if bias else None
        self.selection_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.selection_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        if moe.router == "softmax_topk":  # the top-k logits, then a softmax over those k
            top, ids = torch.topk(logits, moe.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        elif moe.router == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        else:  # sigmoid: chosen by score + selection bias within the best groups, weighted by the score alone
            scores = logits.sigmoid()
            choice = scores if self.selection_bias is None else scores + self.selection_bias.float()
            if moe.groups > 1:
                grouped = choice.view(-1, moe.groups, moe.num_experts // moe.groups)
                best = torch.topk(grouped.topk(2, dim=-1)[0].sum(-1), moe.groups_kept, dim=-1)[1]
                keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()
                choice = choice.masked_fill(~keep.repeat_interleave(moe.num_experts // moe.groups, dim=1),
                                            float("-inf"))
            ids = torch.topk(choice, moe.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if moe.renormalize and moe.router != "softmax_topk":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.router == "sigmoid" else 0.0))
        if moe.scaling != 1.0:
            weights = weights * moe.scaling
        return weights, ids


class ExpertLinear(nn.Module):
    """One projection of every expert in fp: `weight` [E, out, in] (+ `bias` [E, out])."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [m, in] -> [m, out] through expert e."""
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])

    def kernel_weights(self):
        """Every expert's weight as the fused kernel takes it (llmd.kernels.moe_matmul.ExpertWeights)."""
        from llmd.kernels.moe_matmul import ExpertWeights

        return ExpertWeights(((self.weight.detach(), None),), self.in_features,
                             None if self.bias is None else self.bias.detach())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}"


class Experts(nn.Module):
    """E gated MLPs: down(act(gate(x), up(x))), gate and up as one projection, act SiLU(gate) * up, GELU-tanh(gate) *
    up (Gemma 4) or gpt-oss's clamped SwiGLU (MoEConfig.activation; all ops of the bound table), each projection with
    or without biases; or E ungated ones, down(relu(up(x))^2) (Nemotron-H), gate_up_proj then holding up alone.

    `prepare` chooses once how `forward` runs them: on CUDA where the Triton kernels load, the fused kernel
    (`triton_kernel`: fp or packed experts, either activation, biases) for the weights it takes; one compiled C call per
    step (llmd.kernels.cpu_moe, through quant.gguf_experts.cpu_experts_kernel) where both projections are packed GGUF
    experts, on the CPU with fp32 activations, the C ops bound (the call's activation is theirs) and the library loads;
    else `grouped`, the grouping in Python, which is the reference the C call equals bit for bit."""

    ops: Ops = TORCH_OPS

    def __init__(self, hidden: int, moe: MoEConfig, bias: bool = False):
        super().__init__()
        self.num_experts, self.intermediate_size = moe.num_experts, moe.intermediate_size
        self.moe = moe
        self.gate_up_proj = ExpertLinear(moe.num_experts, hidden, moe.gate_up_rows, bias)
        self.down_proj = ExpertLinear(moe.num_experts, moe.intermediate_size, hidden, bias)
        # tokens routed to each expert (stats); on the CPU even while the model is built on the meta device
        self.hits = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")
        self.kernel: Callable[..., torch.Tensor] | None = None  # (x, ids, weights, hits) -> out, set by prepare
        self.kernel_for: tuple[str, torch.dtype] | None = None  # the (device type, dtype) it serves
        self.device_hits: torch.Tensor | None = None  # the Triton kernel's counts, kept on its device (no sync)
        self.prepared = False

    def _apply(self, fn, recurse=True):
        self.kernel, self.kernel_for, self.prepared = None, None, False  # a move drops the kernel (its weights)
        return super()._apply(fn, recurse)

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Choose the compiled path or the Python grouping for activations of `dtype` on `device` (see the class)."""
        import llmd.kernels as kernels

        from .quant.gguf_experts import cpu_experts_kernel

        device = torch.device(device)
        self.kernel = None
        if device.type == "cuda" and kernels.available():
            self.kernel = self.triton_kernel(device, dtype)
        elif self.ops is CPU_OPS:
            self.kernel = cpu_experts_kernel(self.gate_up_proj, self.down_proj, device, dtype, self.moe)
        self.kernel_for = (device.type, dtype) if self.kernel is not None else None
        self.prepared = True

    def triton_kernel(self, device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        """The fused Triton kernel over this block's weights (llmd.kernels.moe_matmul), or None, logged, where it
        cannot take them (a GGUF type it has no dequantizer for, fp weights of another dtype)."""
        from llmd.kernels import moe_matmul as mm

        gate_up, down = self.gate_up_proj.kernel_weights(), self.down_proj.kernel_weights()
        act = mm.Activation(self.moe.activation, self.moe.swiglu_alpha, self.moe.swiglu_limit)
        try:
            mm.check(gate_up, down, act, dtype, device)
        except ValueError as exc:
            log.info("mixture of experts on %s keeps the per-expert path: %s", device, exc)
            return None
        if self.device_hits is not None and self.device_hits.device != device:
            self.hits += self.device_hits.cpu()
            self.device_hits = None
        if self.device_hits is None:
            self.device_hits = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        hits = self.device_hits
        return lambda x, ids, weights, _hits=None: mm.moe_matmul(x, ids, weights, gate_up, down, act, hits)

    @property
    def graph_blocker(self) -> str | None:
        """Why a CUDA graph cannot capture this block (llmd.engine.cuda_graphs), None when it can."""
        return None if self.kernel is not None else \
            "a mixture of experts on its per-expert path reads its tokens' experts on the host"

    def hit_counts(self) -> list[int]:
        """Tokens routed to each expert so far (the Triton kernel's counts are read from its device here)."""
        hits = self.hits if self.device_hits is None else self.hits + self.device_hits.cpu()
        return hits.tolist()

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.moe.activation == "silu":
            return self.ops.silu_mul(gate_up, self.intermediate_size)
        if self.moe.activation == "gelu_tanh":  # Gemma 4
            return self.ops.gelu_mul(gate_up, self.intermediate_size)
        if self.moe.activation == "relu2":  # Nemotron-H: up alone (one rounding, as the C kernel's v * v)
            return F.relu(gate_up).square()
        return self.ops.swiglu_clamped_mul(gate_up, self.intermediate_size, self.moe.swiglu_alpha,
                                           self.moe.swiglu_limit)  # gpt-oss

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], each token's experts ids [T, k] and weights [T, k] -> [T, hidden]."""
        if not self.prepared:
            self.prepare(x.device, x.dtype)
        if self.kernel is not None and (x.device.type, x.dtype) == self.kernel_for:
            return self.kernel(x, ids, weights, self.hits)
        return self.grouped(x, ids, weights)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward with the (token, slot) pairs grouped by expert in Python, each expert hit run as its projections'
        own kernels: the reference of the compiled path, and the path everywhere else."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.hits += counts.cpu()
        slots = x.new_empty(t * k, x.shape[-1])
        token_of = order // k
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            pairs, tokens = order[start:start + n], token_of[start:start + n]
            start += n
            hidden = self.activation(self.gate_up_proj.expert(e, x[tokens]))
            slots[pairs] = self.down_proj.expert(e, hidden)
        slots = slots.view(t, k, -1)
        w = weights.to(x.dtype).unsqueeze(-1)
        out = slots[:, 0] * w[:, 0]
        for j in range(1, k):  # in slot order, whatever order the experts ran in
            out = out + slots[:, j] * w[:, j]
        return out


class SparseMoE(nn.Module):
    """The MoE block in place of a decoder layer's MLP: [T, hidden] -> [T, hidden]."""

    def __init__(self, config: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        moe = config.moe
        assert moe is not None
        hidden, latent = config.hidden_size, moe.latent_size
        self.gate = Router(hidden, moe, bias=moe.router_bias)
        self.experts = Experts(latent or hidden, moe, bias=config.mlp_bias or moe.expert_bias)
        self.shared_expert = shared  # an MLP every token takes (Qwen2-MoE, GLM-4.5), or None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if moe.shared_gate else None
        # Nemotron 3's latent experts: into the latent space before them, their weighted sum out of it after
        self.fc1_latent_proj = make_linear(hidden, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = make_linear(latent, hidden, bias=config.mlp_bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.fc1_latent_proj is None or self.fc2_latent_proj is None:
            out = self.experts(x, ids, weights)
        else:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), ids, weights))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def expert_parts(module: str, moe: MoEConfig) -> list[tuple[str, object]] | None:
    """The per-expert checkpoint projections that fill an experts' projection (`...experts.gate_up_proj` or
    `...experts.down_proj`), each with its index there; None for any other module."""
    parent, _, child = module.rpartition(".")
    if not parent.endswith(".experts") or child not in ("gate_up_proj", "down_proj"):
        return None
    if child == "down_proj":
        return [(f"{parent}.{e}.down_proj", e) for e in range(moe.num_experts)]
    return [(f"{parent}.{e}.{proj}", (e, rows)) for e in range(moe.num_experts)
            for proj, rows in _gate_up_rows(moe).items()]


def _gate_up_rows(moe: MoEConfig) -> dict[str, slice]:
    """The rows of gate_up_proj each checkpoint projection fills: gate then up, or (ungated) up alone."""
    inter = moe.intermediate_size
    if not moe.gated:
        return {"up_proj": slice(0, inter)}
    return {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}


def expert_route(name: str, moe: MoEConfig) -> tuple[str, object] | None:
    """Where an expert checkpoint tensor goes: (parameter, index), or None if it is not one that needs an index (or a
    gate the experts do not have)."""
    rows = _gate_up_rows(moe)
    m = _PER_EXPERT.match(name)
    if m:
        parent, e, proj, leaf = m.groups()
        if proj == "down_proj":
            return f"{parent}.down_proj.{leaf}", int(e)
        return (f"{parent}.gate_up_proj.{leaf}", (int(e), rows[proj])) if proj in rows else None
    m = _STACKED.match(name)
    if m:
        parent, proj, leaf = m.groups()
        return (f"{parent}.gate_up_proj.{leaf}", (slice(None), rows[proj])) if proj in rows else None
    return None


def stacked_covers(name: str, moe: MoEConfig) -> set[str] | None:
    """The per-expert names a stacked tensor (`...experts.gate_proj.weight`, all experts at once) stands for."""
    m = _STACKED.match(name)
    if not m or m.group(2) not in _gate_up_rows(moe):
        return None
    parent, proj, leaf = m.groups()
    return {f"{parent}.{e}.{proj}.{leaf}" for e in range(moe.num_experts)}


def moe_layers(model: nn.Module) -> list[Experts]:
    """The model's MoE layers' experts, in layer order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def expert_hits(model: nn.Module) -> list[list[int]]:
    """Tokens routed to each expert, per MoE layer, since the model loaded (for placement decisions and stats)."""
    return [m.hit_counts() for m in moe_layers(model)]
