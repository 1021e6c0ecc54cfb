"""The rejection sampler keeps the target distribution exactly; greedy verification, prompt lookup and the policy.

Distribution tests: N independent speculative runs through the vectorized sampler, then a chi-square goodness-of-fit
test of the emitted tokens against the target probabilities at significance 0.001 (a correct sampler fails one
such check once in a thousand runs; the seeds are fixed, so the outcome is deterministic). Tokens the target gives
zero probability must never appear at all.
"""

from __future__ import annotations

import pytest
import torch

from llmd.engine.rejection import greedy_verify, rejection_sample, row_distributions
from llmd.engine.spec_ngram import ngram_propose
from llmd.engine.spec_policy import Acceptance, SpecPolicy, expected_tokens
from llmd.engine.types import SamplingParams

SIGNIFICANCE = 1e-3
N = 200_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs (categories with zero probability must have zero counts)."""
    assert counts[probs == 0].sum() == 0, f"tokens with zero target probability were emitted: {counts.tolist()}"
    keep = probs > 0
    total = counts.sum().double()
    expected = probs[keep].double() * total
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


# (target rows p0, p1, p2), (draft rows q0, q1): adversarial pairs
CASES = {
    # draft puts mass where the target has none, and misses most of the target's support
    "draft_mass_outside_target": ((dist(5, 3, 2, 0, 0, 0), dist(0, 1, 1, 1, 1, 0), dist(1, 1, 1, 1, 1, 1)),
                                  (dist(0, 0, 1, 3, 3, 3), dist(4, 0, 0, 0, 0, 6))),
    # the reverse: the target spreads over tokens the draft never proposes
    "target_mass_outside_draft": ((dist(1, 1, 2, 2, 2, 2), dist(0, 0, 0, 0, 1, 9), dist(3, 0, 0, 0, 0, 1)),
                                  (dist(7, 3, 0, 0, 0, 0), dist(1, 0, 0, 0, 0, 0))),
    # near-identical distributions (acceptance close to one)
    "close": ((dist(4, 3, 2, 1, 0, 0), dist(1, 2, 3, 4, 5, 6), dist(1, 1, 1, 1, 1, 1)),
              (dist(4, 3, 2, 1.2, 0, 0), dist(1, 2, 3, 4, 5, 5))),
}


def run_sampler(target_rows, draft_rows, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.stack(target_rows).unsqueeze(0).expand(N, -1, -1).contiguous()
    q = torch.stack(draft_rows).unsqueeze(0).expand(N, -1, -1).contiguous()
    drafted = torch.stack([torch.multinomial(row, N, replacement=True, generator=g) for row in draft_rows], dim=1)
    num, tokens = rejection_sample(p, q, drafted, g)
    return num, tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_sampling_matches_target_distribution(case):
    target_rows, draft_rows = CASES[case]
    num, tokens = run_sampler(target_rows, draft_rows, seed=1234)
    vocab = target_rows[0].numel()
    # First emitted token: always present, distributed as p0.
    first = torch.bincount(tokens[:, 0], minlength=vocab)
    assert chi_square_p_value(first, target_rows[0]) > SIGNIFICANCE
    # Given the first proposal was accepted, the second emitted token is distributed as p1 (rows do not depend on
    # context here), and likewise the third given two acceptances (the bonus token when k = 2).
    for pos in (1, 2):
        mask = num >= pos
        if mask.sum() < 1000:
            continue
        counts = torch.bincount(tokens[mask, pos], minlength=vocab)
        assert chi_square_p_value(counts, target_rows[pos]) > SIGNIFICANCE
    # Structure: exactly num + 1 tokens, then padding.
    lengths = (tokens >= 0).sum(1)
    assert torch.equal(lengths, num + 1)


@pytest.mark.parametrize("proposed", [0, 3])  # token 3 has zero target probability at position 0
def test_point_mass_proposals_keep_the_distribution(proposed):
    target_rows = (dist(5, 3, 2, 0, 0, 0), dist(1, 1, 1, 1, 1, 1))
    g = torch.Generator().manual_seed(7)
    p = torch.stack(target_rows).unsqueeze(0).expand(N, -1, -1).contiguous()
    drafted = torch.full((N, 1), proposed, dtype=torch.long)
    num, tokens = rejection_sample(p, None, drafted, g)
    first = torch.bincount(tokens[:, 0], minlength=6)
    assert chi_square_p_value(first, target_rows[0]) > SIGNIFICANCE
    acceptance = num.float().mean().item()
    assert abs(acceptance - float(target_rows[0][proposed])) < 0.01  # point mass: accepted with p(x)


def test_the_chi_square_check_can_fail():
    """Guard against a vacuous test: a biased sampler (always accept the draft) is caught."""
    target_rows, draft_rows = CASES["target_mass_outside_draft"]
    g = torch.Generator().manual_seed(3)
    drafted = torch.multinomial(draft_rows[0], N, replacement=True, generator=g)
    counts = torch.bincount(drafted, minlength=6)
    p = target_rows[0].clone()
    assert chi_square_p_value(counts, p + (p == 0) * 1e-9) < SIGNIFICANCE


def test_seeded_rejection_sampling_is_reproducible():
    target_rows, draft_rows = CASES["close"]
    a = run_sampler(target_rows, draft_rows, seed=99)
    b = run_sampler(target_rows, draft_rows, seed=99)
    assert torch.equal(a[1], b[1])


def test_greedy_verify_accepts_the_longest_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([2, 5, 7, 1]):
        logits[row, best] = 3.0
    assert greedy_verify(logits, [2, 5, 7]) == (3, [2, 5, 7, 1])  # all accepted, bonus token
    assert greedy_verify(logits, [2, 4, 7]) == (1, [2, 5])  # correction at the first mismatch
    assert greedy_verify(logits, [9, 5, 7]) == (0, [2])


def test_row_distributions_apply_penalties_along_the_proposal():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    out = row_distributions(logits, params, prompt_ids=[2], output_ids=[], proposal=[0])
    # row 0 sees no output, row 1 sees token 0 (penalised to 0.5, below token 1)
    assert torch.argmax(out[0]) == 0 and torch.argmax(out[1]) == 1
    sampled = row_distributions(logits, SamplingParams(temperature=0.5, top_k=1), [2], [], [0])
    assert torch.allclose(sampled.sum(-1), torch.ones(2)) and sampled[0, 0] == 1.0


def test_ngram_proposes_the_continuation_of_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(tokens, 3) == [7, 8, 1]  # the latest earlier "1 2 3" is followed by 7 8
    assert ngram_propose([5, 6, 7, 8], 3) == []
    assert ngram_propose([1, 2, 1, 2], 5) == [1, 2]  # the continuation may run to the end of the list
    assert ngram_propose(tokens, 0) == []


def test_policy_backs_off_under_load_and_low_acceptance():
    policy = SpecPolicy(k_max=4, max_batch=8, verify_cost=0.1)
    good, bad = Acceptance(9, 10), Acceptance(0.5, 10)
    assert policy.choose_k(good, 1, False) == 4
    assert policy.choose_k(good, 16, False) == 0  # busy batch
    assert policy.choose_k(bad, 1, False) == 0
    probes = [policy.choose_k(bad, 1, False) for _ in range(20)]
    assert 1 in probes  # a low-acceptance request is probed now and then
    assert SpecPolicy(k_max=3, adaptive=False).choose_k(bad, 64, False) == 3  # forced on
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    acc = Acceptance(0, 0)
    acc.update(4, 1)  # accepted 1, rejected the 2nd: two trials
    assert acc.rate == pytest.approx(0.5)
