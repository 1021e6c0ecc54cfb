"""The CPU layer stack (llmd.model.cpu_stack): all decoder layers of a quantized model in one C call must give the
module path's logits and KV caches bit for bit, in every kind of step (prefill chunks over cached prefixes, decodes,
mixes of both, speculative verifies), and must step aside where it does not apply. The engine's runner builds it
once (CompiledCpuForward) and calls it instead of the model."""

from __future__ import annotations

import gc

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401 (autouse: checks every engine for leaks)
from llmd.engine import SamplingParams
from llmd.kernels import cpu_ops
from llmd.model import cpu_stack
from llmd.model.attention import AttentionMetadata
from llmd.model.loader import load_model
from llmd.model.quant import QuantSpec, fill_from_weight

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler for the CPU kernels")]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A paged cache stores keys and values.",
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",  # shares a cached prefix
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Hello",
]


def _record_steps(loaded, use_stack: bool, prompts: list[list[int]] | None = None, max_tokens: int = 10,
                  **engine_kw) -> tuple[list[torch.Tensor], list]:
    """Greedy generation with staggered arrivals and small prefill chunks, so steps mix chunks and decodes;
    returns every step's logits and the final KV caches."""
    engine_kw.setdefault("max_num_batched_tokens", 12)
    engine = make_engine(loaded, **engine_kw)
    runner = engine.runner
    assert isinstance(runner.forward, cpu_stack.CompiledCpuForward)
    if not use_stack:
        runner.forward = loaded.model
    logits: list[torch.Tensor] = []
    execute = runner.execute_eager

    def recording(scheduled):
        out = execute(scheduled)
        logits.append(out.clone())
        return out

    runner.execute_eager = recording
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts or [tok.encode(p) for p in PROMPTS]):
        engine.add_request(str(i), prompt, params)
        for _ in range(3):
            engine.step()
    while engine.has_work():
        engine.step()
    if use_stack:  # the C code ran every step, none fell back to the modules
        assert runner.forward.stack.steps == len(logits)
    return logits, [tuple(t.clone() for t in pair) for pair in runner.kv_caches]


def _assert_stack_matches_modules(loaded, **kw):
    with_stack, caches = _record_steps(loaded, True, **kw)
    without, caches_ref = _record_steps(loaded, False, **kw)
    assert len(with_stack) == len(without) > 10
    for got, want in zip(with_stack, without):
        assert torch.equal(got, want)
    for got, want in zip(caches, caches_ref):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", ["int4-g32", "int8"])
def test_stack_matches_the_modules_bit_for_bit(tiny_llama, mode):
    _assert_stack_matches_modules(load_model(tiny_llama, quant=mode))


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16", "int8"])  # fp16, the CPU default: the tests above
def test_stack_reads_every_kv_cache_dtype_as_the_modules_do(tiny_llama, kv_cache_dtype):
    """fp32, bf16 and int8 KV caches run through the stack too (it used to need fp32), with the modules' bits."""
    _assert_stack_matches_modules(load_model(tiny_llama, quant="int4-g32"), kv_cache_dtype=kv_cache_dtype)


def test_stack_with_qkv_bias_and_speculative_verifies(tiny_qwen2):
    """Qwen2's qkv bias is added in the stack as in the modules; prompt-lookup speculation adds verify chunks."""
    _assert_stack_matches_modules(load_model(tiny_qwen2, quant="int4-g32"), speculative_mode="ngram")


