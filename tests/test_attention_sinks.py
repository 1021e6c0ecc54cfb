"""Attention sinks (gpt-oss: a learned logit per query head joins each query's softmax denominator, with no value) in
every CPU path: the torch reference and batched decode, the torch and CPU backends, the C kernels of
llmd.kernels.cpu_ops, against a dense computation written out from the definition
p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)) and against transformers' gpt_oss eager attention; with and
without a sliding window, decodes beside chunks over cached prefixes, on the NaN-poisoned caches of
test_sliding_window_attention (no block before a window is read). Then a tiny model whose layers carry sinks equals
transformers with gpt_oss's attention function. (The Triton kernels: tests/test_kernels_attention_sinks.py.)
"""

from __future__ import annotations

import types

import pytest
import torch
from llmd.kernels import cpu_ops
from llmd.model.attention import AttentionMetadata, DecodePlan, batched_decode_attention, torch_paged_attention
from llmd.model.attention_backends import CPU, TORCH, CpuBackend
from llmd.model.loader import load_model
from test_sliding_window_attention import BS, LENS, Q_LENS, make_case

HAVE_OPS = cpu_ops.load() is not None
needs_ops = pytest.mark.skipif(not HAVE_OPS, reason="no C compiler: the CPU kernels are not built (torch serves)")


def head_sinks(heads: int, seed: int = 1) -> torch.Tensor:
    """Sink logits about as large as the scores (each takes a sizeable share), one far below and one far above."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = -30.0, 8.0
    return sinks


def dense_sink_attention(q, k, v, positions, window, scale, sinks):
    """q [L, H, d] at `positions` over the whole context k/v [S, kv_heads, d], in float64, from the definition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,shd->hs", q[i].double(), k[lo : p + 1]) * scale  # [H, keys]
        m = torch.maximum(s.amax(-1), sinks.double())
        e = torch.exp(s - m[:, None])
        probs = e / (torch.exp(sinks.double() - m) + e.sum(-1))[:, None]
        out[i] = torch.einsum("hs,shd->hd", probs, v[lo : p + 1])
    return out.float()


def expected(q, dense, lens, q_lens, window, scale, sinks):
    out, start = [], 0
    for (k, v), n, q_len in zip(dense, lens, q_lens, strict=True):
        out.append(dense_sink_attention(q[start : start + q_len], k, v, range(n - q_len, n), window, scale, sinks))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 8, 5])
