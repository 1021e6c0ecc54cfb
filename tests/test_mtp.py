"""Qwen3.5's multi-token-prediction head as the draft (llmd.model.qwen3_5_mtp, llmd.engine.spec_mtp), on a tiny
random-weight Qwen3.5 folder given `mtp.*` tensors (CPU fp32): the head's step against a plain torch
re-implementation from the checkpoint's tensors; greedy output with MTP speculation equal to plain decoding (one
sequence, several staggered, prompts past one prefill chunk); a workload with aborts that leaks no block and no
state; `auto` picking the head; a MoE head; a bad tensor refused by file and name; `llmd serve --draft mtp`. Each
first guess the head makes in the engine is checked against the reference over the target's own hidden states (its
KV held exactly those rows). Random weights accept almost nothing, so the model's output head is narrowed to four
tokens (mtp_folder) for some proposals to be accepted.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.engine.spec_mtp import MtpDraft
from llmd.errors import ModelFileError
from llmd.model.attention import AttentionMetadata, allocate_kv_cache
from llmd.model.loader import load_model
from llmd.model.qwen3_5_mtp import load_mtp_head
from llmd.model.recurrent import StateMetadata
from simple_driver import SingleSequence
from test_engine import GREEDY, random_prompts, run_staggered
from tiny_models import add_mtp_head, write_tiny_gguf, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    """A tiny Qwen3.5 with an MTP head, whose output head can only tell four tokens apart (the others' rows are
    zero): random weights would accept no proposal, and the draft's bookkeeping of accepted positions would go
    untested; from four tokens the random head guesses some right."""
    from safetensors.torch import load_file, save_file

    folder = write_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen3_5", "qwen3_5")
    add_mtp_head(folder)
    tensors = load_file(folder / "model.safetensors")
    head = tensors["lm_head.weight"]
    kept = torch.zeros(head.shape[0], dtype=torch.bool)
    kept[[100, 200, 300, 400]] = True
    head[~kept] = 0
    head[kept] *= 4
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def qwen3_5_mtp(mtp_folder):
    return load_model(mtp_folder, dtype=torch.float32, device="cpu")


def _rms(x, w, eps):  # Qwen3.5's RMSNorm: scale by 1 + weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_head(folder, cfg, tokens, hidden):
    """The head's output and logits for (token t+1, target hidden at t) rows at positions 0..T-1, from the file's tensors."""
    from safetensors.torch import load_file

    w = load_file(folder / "model.safetensors")
    eps, nh, kvh, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = len(tokens)
    e = w["model.embed_tokens.weight"][tokens]
    x = torch.cat([_rms(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
    p = "mtp.layers.0."
    a = _rms(x, w[p + "input_layernorm.weight"], eps)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(T, nh * d)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(T, kvh, d)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, kvh, d)
    q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
    rd = cfg.rotary_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        r, rest = t[..., :rd], t[..., rd:]
        half = torch.cat([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + (att.transpose(0, 1).reshape(T, nh * d) * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T
    out = _rms(x + mlp, w["mtp.norm.weight"], eps)
    return out, out @ w["lm_head.weight"].T


def test_head_step_matches_a_torch_reference(qwen3_5_mtp, mtp_folder):
    cfg = qwen3_5_mtp.config
    head = load_mtp_head(qwen3_5_mtp)
    tokens = random_prompts(1, 20, 21, cfg.vocab_size, seed=1)[0]
    hidden = torch.randn(len(tokens), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    kv = allocate_kv_cache(1, 2, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32)[0]
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [[1, 0]], 16)
    with torch.inference_mode():
        out = head(qwen3_5_mtp.model, torch.tensor(tokens), torch.arange(len(tokens)), hidden, kv, meta)
        logits = qwen3_5_mtp.model.compute_logits(out)
    expected, expected_logits = reference_head(mtp_folder, cfg, tokens, hidden)
    assert (out - expected).abs().max().item() < 1e-4
    assert (logits - expected_logits).abs().max().item() < 1e-4


def target_hidden(lm, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its norm) for these tokens, from a plain single-sequence forward."""
    seq = SingleSequence(lm, len(tokens))
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [seq.block_table], seq.block_size)
    meta.state = StateMetadata.build([0], [True], [len(tokens)], seq.device)
    with torch.inference_mode():
        return seq.forward(torch.tensor(tokens), torch.arange(len(tokens)), seq.kv_caches, meta)