def test_stack_with_int8_activations(tiny_llama, monkeypatch):
    """LLMD_CPU_GEMM_ACT=int8 (the integer matmul path) goes through the stack unchanged too."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "int8")
    loaded = load_model(tiny_llama, quant="int8")
    _assert_stack_matches_modules(loaded)
    layers = cpu_stack.CpuLayerStack.build(loaded.model).layers
    assert all(kind >= 2 for layer in layers for kind in (layer.qkv.kind, layer.down.kind))  # the int8-activation kinds


def test_smollm2_stack_matches_the_modules(smollm2_gguf):
    """The bundled model as it ships: Q4_1 layers, GQA 9:3, 30 layers."""
    _assert_stack_matches_modules(load_model(smollm2_gguf, quant="gguf"))


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "int8"])
def test_gemma3_stack_with_two_kv_groups_matches_the_modules(tmp_path, kv_cache_dtype):
    """A tiny Gemma 3 (window 16; 5 window layers, 1 global, 1 window) keeps its window layers' K/V in a second KV
    group with a pool of its own (llmd.engine.runner): the stack runs every step of contexts past 4x the window, each
    layer over its own group's tables, with the modules' logits and caches bit for bit."""
    from tiny_gemma import WINDOWS, write_tiny_gemma

    loaded = load_model(write_tiny_gemma(tmp_path / "gemma3", "gemma3"), quant="int4-g32")
    window = WINDOWS["gemma3"]
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(10, 500, (n - 1,), generator=g).tolist() for n in (70, 9, 4 * window + 5, 30)]
    kw = dict(prompts=prompts, max_tokens=8, max_num_batched_tokens=24, block_size=8, num_kv_blocks=None,
              kv_cache_bytes=2**21, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    runner = make_engine(loaded, **{k: v for k, v in kw.items() if k not in ("prompts", "max_tokens")}).runner
    sizes = {c[0].shape[0] for c in runner.kv_caches}
    assert runner.num_window_blocks and len(sizes) == 2  # two groups, pools of different sizes
    _assert_stack_matches_modules(loaded, **kw)


@pytest.mark.parametrize("mode,kv_cache_dtype,spec", [("int4-g32", "fp16", "off"), ("int8", "int8", "ngram")])
def test_gemma2_stack_matches_the_modules(tmp_path, mode, kv_cache_dtype, spec):
    """A tiny Gemma 2 (window 8, window and global layers alternating, attention soft-capped at 2 so the cap bites on
    random weights) runs every step in the stack, soft-capped attention in the C kernels, with the modules' logits
    and caches bit for bit: contexts past 8x the window, its window layers in their own KV group, prompt-lookup
    verify chunks beside decodes."""
    from tiny_gemma import WINDOWS, write_tiny_gemma

    loaded = load_model(write_tiny_gemma(tmp_path / "gemma2", "gemma2"), quant=mode)
    assert loaded.config.attn_logit_softcapping == 2.0
    assert all(layer.softcap == 2.0 for layer in cpu_stack.CpuLayerStack.build(loaded.model).layers)
    window = WINDOWS["gemma2"]
    g = torch.Generator().manual_seed(1)
    prompts = [[2] + torch.randint(10, 500, (n - 1,), generator=g).tolist() for n in (70, 9, 8 * window + 3, 30)]
    prompts[1] = prompts[1] * 4  # repeats: n-gram proposals to verify
    kw = dict(prompts=prompts, max_tokens=8, max_num_batched_tokens=24, block_size=8, num_kv_blocks=None,
              kv_cache_bytes=2**21, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, speculative_mode=spec)
    runner = make_engine(loaded, **{k: v for k, v in kw.items() if k not in ("prompts", "max_tokens")}).runner
    assert runner.num_window_blocks  # the window layers' own pool
    _assert_stack_matches_modules(loaded, **kw)


def test_stack_steps_aside_where_it_does_not_apply(tiny_llama, tiny_qwen3):
    fp32 = load_model(tiny_llama, dtype=torch.float32)
    assert cpu_stack.CpuLayerStack.build(fp32.model) is None  # fp32 weights: MKL through torch
    assert cpu_stack.CpuLayerStack.build(load_model(tiny_qwen3, quant="int8").model) is None  # q/k norm
    loaded = load_model(tiny_llama, quant="int8")
    ids = torch.tensor(loaded.tokenizer.encode("Hello"))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0]], 16)
    caches = [(torch.zeros(2, 16, 2, 16, dtype=torch.float64),) * 2 for _ in loaded.model.model.layers]
    forward = cpu_stack.CompiledCpuForward.try_build(loaded.model)
    with torch.inference_mode():
        got = forward(ids, torch.arange(len(ids)), caches, meta)
        assert not forward.stack._caches  # built, then declined the fp64 cache: the modules ran
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0]], 16)
        assert torch.equal(got, loaded.model(ids, torch.arange(len(ids)), caches, meta))
    assert make_engine(fp32).runner.forward is fp32.model  # the runner runs such a model itself


def test_a_stack_keeps_the_weights_it_was_built_with(tiny_llama):
    """The stack is built once for weights that no longer change: replacing a layer's weights afterwards leaves it
    on the old ones, which it keeps alive (no stray pointer); a stack built again runs the new ones, as the modules
    do."""
    loaded = load_model(tiny_llama, quant="int8")
    model = loaded.model
    ids = torch.tensor(loaded.tokenizer.encode("Hello there"))
    meta_args = ([len(ids)], [len(ids)], [[0]], 16)

    def run(forward):
        caches = [(torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)) for _ in model.model.layers]
        with torch.inference_mode():
            return forward(ids, torch.arange(len(ids)), caches, AttentionMetadata.build(*meta_args))

    first = cpu_stack.CompiledCpuForward.try_build(model)
    before = run(first)
    down = model.model.layers[1].mlp.down_proj
    fill_from_weight(down, -down.dequantized_weight(), QuantSpec("int8"))  # a new buffer; drops the layer's kernel
    gc.collect()  # the old buffer would be freed here if the stack did not hold it
    assert torch.equal(run(first), before)
    after = run(cpu_stack.CompiledCpuForward.try_build(model))
    assert torch.equal(after, run(model)) and not torch.equal(before, after)


def test_bad_block_id_is_an_error_not_a_stray_write(tiny_llama):
    loaded = load_model(tiny_llama, quant="int8")
    ids = torch.tensor(loaded.tokenizer.encode("Hello there"))
    caches = [(torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)) for _ in loaded.model.model.layers]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0]], 16)
    meta.block_tables[0, 0] = 5  # past the 2-block cache
    with torch.inference_mode(), pytest.raises(IndexError):
        cpu_stack.CompiledCpuForward.try_build(loaded.model)(ids, torch.arange(len(ids)), caches, meta)


def test_stack_does_not_keep_a_kv_pool_alive(tiny_llama):
    """The stack lives with the model; the caches it last ran on must be freed with their engine."""
    import weakref

    loaded = load_model(tiny_llama, quant="int8")
    ids = torch.tensor(loaded.tokenizer.encode("Hello there"))
    caches = [(torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)) for _ in loaded.model.model.layers]
    forward = cpu_stack.CompiledCpuForward.try_build(loaded.model)
    with torch.inference_mode():
        forward(ids, torch.arange(len(ids)), caches, AttentionMetadata.build([len(ids)], [len(ids)], [[0]], 16))
    assert forward.stack._caches
    first = weakref.ref(caches[0][0])
    del caches
    gc.collect()
    assert first() is None


@pytest.mark.parametrize("model,kv_cache_dtype", [("tiny-int4", "fp32"), ("smollm2", "fp32"), ("smollm2", "fp16"),
                                                  ("smollm2", "int8")])
def test_tokens_decoded_or_verified_in_a_chunk_get_the_same_logits(model, kv_cache_dtype, tiny_llama, smollm2_gguf):
    """Speculative verification and recompute after preemption run a sequence's tokens as a chunk where plain
    decoding runs them one by one: on the CPU path the logits and the KV cache are bit for bit the same."""
    from simple_driver import SingleSequence

    # a quantized head (SmolLM2's is its Q8_0 table): fp32 heads run torch's matmul, whose bits may depend on M
    loaded = load_model(tiny_llama, quant="int4-g32", quantize_head=True) if model == "tiny-int4" \
        else load_model(smollm2_gguf)
    prompt = loaded.tokenizer.encode("The capital of France is")
    tokens = loaded.tokenizer.encode(" Paris, and Berlin is the capital of Germany.")[:6]
    one_by_one, chunked = SingleSequence(loaded, 64, kv_cache_dtype=kv_cache_dtype), \
        SingleSequence(loaded, 64, kv_cache_dtype=kv_cache_dtype)
    one_by_one.feed(prompt)
    chunked.feed(prompt)
    decoded = torch.cat([one_by_one.feed([t]) for t in tokens])
    assert torch.equal(decoded, chunked.feed(tokens))
    for one, chunk in zip(one_by_one.kv_caches, chunked.kv_caches):
        assert all(torch.equal(a, b) for a, b in zip(one, chunk))


def test_two_threads_on_one_model_keep_their_own_caches(tiny_llama):
    """The stack points its layers at the caches of each call: threads running the model on different caches at
    once get what they get one after the other."""
    import threading

    from simple_driver import SingleSequence

    loaded = load_model(tiny_llama, quant="int8", quantize_head=True)
    prompts = [loaded.tokenizer.encode("The quick brown fox"), loaded.tokenizer.encode("def fibonacci(n):")]

    def run(prompt):
        seq = SingleSequence(loaded, 64)
        out = [seq.feed(prompt)]
        for _ in range(20):
            out.append(seq.feed([int(out[-1][-1].argmax())]))
        return torch.cat(out)

    alone = [run(p) for p in prompts]
    together = [None, None]
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(prompts[i]))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


# ---- Gemma 4 (llmd.model.gemma4): per-layer head shapes, KV sharing, per-layer inputs, output scalars


@pytest.fixture(scope="module")
def gemma4_files(tmp_path_factory) -> dict:
    """Tiny Gemma 4s (window 8): E-style (6 layers, the last two sharing K/V and double-wide, per-layer inputs 32
    wide) and 31B-style (V from K and one KV head on the global layers), as HF folders and packed Q8_0 files."""
    from tiny_models import write_tiny_gguf, write_tiny_model

    root = tmp_path_factory.mktemp("gemma4_stack")
    folders = {"e": write_tiny_model(root / "e", "gemma4_e32"), "dense": write_tiny_model(root / "dense", "gemma4_dense")}
    return folders | {f"{kind}-Q8_0": write_tiny_gguf(folder, root / f"{kind}.Q8_0.gguf", "Q8_0")
                      for kind, folder in folders.items()}


@pytest.mark.parametrize("model,quant,kv_cache_dtype,spec", [("e", "int4-g32", "fp16", "off"),
                                                             ("e-Q8_0", None, "fp32", "ngram"),
                                                             ("dense", "int8", "int8", "off"),
                                                             ("dense-Q8_0", None, "fp16", "ngram")])
def test_gemma4_stack_matches_the_modules(gemma4_files, model, quant, kv_cache_dtype, spec):
    """Gemma 4's dense layers run every step in the stack with the modules' logits and caches bit for bit: the
    global layers' wider heads (and, 31B-style, their V taken from K) in caches of their own shape, the KV-sharing
    layers reading an earlier layer's cache and storing nothing, their double-wide MLPs, the per-layer inputs, the
    layers' scalars; contexts past 8x the window, the window layers in their own KV group, prompt-lookup verify
    chunks beside decodes."""
    loaded = load_model(gemma4_files[model], quant=quant) if quant else load_model(gemma4_files[model])
    layers = cpu_stack.CpuLayerStack.build(loaded.model).layers
    shape = [(layer.head_dim, layer.kv_heads, layer.kv_shared, layer.intermediate) for layer in layers]
    if model.startswith("e"):
        assert shape == [(16, 2, 0, 128)] * 3 + [(32, 2, 0, 128), (16, 2, 1, 256), (32, 2, 1, 256)]
        assert all(layer.ple_gate.n == 32 for layer in layers)
    else:
        assert shape == [(16, 2, 0, 128), (32, 1, 0, 128)] * 2
        assert [bool(layer.v.n) for layer in layers] == [True, False] * 2  # V from K on the global layers
    g = torch.Generator().manual_seed(2)
    prompts = [[2] + torch.randint(10, 500, (n - 1,), generator=g).tolist() for n in (70, 9, 8 * 8 + 3, 30)]
    prompts[1] = prompts[1] * 4  # repeats: n-gram proposals to verify
    kw = dict(prompts=prompts, max_tokens=8, max_num_batched_tokens=24, block_size=8, num_kv_blocks=None,
              kv_cache_bytes=2**21, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, speculative_mode=spec)
    runner = make_engine(loaded, **{k: v for k, v in kw.items() if k not in ("prompts", "max_tokens")}).runner
    assert runner.num_window_blocks  # the window layers' own pool
    _assert_stack_matches_modules(loaded, **kw)


def test_gemma4_with_moe_blocks_keeps_its_modules(tmp_path):
    """26B-A4B-style layers (an MoE block beside each MLP) run as modules: the stack declines the model."""
    from tiny_models import write_tiny_model

    loaded = load_model(write_tiny_model(tmp_path / "moe", "gemma4_moe"), quant="int8")
    assert cpu_stack.CpuLayerStack.build(loaded.model) is None
    assert make_engine(loaded).runner.forward is loaded.model