@pytest.mark.parametrize("group", [1, 3])
def test_torch_paths_match_dense(window, group):
    """The reference, the batched decode and the torch backend (decode rows batched beside chunks in one step)."""
    q, cache, tables, dense = make_case(LENS, Q_LENS, window, group=group)
    sinks = head_sinks(q.shape[1])
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS, backend=TORCH)
    want = expected(q, dense, LENS, Q_LENS, window, 0.3, sinks)
    torch.testing.assert_close(torch_paged_attention(q, cache, meta, 0.3, window=window, sinks=sinks), want,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(TORCH.attend(q, cache, meta, 0.3, window=window, sinks=sinks), want,
                               rtol=1e-5, atol=1e-5)
    lens = [n for n, ql in zip(LENS, Q_LENS, strict=True) if ql == 1]
    q, cache, tables, dense = make_case(lens, [1] * len(lens), window, group=group)
    decode = AttentionMetadata.build([1] * len(lens), lens, tables, BS)
    got = batched_decode_attention(q, cache, DecodePlan.build(decode), 0.3, window=window, sinks=sinks)
    torch.testing.assert_close(got, expected(q, dense, lens, [1] * len(lens), window, 0.3, sinks), rtol=1e-5,
                               atol=1e-5)
    assert (got - batched_decode_attention(q, cache, DecodePlan.build(decode), 0.3, window=window)).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_equals_transformers_gpt_oss_eager_attention(window):
    """transformers' gpt_oss eager_attention_forward (its own module-level function) on each sequence's chunk, with
    the causal (and windowed) mask as an additive -inf mask: the torch backend and the C kernels equal it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, cache, tables, dense = make_case(LENS, Q_LENS, None, group=2)
    sinks = head_sinks(q.shape[1], seed=3)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS, backend=TORCH)
    got = TORCH.attend(q, cache, meta, 0.3, window=window, sinks=sinks)
    module = types.SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    start = 0
    for (k, v), n, q_len in zip(dense, LENS, Q_LENS, strict=True):
        q_pos, k_pos = torch.arange(n - q_len, n)[:, None], torch.arange(n)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))[None, None]
        want, _ = eager_attention_forward(module, q[start : start + q_len].transpose(0, 1)[None],
                                          k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, 0.3)
        torch.testing.assert_close(got[start : start + q_len], want[0], rtol=1e-5, atol=1e-5)
        start += q_len
    if HAVE_OPS:
        cpu_meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS, backend=CPU)
        torch.testing.assert_close(CPU.attend(q, cache, cpu_meta, 0.3, window=window, sinks=sinks), got,
                                   rtol=1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("window", [None, 8, 300])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_c_kernels_match_dense_and_the_torch_path(window, group):
    q, cache, tables, dense = make_case(LENS, Q_LENS, window, group=group)
    sinks = head_sinks(q.shape[1])
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, DecodePlan.build(meta), 0.3, out, window, None, sinks)
    torch.testing.assert_close(out, expected(q, dense, LENS, Q_LENS, window, 0.3, sinks), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, TORCH.attend(q, cache, meta, 0.3, window=window, sinks=sinks), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(CPU.attend(q, cache, meta, 0.3, window=window, sinks=sinks), out, rtol=0, atol=0)


@needs_ops
@pytest.mark.parametrize("window", [None, 300])
def test_c_kernels_past_a_partition_and_decode_equals_the_same_query_in_a_chunk(window):
    """Contexts of several 256-token partitions (the sink enters once, where they merge), and the invariance: a
    token's output is bit-identical decoded alone, in a batch or as a row of a prefill chunk, at 1 and 4 threads."""
    lens, q_lens = [1000, 700, 1100], [1, 1, 9]
    q, cache, tables, dense = make_case(lens, q_lens, window, group=2, d=8, seed=3)
    sinks = head_sinks(q.shape[1])
    meta = AttentionMetadata.build(q_lens, lens, tables, BS)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, DecodePlan.build(meta), 0.3, out, window, None, sinks)
    torch.testing.assert_close(out, expected(q, dense, lens, q_lens, window, 0.3, sinks), rtol=1e-5, atol=1e-5)
    chunk, n, table = q[2:], lens[2], torch.tensor(tables[2])
    threads = torch.get_num_threads()
    for j in range(chunk.shape[0]):
        for t in (1, 4):
            torch.set_num_threads(t)
            try:
                decoded = torch.empty_like(chunk[j : j + 1])
                assert cpu_ops.decode_attention(chunk[j : j + 1], cache, table[None], torch.tensor([n - 9 + j + 1]),
                                                None, 0.3, decoded, window, sinks=sinks)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(decoded[0], out[2 + j]), (j, t)