def record_first_guesses(engine, every: bool = True) -> list[tuple[list[int], int, int]]:
    """(the sequence's tokens, the head's first guess, its base) at each of the engine's MTP proposals, as they
    happen; every: the head guesses for every sequence it is asked about (its pool has room)."""
    draft, seen = engine.speculator.draft, []
    propose = draft.propose

    def recording(wants, vocab):
        out = propose(wants, vocab)
        assert len(out) == len(wants) or not every
        seen.extend((list(seq.token_ids), out[seq.request_id][0][0], draft.states[seq.request_id].base)
                    for seq, _ in wants if seq.request_id in out)
        return out

    draft.propose = recording
    return seen


def check_first_guesses(lm, folder, seen) -> None:
    """Each first guess is the reference head's argmax over the target's own hidden states of every position from
    the head's base to the one before the newest token: the head's KV held exactly those rows, after rollbacks,
    recomputes, preemptions and catch-ups."""
    for tokens, guess, base in seen:
        hidden = target_hidden(lm, tokens[:-1])[base:]
        _, logits = reference_head(folder, lm.config, tokens[base + 1 :], hidden)
        assert logits[-1, guess] >= logits[-1].max() - 1e-4


def test_greedy_with_mtp_equals_plain(qwen3_5_mtp, mtp_folder):
    # past the 32-token prefill chunk, and one past the rows the head lets wait (256): it takes them in on the way
    prompts = random_prompts(4, 5, 60, 570, seed=3) + random_prompts(1, 300, 301, 570, seed=4)
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(qwen3_5_mtp), prompts, params)]
    # one guess: often all accepted, so no recompute of a hybrid's rejected state follows (the head keeps the rows)
    alone = make_engine(qwen3_5_mtp, speculative_mode="draft", draft_model="mtp", num_speculative_tokens=1,
                        max_num_batched_tokens=32)
    assert isinstance(alone.speculator.draft, MtpDraft)
    seen = record_first_guesses(alone)
    assert [generate(alone, [p], params)[0].token_ids for p in prompts] == plain
    batched = make_engine(qwen3_5_mtp, speculative_mode="draft", draft_model="mtp", num_speculative_tokens=3,
                          max_num_batched_tokens=32)
    seen += record_first_guesses(batched)
    draft, waiting = batched.speculator.draft, []
    observe = draft.observe

    def observing(scheduled, hidden):
        observe(scheduled, hidden)
        waiting.append(max((st.num_pending for st in draft.states.values()), default=0))

    batched.runner.hidden_observer = draft.observe = observing
    out = run_staggered(batched, prompts, params)
    assert 32 < max(waiting) <= draft.max_pending == 256  # the long prompt's rows were taken in on the way
    assert [out[str(i)] for i in range(len(prompts))] == plain
    for engine in (alone, batched):
        stats = engine.stats().spec
        assert stats is not None and 0 < stats.accepted_total < stats.proposed_total
    assert alone.stats().spec.accepted_total >= 5
    check_first_guesses(qwen3_5_mtp, mtp_folder, seen)


def test_sampled_requests_draw_from_the_head_and_repeat_with_a_seed(qwen3_5_mtp):
    """Sampled proposals carry the head's distributions into rejection sampling; a seeded request repeats."""
    prompts = random_prompts(2, 10, 40, 570, seed=8)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    runs = []
    for _ in range(2):
        engine = make_engine(qwen3_5_mtp, speculative_mode="draft", draft_model="mtp", num_speculative_tokens=2)
        runs.append([r.token_ids for r in generate(engine, prompts, params)])
        assert engine.stats().spec.proposed_total > 0
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_prefix_hit_starts_the_head_past_it(qwen3_5_mtp):
    """A prompt whose first blocks the target takes from its prefix cache: the head never sees those positions'
    rows and attends from the hit's end on; the output is still plain decoding's."""
    shared = random_prompts(1, 40, 41, 570, seed=9)[0]
    prompts = [shared + [7, 8, 9], shared + random_prompts(1, 12, 13, 570, seed=10)[0]]  # the first checkpoints 32
    params = SamplingParams(max_tokens=12, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(qwen3_5_mtp), prompts, params)]
    engine = make_engine(qwen3_5_mtp, speculative_mode="draft", draft_model="mtp", num_speculative_tokens=2)
    seen = record_first_guesses(engine)
    assert [generate(engine, [p], params)[0].token_ids for p in prompts] == plain
    assert engine.stats().kv.prefix_hits_tokens >= 32 and {base for *_, base in seen} == {0, 32}
    check_first_guesses(qwen3_5_mtp, engine.speculator.draft.loaded.source.path, seen)


