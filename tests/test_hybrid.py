"""Hybrid recurrent models (Qwen3.5's Gated DeltaNet layers between gated full-attention layers) against
transformers on CPU fp32, from HF folders; then the engine's invariants with a state pool beside the paged KV:
batched == alone (prefill chunks and decodes mixed), prefix hit (a restored state checkpoint) == miss, preempted ==
not, a random workload with aborts that leaks no slot and no block; and bad files refused by name.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.engine.scheduler import Proposal
from llmd.errors import ModelFileError
from llmd.model.loader import load_model
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, prompt_ids, reference_logits
from simple_driver import SingleSequence
from tiny_models import HYBRID_KINDS, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in HYBRID_KINDS}


@pytest.fixture(scope="module")
def qwen3_5(hybrid_models):
    return load_model(hybrid_models["qwen3_5"], dtype=torch.float32, device="cpu")


def chunked_logits(lm, prompt: list[int], decode: list[int], chunks: tuple[int, ...]) -> torch.Tensor:
    """Our logits for a prompt fed in chunks of these sizes (the rest in one), then one token per step."""
    seq = SingleSequence(lm, max_tokens=len(prompt) + len(decode) + 8)
    rows, start = [], 0
    for n in (*chunks, len(prompt)):
        if start < min(n + start, len(prompt)):
            rows.append(seq.feed(prompt[start : min(start + n, len(prompt))]))
            start = min(start + n, len(prompt))
    return torch.cat(rows + [seq.feed([t]) for t in decode])


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_hf_folder_matches_transformers(kind, hybrid_models):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hybrid_models[kind], dtype=torch.float32).eval()
    lm = load_model(hybrid_models[kind], dtype=torch.float32, device="cpu")
    prompt, decode = prompt_ids(70), prompt_ids(24, seed=1)
    expected = reference_logits(ref, prompt, decode)
    for chunks in [(), (11, 30)]:  # the prompt whole, and in three chunks carrying the state across
        got = chunked_logits(lm, prompt, decode, chunks)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < TOLERANCE


def test_image_text_checkpoint_loads_its_text_model(hybrid_models, tmp_path):
    """A Qwen3_5ForConditionalGeneration folder's text model: text_config, `model.language_model.*` names; tensors of
    a vision tower and an MTP head are left unread (the tower, with its vision_config: test_vision_qwen3_5.py)."""
    from safetensors.torch import load_file, save_file

    src = hybrid_models["qwen3_5"]
    folder = tmp_path / "vl"
    folder.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (folder / f.name).write_bytes(f.read_bytes())
    text = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
        "text_config": {**text, "model_type": "qwen3_5_text"}}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
    tensors["mtp.fc.weight"] = torch.zeros(8, 8)
    save_file(tensors, folder / "model.safetensors")
    plain = load_model(src, dtype=torch.float32, device="cpu")
    vl = load_model(folder, dtype=torch.float32, device="cpu")
    assert vl.config.architecture == "Qwen3_5ForCausalLM"
    prompt = prompt_ids(20)
    assert torch.equal(chunked_logits(vl, prompt, [5], ()), chunked_logits(plain, prompt, [5], ()))


def test_engine_batched_and_chunked_equal_alone(qwen3_5):
    prompts = random_prompts(8, 5, 60, 570, seed=3)
    params = SamplingParams(max_tokens=12, **GREEDY)
    alone = run_alone(qwen3_5, prompts, params)
    engine = make_engine(qwen3_5, max_num_batched_tokens=24)  # prompts are chunked, decodes ride along
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    stats = engine.stats()
    assert stats.kv.state_slots >= 8 and stats.kv.state_bytes_per_seq > 0


def test_prefix_hit_restores_a_checkpoint_and_equals_a_miss(qwen3_5):
    shared = prompt_ids(40, seed=9)  # 2.5 blocks of 16: the checkpoint sits at the last block boundary, 32
    prompts = [shared + p for p in random_prompts(4, 3, 20, 570, seed=10)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = run_alone(qwen3_5, prompts, params)
    engine = make_engine(qwen3_5)
    first = generate(engine, prompts[:1], params)[0].token_ids
    rest = [r.token_ids for r in generate(engine, prompts[1:], params)]
    assert [first] + rest == alone
    stats = engine.stats()
    assert stats.kv.prefix_hits_tokens >= 3 * 32
    assert stats.kv.state_checkpoint_hits >= 3


def test_preempted_equals_plain(qwen3_5):
    prompts = random_prompts(6, 10, 40, 570, seed=2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    ample = [r.token_ids for r in generate(make_engine(qwen3_5), prompts, params)]
    engine = make_engine(qwen3_5, num_kv_blocks=8)
    assert [r.token_ids for r in generate(engine, prompts, params)] == ample
    assert engine.stats().num_preemptions > 0


def test_speculation_rolls_the_state_back_exactly(qwen3_5):
    """Proposals that are right but for their last token (a proposer that knows the plain run's output): each
    verify accepts some tokens and rejects one, so the state must go back to before the step and recompute exactly.
    A draft model must be attention-only; a hybrid draft is refused by name."""
    prompts = random_prompts(4, 5, 40, 570, seed=6)
    params = SamplingParams(max_tokens=20, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(qwen3_5), prompts, params)]
    spec = make_engine(qwen3_5, speculative_mode="ngram", num_speculative_tokens=3, spec_max_batch=2)
    by_prompt = {tuple(p): out for p, out in zip(prompts, plain)}

    def nearly_right(decodes, budget, load):
        proposals = {}
        for seq in decodes:
            future = by_prompt[tuple(seq.prompt_token_ids)][seq.num_output_tokens:][:3]
            if len(future) > 1:
                proposals[seq.request_id] = Proposal(future[:-1] + [(future[-1] + 1) % 570])
        return proposals

    spec.speculator.propose = nearly_right
    assert [r.token_ids for r in generate(spec, prompts, params)] == plain
    stats = spec.stats().spec
    assert stats is not None and 0 < stats.accepted_total < stats.proposed_total
    with pytest.raises(ValueError, match="recurrent layers"):
        make_engine(qwen3_5, speculative_mode="draft", draft_model="self:2")


def test_fewer_state_slots_than_requests_queue_the_rest(qwen3_5):
    """The state pool bounds the running sequences: with room for two, six requests still all finish, exactly."""
    prompts = random_prompts(6, 5, 30, 570, seed=4)
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(qwen3_5, prompts, params)
    engine = make_engine(qwen3_5, max_num_seqs=2)
    assert engine.scheduler.max_num_seqs == 2
    assert [r.token_ids for r in generate(engine, prompts, params)] == alone


def test_random_workload_with_aborts_leaks_nothing(qwen3_5):
    rng = random.Random(5)
    engine = make_engine(qwen3_5, num_kv_blocks=24, max_num_batched_tokens=32)
    live: set[str] = set()
    for step in range(120):
        if step < 80 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = prompt_ids(rng.randrange(3, 50), seed=rng.randrange(3)) + prompt_ids(rng.randrange(1, 9), seed=step)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 16), **GREEDY))
            live.add(rid)
        if live and rng.random() < 0.1:
            engine.abort(rng.choice(sorted(live)))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    assert not live


def test_layer_pattern_that_does_not_match_the_tensors(hybrid_models, tmp_path):
    folder = tmp_path / "swapped"
    folder.mkdir()
    for f in hybrid_models["qwen3_5"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] + cfg["layer_types"][1:]  # layer 0 holds Gated DeltaNet tensors
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError) as info:
        load_model(folder, dtype=torch.float32, device="cpu")
    assert "linear_attn" in str(info.value) and "layers.0" in str(info.value)


def test_served_by_a_real_daemon(hybrid_models, tmp_path):
    """A Qwen3.5 folder named on the command line answers the OpenAI client, streamed and not, with the same greedy
    text, twice (the second time from a prefix checkpoint); `llmd ps` shows the state pool beside the KV cache."""
    import shutil
    import subprocess

    import openai
    from llmd_daemon_proc import llmd_exe, start_daemon

    folder = tmp_path / "tiny-qwen35"
    shutil.copytree(hybrid_models["qwen3_5"], folder)
    daemon = start_daemon(tmp_path / "llmd", "--model", str(folder))
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        whole = client.completions.create(model="tiny-qwen35", prompt=prompt, max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-qwen35", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert whole.usage.completion_tokens == 12 and streamed == whole.choices[0].text
        ps = subprocess.run([llmd_exe(), "ps"], env=daemon.env, capture_output=True, text=True,
                            timeout=60)
        assert ps.returncode == 0, ps.stderr
        states = next(line for line in ps.stdout.splitlines() if line.strip().startswith("states"))
        assert "sequence slots" in states and "(1 hits)" in states
    finally:
        assert daemon.stop() == 0, daemon.log()