@needs_ops
@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "int8"])
def test_c_kernels_read_compact_caches_with_sinks(kv_cache_dtype):
    from llmd.model.attention import allocate_kv_cache, write_kv

    g = torch.Generator().manual_seed(11)
    num_blocks = sum((n + BS - 1) // BS for n in LENS) + 1
    (cache,) = allocate_kv_cache(1, num_blocks, BS, 2, 16, torch.float32, "cpu", kv_cache_dtype)
    slots = torch.arange(num_blocks * BS)
    write_kv(torch.randn(len(slots), 2, 16, generator=g), torch.randn(len(slots), 2, 16, generator=g), cache, slots)
    tables, used = [], 0
    for n in LENS:
        tables.append(list(range(used, used + (n + BS - 1) // BS)))
        used += len(tables[-1])
    q = torch.randn(sum(Q_LENS), 6, 16, generator=g)
    sinks = head_sinks(6)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, DecodePlan.build(meta), 0.3, out, 8, None, sinks)
    torch.testing.assert_close(out, torch_paged_attention(q, cache, meta, 0.3, window=8, sinks=sinks), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("backend", [TORCH, CPU], ids=lambda b: b.name)
def test_a_sink_that_takes_no_share_changes_nothing(backend):
    """Sinks of -inf add exp(-inf) = 0 to every denominator: the result of no sinks (bit for bit in the C kernels,
    whose merge then makes the same operations), with a window and a soft-cap too."""
    q, cache, tables, _ = make_case(LENS, Q_LENS, None, group=3)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS, backend=backend)
    none = torch.full((q.shape[1],), float("-inf"))
    for window, softcap in ((None, None), (8, None), (8, 2.0)):
        plain = backend.attend(q, cache, meta, 0.3, window=window, softcap=softcap)
        sunk = backend.attend(q, cache, meta, 0.3, window=window, softcap=softcap, sinks=none)
        if backend is CPU and HAVE_OPS:
            assert torch.equal(sunk, plain)
        else:
            torch.testing.assert_close(sunk, plain, rtol=1e-6, atol=1e-6)


# ---- a model whose layers carry sinks (the gpt-oss Attention switch), against transformers


def test_config_flag_gives_each_attention_its_sinks():
    from llmd.model.config import ModelConfig
    from llmd.model.llama import build_model

    shape = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=32, intermediate_size=8,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    names = {n: p.shape for n, p in build_model(ModelConfig(**shape, attention_sinks=True)).named_parameters()
             if "sinks" in n}
    assert names == {f"model.layers.{i}.self_attn.sinks": (4,) for i in range(2)}  # the checkpoint's names
    assert not [n for n, _ in build_model(ModelConfig(**shape)).named_parameters() if "sinks" in n]


def test_model_with_sinks_matches_transformers_gpt_oss_attention(tmp_path):
    """A tiny Qwen2 with a window-8 layer beside a global one (two KV groups, as gpt-oss alternates them), each
    layer given sink logits: our logits (prefix chunk, chunk over it, decodes past the window, on the CPU backend)
    equal transformers' Qwen2 running gpt_oss's eager attention function with the same sinks."""
    from simple_driver import SingleSequence
    from tiny_models import write_tiny_model
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    folder = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=5, sliding_window=8)
    AttentionInterface.register("gpt_oss_eager", eager_attention_forward)
    AttentionMaskInterface.register("gpt_oss_eager", eager_mask)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="gpt_oss_eager")
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    assert lm.config.layer_windows == [None, 8]
    for i, (ours, theirs) in enumerate(zip(lm.model.model.layers, ref.model.layers, strict=True)):
        sinks = torch.nn.Parameter(head_sinks(lm.config.num_attention_heads, seed=10 + i))
        ours.self_attn.sinks, theirs.self_attn.sinks = sinks, sinks
    ids = torch.randint(5, 570, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids])).logits[0]
    seq = SingleSequence(lm, max_tokens=40)
    got = torch.cat([seq.feed(ids[:11]), seq.feed(ids[11:20])] + [seq.feed([t]) for t in ids[20:]])
    assert (got - want).abs().max().item() < 1e-4
    for layer in lm.model.model.layers:
        layer.self_attn.sinks = None
    seq = SingleSequence(lm, max_tokens=40)
    assert (seq.feed(ids) - want).abs().max().item() > 1e-2  # the sinks change the logits: the check sees them


def test_the_compiled_cpu_forward_leaves_a_model_with_sinks_to_the_modules(tiny_llama):
    """The C layer stack passes no sinks (llmd.model.cpu_stack): a quantized model it would run keeps the module
    path, which passes them, once a layer has sinks."""
    from llmd.kernels import cpu_gemm
    from llmd.model.cpu_stack import CompiledCpuForward

    lm = load_model(tiny_llama, dtype=torch.float32, device="cpu", quant="int8")
    assert (CompiledCpuForward.try_build(lm.model) is not None) == cpu_gemm.available()
    lm.model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(lm.config.num_attention_heads))
    assert CompiledCpuForward.try_build(lm.model) is None