def test_auto_picks_the_head_and_a_workload_with_aborts_leaks_nothing(qwen3_5_mtp, mtp_folder):
    assert isinstance(make_engine(qwen3_5_mtp, speculative_mode="auto").speculator.draft, MtpDraft)
    engine = make_engine(qwen3_5_mtp, speculative_mode="draft", num_kv_blocks=12, max_num_batched_tokens=32,
                         num_speculative_tokens=2)
    seen = record_first_guesses(engine, every=False)
    rng = random.Random(5)
    live: set[str] = set()
    for step in range(100):
        if step < 60 and rng.random() < 0.3:
            rid = f"r{step}"
            engine.add_request(rid, random_prompts(1, 3, 60, 570, seed=step)[0],
                               SamplingParams(max_tokens=rng.randrange(1, 16), **GREEDY))
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
    assert engine.stats().spec.proposed_total > 0
    check_first_guesses(qwen3_5_mtp, mtp_folder, seen[::4])


def test_preempted_equals_plain(qwen3_5_mtp, mtp_folder):
    """Preempted sequences compute their positions again: the head rolls back to them (or starts over)."""
    prompts = random_prompts(6, 10, 40, 570, seed=2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(qwen3_5_mtp), prompts, params)]
    engine = make_engine(qwen3_5_mtp, speculative_mode="draft", draft_model="mtp", num_kv_blocks=8,
                         num_speculative_tokens=2)
    seen = record_first_guesses(engine, every=False)
    assert [r.token_ids for r in generate(engine, prompts, params)] == plain
    assert engine.stats().num_preemptions > 0 and engine.stats().spec.accepted_total > 0
    check_first_guesses(qwen3_5_mtp, mtp_folder, seen[::4])


def test_moe_head_loads_and_drafts(tmp_path):
    """Qwen3.5-MoE: the head's layer has its own experts (per-expert checkpoint tensors into the stacked ones)."""
    folder = write_tiny_model(tmp_path / "moe", "qwen3_5_moe")
    add_mtp_head(folder)
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    prompts = random_prompts(2, 20, 40, 570, seed=4)
    params = SamplingParams(max_tokens=8, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(loaded), prompts, params)]
    engine = make_engine(loaded, speculative_mode="draft", draft_model="mtp", num_speculative_tokens=2)
    assert [r.token_ids for r in generate(engine, prompts, params)] == plain
    assert engine.stats().spec.proposed_total > 0


def test_bad_mtp_tensor_is_refused_by_file_and_name(mtp_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(mtp_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors")
    loaded = load_model(folder, dtype=torch.float32, device="cpu")  # the target alone does not read the head
    with pytest.raises(ModelFileError) as info:
        make_engine(loaded, speculative_mode="draft", draft_model="mtp")
    assert "model.safetensors" in str(info.value) and "'mtp.fc.weight'" in str(info.value)


def test_mtp_draft_refused_without_a_head(tmp_path):
    """A folder without mtp.* tensors, a GGUF file (whose converter writes no head) and another family: `--draft mtp`
    is refused with a message; `auto` falls back to prompt lookup."""
    folder = write_tiny_model(tmp_path / "plain", "qwen3_5")
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="no mtp"):
        make_engine(loaded, speculative_mode="draft", draft_model="mtp")
    assert make_engine(loaded, speculative_mode="auto").speculator.draft is None  # auto: prompt lookup only
    gguf = load_model(write_tiny_gguf(folder, tmp_path / "plain.gguf"), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="Hugging Face folders only"):
        make_engine(gguf, speculative_mode="draft", draft_model="mtp")
    llama = load_model(write_tiny_model(tmp_path / "llama", "llama"), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="has no multi-token-prediction head"):
        make_engine(llama, speculative_mode="draft", draft_model="mtp")


def test_served_with_draft_mtp_by_a_real_daemon(mtp_folder, tmp_path):
    """`llmd serve --model FOLDER --draft mtp`: the flag reaches the engine (speculation on, adaptive, the head
    proposing), and the OpenAI client gets its answer. (Equality with plain decoding: the engine tests above.)"""
    import openai
    from llmd_daemon_proc import start_daemon

    folder = tmp_path / "tiny-qwen35-mtp"
    shutil.copytree(mtp_folder, folder)
    daemon = start_daemon(tmp_path / "llmd", "--model", str(folder), "--draft", "mtp")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        answer = client.completions.create(model=folder.name, prompt="def fibonacci(n):\n", max_tokens=16,
                                           temperature=0)
        assert answer.usage.completion_tokens == 16
        spec = daemon.wait_idle()["spec"]  # the top level: the one loaded model's stats
        assert spec["mode"] == "auto" and spec["proposed_total"] > 0
    finally:
        assert daemon.stop() == 0, daemon.log()
