"""Images in the engine (llmd.engine.types.ImageSpan): embeddings read at an image's placeholder positions in place of
the tokens', prefill chunks that never split an image whose tokens see each other (Gemma), and prefix-cache keys
made from the image's pixels. Checked on a tiny Gemma 3 with embeddings standing in for a tower's: the image's
tokens attend both ways exactly as a direct torch computation says; batched == alone; a repeated image hits the
prefix cache and a different image with the same tokens does not; preempted == not.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.engine.types import ImageSpan
from llmd.errors import InvalidRequest
from llmd.model.loader import load_model
from test_engine import GREEDY
from tiny_gemma import write_tiny_gemma

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_TOKEN = 7  # any id: the embeddings replace what it would embed


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    return write_tiny_gemma(tmp_path_factory.mktemp("img") / "g3", "gemma3")


@pytest.fixture(scope="module")
def gemma3(gemma3_folder):
    return load_model(gemma3_folder, dtype=torch.float32, device="cpu")


def image(seed: int, start: int, length: int, hidden: int, bidirectional: bool = True) -> ImageSpan:
    g = torch.Generator().manual_seed(seed)
    return ImageSpan(start, length, hashlib.sha256(str(seed).encode()).digest(),
                     torch.randn(length, hidden, generator=g), bidirectional)


def prompt(before: list[int], length: int, after: list[int]) -> list[int]:
    return before + [IMAGE_TOKEN] * length + after


def run(engine, prompts, images, params) -> list[list[int]]:
    for i, (p, ims) in enumerate(zip(prompts, images)):
        engine.add_request(f"r{i}", p, params, images=ims)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_image_tokens_attend_both_ways_and_chunks_never_split_them(gemma3, gemma3_folder):
    """The first logits of a prompt with an image equal a direct computation: transformers' Gemma 3 text model fed
    the same input embeddings with a mask where the image's tokens see each other."""
    from transformers import AutoModelForCausalLM

    hidden, window = gemma3.config.hidden_size, gemma3.config.sliding_window
    im = image(1, 5, 10, hidden)
    ids = prompt([2, 40, 41, 42, 43], 10, [50, 51, 52, 53, 54])  # longer than the window
    assert len(ids) > window > im.length
    engine = make_engine(gemma3, max_num_batched_tokens=8, kv_cache_dtype="fp32")  # one chunk takes the image
    engine.add_request("a", ids, SamplingParams(max_tokens=1, logprobs=0, **GREEDY), images=[im])
    computed, outs = [], []
    while engine.has_work():
        outs += engine.step()
        if "a" in engine.requests:
            computed.append(engine.requests["a"].num_computed_tokens)
    assert computed and not any(5 < n < 15 for n in computed)  # no chunk ends inside the image
    ref = AutoModelForCausalLM.from_pretrained(gemma3_folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        x = ref.model.embed_tokens(torch.tensor([ids]))
        x[0, 5:15] = im.embeds
        n = len(ids)
        causal = torch.ones(n, n).tril().bool()
        local = causal & ~torch.ones(n, n).tril(-window).bool()
        causal[5:15, 5:15] = local[5:15, 5:15] = True

        def additive(allowed):
            return torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))

        masks = {"full_attention": additive(causal), "sliding_attention": additive(local)}
        logits = ref(inputs_embeds=x, attention_mask=masks).logits[0, -1]
    (out,) = outs
    assert out.new_token_ids == [int(logits.argmax())]
    assert abs(out.logprobs[0].logprob - torch.log_softmax(logits.float(), -1).max().item()) < 1e-4


def test_batched_equals_alone_and_the_prefix_cache_keys_images_by_pixels(gemma3):
    hidden = gemma3.config.hidden_size
    params = SamplingParams(max_tokens=8, **GREEDY)
    text = list(range(60, 100))
    a, b = image(1, 3, 40, hidden), image(2, 3, 40, hidden)
    same = [prompt([2, 10, 11], 40, text[:5]), prompt([2, 10, 11], 40, text[5:12])]
    alone = [run(make_engine(gemma3, enable_prefix_caching=False), [p], [[im]], params)[0]
             for p, im in [(same[0], a), (same[1], a), (same[1], b)]]
    engine = make_engine(gemma3, max_num_batched_tokens=48)
    assert run(engine, same, [[a], [a]], params) == alone[:2]
    hits = engine.stats().kv.prefix_hits_tokens
    assert hits >= 32  # the second request reused the blocks of the same image
    assert run(engine, [same[1]], [[b]], params) == alone[2:]  # the same tokens, another image: no stale hit
    assert engine.stats().kv.prefix_hits_tokens - hits < 16  # at most the block before the image
    assert alone[1] != alone[2]


def test_preempted_equals_plain(gemma3):
    hidden = gemma3.config.hidden_size
    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [prompt([2, 20 + i], 24, [70 + i, 71]) for i in range(4)]
    images = [[image(10 + i, 2, 24, hidden)] for i in range(4)]
    plain = run(make_engine(gemma3), prompts, images, params)
    engine = make_engine(gemma3, num_kv_blocks=8)
    assert run(engine, prompts, images, params) == plain
    assert engine.stats().num_preemptions > 0


def test_images_that_do_not_fit_the_prompt_are_refused(gemma3):
    engine = make_engine(gemma3)
    hidden = gemma3.config.hidden_size
    with pytest.raises(InvalidRequest, match="image 0"):
        engine.add_request("x", [2, 3, 4], SamplingParams(max_tokens=1), images=[image(1, 1, 5, hidden)])
    with pytest.raises(InvalidRequest, match="image 0"):
        engine.add_request("y", [2] * 10, SamplingParams(max_tokens=1), images=[image(1, 1, 5, hidden + 1)])
