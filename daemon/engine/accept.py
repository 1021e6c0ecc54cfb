"""One acceptance path for every sampled row of a step: a plain decode is a proposal of k = 0.

A sequence that samples this step owns 1 + k consecutive logits rows (k = len(proposal)). `accept` turns them into
the run of tokens the sequence emits: the accepted prefix of the proposal plus one more token (the correction, or
the bonus after a fully accepted proposal; the sampled token when k = 0). Per row group:
  - greedy without penalties: from one batched argmax over all rows (the common case costs one op per step);
  - k = 0 otherwise: `sample_row` (penalties, temperature, top-k/p, min-p, the request's generator);
  - k > 0 otherwise: rows processed as the plain sampler would (`row_distributions`), then `greedy_verify` or
    modified rejection sampling (rejection.py), so every emitted token is distributed exactly as plain decoding's.
Logprobs, when asked, are those of the raw rows (before penalties, warping and grammar masks), like the sampler's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model.ops import greedy_tokens
from .rejection import greedy_verify, rejection_sample, row_distributions
from .sampler import SampleRequest, needs_penalties, sample_row, top_logprobs
from .types import TokenLogprob

if TYPE_CHECKING:
    from .grammar import RowMasks


def accept(logits: torch.Tensor, reqs: list[SampleRequest], proposals: list[list[int]],
           draft_probs: list[torch.Tensor | None] | None = None, masks: RowMasks | None = None
           ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """logits [sum(1 + k_i), V] fp32, the rows of reqs[i] in order; proposals[i] holds its k_i tokens.

    masks: grammar masks for some rows (engine/grammar.py), applied to `logits` in place after the raw logprobs are
    taken. Returns per request the emitted run and, when it asked for logprobs, one TokenLogprob per token of it."""
    draft_probs = draft_probs or [None] * len(reqs)
    starts = _row_starts(proposals)
    raw: dict[int, torch.Tensor] = {}
    for i, r in enumerate(reqs):
        if r.params.logprobs is not None:
            raw[i] = torch.log_softmax(logits[starts[i] : starts[i] + len(proposals[i]) + 1].float(), dim=-1)
    if masks is not None:
        masks.apply(logits)
    fast = [r.params.greedy and not needs_penalties(r.params) for r in reqs]
    best = greedy_tokens(logits).tolist() if any(fast) else None
    runs: list[list[int]] = []
    for req, proposal, probs, is_fast, row in zip(reqs, proposals, draft_probs, fast, starts):
        k = len(proposal)
        if is_fast:
            picks = best[row : row + k + 1]
            a = 0
            while a < k and proposal[a] == picks[a]:
                a += 1
            run = proposal[:a] + [picks[a]]
        elif k == 0:
            run = [sample_row(logits[row], req)]
        else:
            run = _verify(logits[row : row + k + 1], req, proposal, probs)
        runs.append(run)
    logprobs: list[list[TokenLogprob] | None] = [None] * len(reqs)
    for i, lp in raw.items():
        n = reqs[i].params.logprobs
        logprobs[i] = [top_logprobs(lp[j], token, n) for j, token in enumerate(runs[i])]
    return runs, logprobs


def _row_starts(proposals: list[list[int]]) -> list[int]:
    starts, row = [], 0
    for p in proposals:
        starts.append(row)
        row += len(p) + 1
    return starts


def _verify(rows: torch.Tensor, req: SampleRequest, proposal: list[int], draft_probs: torch.Tensor | None
            ) -> list[int]:
    params = req.params
    dist = row_distributions(rows, params, req.prompt_token_ids, list(req.output_token_ids), proposal,
                             req.generator)
    if params.greedy:
        return greedy_verify(dist, proposal)[1]
    drafted = torch.tensor([proposal], dtype=torch.long, device=rows.device)
    q = None if draft_probs is None else draft_probs.unsqueeze(0).to(dist.dtype)
    num, tokens = rejection_sample(dist.unsqueeze(0), q, drafted, req.generator)
    return tokens[0, : int(num[0]) + 1].tolist()
