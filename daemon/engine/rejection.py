"""Verification of speculative proposals: which proposed tokens the target accepts, and the token that follows.

Greedy requests accept the longest prefix of the proposal that equals the target's argmax at each position, then
take the target's own argmax (a correction, or the bonus token when all k were accepted): the output is exactly
what plain greedy decoding would produce.

Sampled requests use modified rejection sampling (Leviathan et al. / Chen et al.): proposal x_j, drawn from the
draft distribution q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token
is redrawn from norm(max(p_j - q_j, 0)); when all k are accepted one bonus token is drawn from p_k. Every emitted
token is then distributed exactly as p. A proposer without probabilities (prompt lookup) is a point mass on its
token, so acceptance is p_j(x_j) and the residual is p_j with x_j removed.

Both p and q must already carry the request's penalties, temperature and top-k/p/min-p (see `row_distributions`).
"""

from __future__ import annotations

import torch

from ..model.ops import greedy_tokens
from .sampler import SampleRequest, needs_penalties, apply_penalties, warp
from .types import SamplingParams


def row_distributions(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                      proposal: list[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """Process logits rows [n, V] exactly as the plain sampler would at each position of a speculative run.

    Row j sees the output so far plus proposal[:j] (penalties depend on it). Returns penalised logits for greedy
    requests and warped probabilities otherwise.
    """
    rows = []
    penalties = needs_penalties(params)
    for j in range(logits.shape[0]):
        row = logits[j].float()
        if penalties:
            row = apply_penalties(row, SampleRequest(params, prompt_ids, output_ids + proposal[:j], generator))
        rows.append(row if params.greedy else warp(row, params))
    return torch.stack(rows)


def greedy_verify(target_logits: torch.Tensor, proposal: list[int]) -> tuple[int, list[int]]:
    """target_logits [k+1, V] (penalised). Returns (accepted count, emitted tokens = accepted + one more)."""
    best = greedy_tokens(target_logits).tolist()
    a = 0
    while a < len(proposal) and proposal[a] == best[a]:
        a += 1
    return a, proposal[:a] + [best[a]]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched modified rejection sampling over N independent speculative runs.

    target_probs [N, k+1, V]; draft_probs [N, k, V] or None (point-mass proposals); draft_tokens [N, k] long.
    Returns num_accepted [N] and tokens [N, k+1]: the accepted proposals, then the recovered or bonus token, then
    -1 padding.
    """
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    p = target_probs[:, :k, :]
    p_x = p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
        q_x = torch.ones_like(p_x)
    else:
        q = draft_probs
        q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    u = torch.rand((n, k), generator=generator, device=device, dtype=p.dtype)
    accept = u * q_x < p_x  # u < p/q without dividing; p == 0 never accepts
    num_accepted = torch.cumprod(accept.to(torch.long), dim=-1).sum(-1) if k else torch.zeros(n, dtype=torch.long)

    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual, but then a rejection cannot happen; fall back to p to stay well defined.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    # Draw a candidate at every position (only the one at the first rejection is used): one vectorized draw.
    last = torch.cat([residual, target_probs[:, k:, :]], dim=1).reshape(n * k1, vocab)
    candidates = torch.multinomial(last, 1, generator=generator).view(n, k1)

    positions = torch.arange(k1, device=device).unsqueeze(0)
    tokens = torch.full((n, k1), -1, dtype=torch.long, device=device)
    if k:
        keep = positions[:, :k] < num_accepted.unsqueeze(1)
        tokens[:, :k] = torch.where(keep, draft_tokens, tokens[:, :k])
    tokens.scatter_(1, num_accepted.unsqueeze(1), candidates.gather(1, num_accepted.unsqueeze(1)))
    return num_accepted, tokens
