"""Token sampling for one step's batch of logits rows.

Per row, in this order: repetition penalty (HF style: positive logits divided, negative multiplied, over prompt and
output tokens), presence and frequency penalties (OpenAI style, over output tokens), then greedy argmax when
temperature is 0; otherwise temperature, top-k, top-p (smallest set whose mass reaches p), min-p (drop tokens whose
probability is below min_p times the top probability), and a draw from the request's own torch.Generator, so a
seeded request gets the same tokens whatever else is in the batch. Logprobs are those of the model's raw
distribution (before penalties and warping), like vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.ops import greedy_tokens
from .types import SamplingParams, TokenLogprob


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None


def needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """Penalised copy of one row of logits [V]."""
    p = req.params
    logits = logits.clone()
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.long,
                            device=device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=logits.numel())[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k, top-p and min-p (temperature must be > 0)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep a token if the mass before it is still below top_p (the top token is always kept)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, req: SampleRequest) -> int:
    p = req.params
    if needs_penalties(p):
        logits = apply_penalties(logits, req)
    if p.greedy:
        return int(greedy_tokens(logits))
    probs = warp(logits.float(), p)
    return int(torch.multinomial(probs, 1, generator=req.generator))


def top_logprobs(logprobs_row: torch.Tensor, token_id: int, n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs_row[token_id]), top=top)
