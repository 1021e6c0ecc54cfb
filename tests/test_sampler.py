"""Sampler and stop-string units against small hand-computed cases."""

import math

import pytest
import torch

from llmd.engine.accept import accept
from llmd.engine.sampler import SampleRequest, apply_penalties, warp
from llmd.engine.stop import StopStringMatcher
from llmd.engine.types import SamplingParams
from llmd.errors import InvalidRequest


def req(prompt=(), output=(), seed=None, **kw):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SampleRequest(SamplingParams(**kw).validate(), list(prompt), list(output), gen)


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = apply_penalties(logits, req(prompt=[0], output=[1], repetition_penalty=2.0))
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = apply_penalties(logits, req(prompt=[3, 3], output=[0, 0, 0, 2], presence_penalty=0.5,
                                      frequency_penalty=0.25))
    # token 0: 1 - 3*0.25 - 0.5 = -0.25; token 2: 1 - 0.25 - 0.5 = 0.25; prompt-only token 3 untouched
    assert out.tolist() == pytest.approx([-0.25, 1.0, 0.25, 1.0])


def test_min_p_keeps_tokens_above_fraction_of_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = warp(probs.log(), SamplingParams(temperature=1.0, min_p=0.4))  # threshold 0.2
    assert p.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def sample(logits, reqs):
    """One token per row: the engine's acceptance path with empty proposals (a plain decode)."""
    runs, lps = accept(logits, reqs, [[] for _ in reqs])
    return [run[0] for run in runs], [lp[0] if lp else None for lp in lps]


def test_top_p_and_top_k():
    logp = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    p = warp(logp, SamplingParams(temperature=1.0, top_p=0.65))  # 0.4 < 0.65, 0.7 >= 0.65 -> keep two
    assert p.tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0])
    p = warp(logp, SamplingParams(temperature=1.0, top_k=3))
    assert p.tolist() == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0])


def test_temperature_sharpens():
    logp = torch.tensor([0.6, 0.4]).log()
    p = warp(logp, SamplingParams(temperature=0.5))
    assert p[0].item() == pytest.approx(0.36 / 0.52)


def test_greedy_with_penalty_changes_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    tokens, _ = sample(logits, [req(output=[0], temperature=0, repetition_penalty=2.0)])
    assert tokens == [1]


def test_seeded_rows_do_not_depend_on_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = [sample(logits[1:2], [req(seed=7, temperature=1.0)])[0][0] for _ in range(1)]
    seq = []
    r = req(seed=7, temperature=1.0)
    for _ in range(5):
        seq.append(sample(logits[1:2], [r])[0][0])
    r2 = req(seed=7, temperature=1.0)
    batched = []
    for _ in range(5):
        toks, _ = sample(logits, [req(seed=1, temperature=1.0), r2, req(temperature=0)])
        batched.append(toks[1])
    assert seq == batched and alone[0] == seq[0]


def test_logprobs_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lps = sample(logits, [req(temperature=0, logprobs=2)])
    ref = torch.log_softmax(logits[0], -1)
    assert tokens == [1]
    assert lps[0].logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lps[0].top] == [1, 2]
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("max_tokens", 0),
    ("logprobs", 99),
])
def test_invalid_values_refused_with_field_name(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.field == field and field in str(e.value)


def test_stop_string_across_deltas_never_emitted():
    m = StopStringMatcher(["END"])
    emitted = []
    for piece in ["Hello E", "N", "D tail"]:
        text, hit = m.feed(piece)
        emitted.append(text)
        if hit:
            break
    assert "".join(emitted) == "Hello " and hit
    assert emitted[0] == "Hello ", "a possible stop-string start is held back"


def test_stop_string_false_start_is_released():
    m = StopStringMatcher(["END", "xyz"])
    a, hit1 = m.feed("EN")
    b, hit2 = m.feed("x!")
    assert (a, hit1, hit2) == ("", False, False) and a + b + m.flush() == "ENx!"
