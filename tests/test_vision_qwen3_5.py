"""Qwen3.5 images against transformers on a tiny random Qwen3_5ForConditionalGeneration (tests/tiny_qwen3_5_vl.py),
CPU fp32: the multimodal RoPE positions (llmd.engine.sequence.rope_positions) equal get_rope_index's; the engine's
greedy answer with an image's embeddings on its grid equals transformers' text model fed the same embeddings at its
3-D positions, whole or in prefill chunks that cut the image, after a prefix hit and after preemption.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams
from llmd.engine.sequence import rope_positions
from llmd.engine.types import ImageSpan
from llmd.model.loader import load_model
from test_engine import GREEDY
from tiny_qwen3_5_vl import write_tiny_qwen3_5_vl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_PAD = 5  # <|image_pad|> in the tiny vocabulary


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl") / "vl")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm(folder):
    return load_model(folder, dtype=torch.float32, device="cpu")


def image_span(seed: int, start: int, grid: tuple[int, int], hidden: int = 64) -> ImageSpan:
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    return ImageSpan(start, n, hashlib.sha256(str(seed).encode()).digest(), torch.randn(n, hidden, generator=g),
                     grid=grid)


def with_images(pieces: list) -> tuple[list[int], list[ImageSpan]]:
    """Token lists and (seed, grid) images in order -> the prompt's ids and its spans."""
    ids: list[int] = []
    spans = []
    for piece in pieces:
        if isinstance(piece, tuple):
            spans.append(image_span(piece[0], len(ids), piece[1]))
            ids += [IMAGE_PAD] * spans[-1].length
        else:
            ids += piece
    return ids, spans


def hf_rope_index(reference, ids: list[int], spans: list[ImageSpan]) -> torch.Tensor:
    """transformers' 3-D positions [3, len(ids)] for these ids (each span's grid in patches: merged rows x 2)."""
    t = torch.tensor([ids])
    grids = torch.tensor([[1, 2 * s.grid[0], 2 * s.grid[1]] for s in spans]) if spans else None
    types = torch.zeros_like(t, dtype=torch.int)
    for s in spans:
        types[0, s.start : s.end] = 1
    positions, _ = reference.model.get_rope_index(t, mm_token_type_ids=types, image_grid_thw=grids)
    return positions[:, 0]


PROMPT = [[9, 30, 31, 32], (1, (2, 3)), [40, 41, 42], (2, (4, 2)), [50, 51, 52, 53, 54, 55]]


def test_rope_positions_equal_get_rope_index(reference):
    ids, spans = with_images(PROMPT + [[60, 61, 62]])  # the tail stands in for decoded tokens
    expected = hf_rope_index(reference, ids, spans)
    assert torch.equal(torch.tensor(rope_positions(spans, 0, len(ids))), expected)
    for start, n in [(5, 9), (13, 1), (len(ids) - 1, 1), (0, 3)]:  # any chunk: its slice of the whole
        assert torch.equal(torch.tensor(rope_positions(spans, start, n)), expected[:, start : start + n])
    assert rope_positions([], 7, 3) == ([7, 8, 9],) * 3


def reference_greedy(reference, ids: list[int], spans: list[ImageSpan], steps: int,
                     mrope: bool = True) -> tuple[list[int], list[float]]:
    """transformers' text model fed the images' embeddings at their positions, re-run whole for each new token at
    get_rope_index's positions (which continue past the prompt by the rope delta, as generate's do; mrope False:
    consecutive positions): the greedy tokens and their log-probabilities."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(steps):
            full = ids + tokens
            x = reference.model.language_model.embed_tokens(torch.tensor([full]))
            for s in spans:
                x[0, s.start : s.end] = s.embeds
            positions = hf_rope_index(reference, full, spans) if mrope else torch.arange(len(full)).expand(3, -1)
            hidden = reference.model.language_model(inputs_embeds=x, position_ids=positions[:, None])
            logits = torch.log_softmax(reference.lm_head(hidden.last_hidden_state[0, -1]), -1)
            tokens.append(int(logits.argmax()))
            logprobs.append(float(logits.max()))
    return tokens, logprobs


def test_engine_answer_with_images_on_a_grid_equals_transformers(reference, lm):
    ids, spans = with_images(PROMPT)
    tokens, logprobs = reference_greedy(reference, ids, spans, 8)
    engine = make_engine(lm)
    engine.add_request("a", ids, SamplingParams(max_tokens=8, logprobs=0, **GREEDY), images=spans)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == tokens
    got = [lp.logprob for o in outs for lp in o.logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
    # consecutive positions (as for Gemma's images) give other log-probabilities: the grid positions are what matched
    _, plain = reference_greedy(reference, ids, spans, 8, mrope=False)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-3


def run(engine, prompts: list[tuple[list[int], list[ImageSpan]]], params) -> list[list[int]]:
    for i, (ids, spans) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params, images=spans)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_chunked_prefix_hit_and_preempted_equal_alone(lm):
    """Chunks of 5 cut both images; a second prompt sharing the first 32 tokens (both images) hits the prefix cache
    (a state checkpoint at 32); preemption recomputes with the same positions."""
    shared = PROMPT + [[70 + i for i in range(16)]]
    prompts = [with_images(shared + [tail]) for tail in ([80, 81, 82], [90, 91], [100, 101, 102, 103])]
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = [run(make_engine(lm), [p], params)[0] for p in prompts]
    assert run(make_engine(lm, max_num_batched_tokens=5), prompts, params) == alone
    engine = make_engine(lm)
    first = run(engine, prompts[:1], params)
    assert first + run(engine, prompts[1:], params) == alone
    assert engine.stats().kv.prefix_hits_tokens >= 2 * 32
    engine = make_engine(lm, num_kv_blocks=6)
    assert run(engine, prompts, params) == alone
    assert engine.stats().num_preemptions > 0


def test_a_grid_that_does_not_hold_the_image_is_refused(lm):
    from llmd.errors import InvalidRequest

    ids, (span,) = with_images([[9, 30], (1, (2, 3)), [40]])
    bad = ImageSpan(span.start, span.length, span.digest, span.embeds, grid=(2, 2))
    with pytest.raises(InvalidRequest, match="grid"):
        make_engine(lm).add_request("a", ids, SamplingParams(max_tokens=1), images=[bad])
