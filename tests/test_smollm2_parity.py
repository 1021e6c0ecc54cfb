"""SmolLM2-135M-Instruct from its GGUF: our loader + model against transformers' own GGUF loading, at fp32 on CPU.

Both sides dequantize the same Q4_1/Q8_0 blocks to fp32, so differences are only summation order: logits agree to
LOGIT_ATOL (absolute, on logits of magnitude ~10-30), and greedy continuations are identical.
"""

from __future__ import annotations

import pytest
import torch

from llmd.model.loader import load_model
from simple_driver import greedy_generate, prefill_logits

LOGIT_ATOL = 2e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.float32, device="cpu", quant="none")  # fp32, as transformers


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


def _ref_logits(reference, ids):
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(ours, reference):
    prompts = [
        ours.tokenizer.encode_chat(QUESTION),
        ours.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ]
    for ids in prompts:
        got = prefill_logits(ours, ids)
        want = _ref_logits(reference, ids)
        assert got.shape == want.shape == (len(ids), 49152)
        err = (got - want).abs().max().item()
        assert err < LOGIT_ATOL, f"max |logit difference| {err:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def chat_ids(ours):
    return ours.tokenizer.encode_chat(QUESTION)


def test_greedy_continuation_is_identical_and_answers_paris(ours, reference, chat_ids):
    eos = sorted(ours.tokenizer.eos_token_ids)
    got = greedy_generate(ours, chat_ids, 32, stop_ids=eos)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([chat_ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0])
    assert got == out[0, len(chat_ids):].tolist()
    answer = ours.tokenizer.decode(got)
    assert "Paris" in answer, answer
