"""CUDA graphs for decode steps (llmd.engine.cuda_graphs).

On CPU: bucket choice, the static-input fill, and the whole graph path of ModelRunner with `eager_capture` (a replay
re-runs the step on the same static buffers, padding rows and output tensor) under the Triton attention backend in
the interpreter, against the eager path: same greedy tokens, same logits, only the step's slots and the scratch block
written. With CUDA (marked gpu): the same comparisons through real CUDA graphs, on a tiny Llama and on a
Llama-3-8B-shaped 2-layer model, fp and int8 KV cache.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from kernel_testing import load_kernel_module
from llmd.engine import EngineConfig, SamplingParams, generate
from llmd.engine.block_manager import BlockManager
from llmd.engine.cuda_graphs import DecodeInputs, capture_sizes, eager_capture, pick_bucket
from llmd.engine import runner as runner_module
from llmd.engine.runner import ModelRunner
from llmd.engine.scheduler import ScheduledSeq
from llmd.engine.spec_draft import DraftSeq
from llmd.model.attention import AttentionMetadata
from llmd.model.attention_backends import TRITON

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def triton_attention(monkeypatch):
    """Runners built in the test pick the CUDA attention backend (under the interpreter on CPU), as on a GPU."""
    load_kernel_module("paged_attention")
    load_kernel_module("prefill_attention")
    monkeypatch.setattr(runner_module, "choose_backend", lambda *a, **kw: TRITON)
    yield TRITON


# ---- pure parts -----------------------------------------------------------------------------------------------

def test_capture_sizes_are_capped_by_max_num_seqs():
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32)
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(1) == (1,)


def test_pick_bucket_is_the_smallest_that_fits():
    sizes = capture_sizes(20)
    for n in range(1, 21):
        b = pick_bucket(n, sizes)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert pick_bucket(21, sizes) is None and pick_bucket(0, sizes) is None


def _seq(tokens: list[int], computed: int, blocks: list[int]) -> DraftSeq:
    s = DraftSeq(tokens)
    s.num_computed_tokens, s.block_ids = computed, blocks
    return s


def test_fill_matches_the_eager_metadata_and_pads_to_the_scratch_block():
    bs, scratch = 4, 99
    inputs = DecodeInputs(max_batch=8, max_blocks=6, block_size=bs, scratch_block=scratch, device=torch.device("cpu"))
    # next positions 0, 3 (last of a block), 4 (first of a new block), 9; blocks scattered; one spare block allocated
    seqs = [_seq([7], 0, [5]), _seq([1, 2, 3, 8], 3, [2]), _seq([4] * 5, 4, [9, 3]),
            _seq(list(range(10, 20)), 9, [8, 1, 6, 0])]
    inputs.fill(seqs, bucket=8)
    inputs.upload(8)
    v = inputs.views(8)
    meta = AttentionMetadata.build([1] * 4, [s.num_computed_tokens + 1 for s in seqs],
                                   [s.block_ids[: s.num_computed_tokens // bs + 1] for s in seqs], bs)
    assert v["input_ids"][:4].tolist() == [s.token_ids[s.num_computed_tokens] for s in seqs]
    assert v["positions"][:4].tolist() == [0, 3, 4, 9]
    assert torch.equal(v["slot_mapping"][:4], meta.slot_mapping)
    assert torch.equal(v["seq_lens"][:4], meta.seq_lens)
    for i in range(4):
        n = meta.seq_lens_list[i] // bs + (meta.seq_lens_list[i] % bs > 0)
        assert torch.equal(v["block_tables"][i, :n], meta.block_tables[i, :n])
    # padding: token 0 at position 0, a one-token context in the scratch block
    assert v["input_ids"][4:].tolist() == [0] * 4 and v["positions"][4:].tolist() == [0] * 4
    assert v["seq_lens"][4:].tolist() == [1] * 4 and v["slot_mapping"][4:].tolist() == [scratch * bs] * 4
    assert v["block_tables"][4:, 0].tolist() == [scratch] * 4
    # a smaller batch in the same bucket: rows that held sequences become padding again
    inputs.fill(seqs[:1], bucket=8)
    inputs.upload(8)
    assert v["seq_lens"].tolist() == [1] * 8 and v["slot_mapping"][1:].tolist() == [scratch * bs] * 7
    assert v["slot_mapping"][0].item() == 5 * bs


def test_cpu_engine_does_not_capture(tiny_llama_loaded):
    """The option is on by default; on CPU it simply does not activate (the pool's one scratch block past the end
    is the padding rows' of embedding steps, engine/runner.py)."""
    engine = make_engine(tiny_llama_loaded, cuda_graphs=True, num_kv_blocks=64)
    assert engine.config.cuda_graphs and engine.runner.graphs is None
    assert engine.runner.kv_caches[0][0].shape[0] == 64 + 1
    out = generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY))
    assert len(out[0].token_ids) == 3


def test_backend_that_is_not_graph_safe_keeps_graphs_off(tiny_llama_loaded):
    """The default torch attention builds index tensors from host lists each step: it is never captured."""
    config = EngineConfig(num_kv_blocks=32).resolved("cpu", tiny_llama_loaded.config.max_position_embeddings)
    runner = ModelRunner(tiny_llama_loaded, config, graph_capture=eager_capture)
    assert runner.graphs is None and runner.kv_caches[0][0].shape[0] == 32 + 1


def test_settings_and_flag(monkeypatch, tmp_path):
    from llmd.config import load_settings

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("LLMD_CUDA_GRAPHS", raising=False)
    assert load_settings().cuda_graphs is True
    assert load_settings(cuda_graphs=False).cuda_graphs is False
    monkeypatch.setenv("LLMD_CUDA_GRAPHS", "off")
    assert load_settings().cuda_graphs is False
    llmd = Path(sys.executable).parent / "llmd"
    help_text = subprocess.run([str(llmd), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--no-cuda-graphs" in help_text


# ---- the graph path against the eager path ---------------------------------------------------------------------

def graph_runner(loaded, capture=None, **config) -> ModelRunner:
    """A ModelRunner whose decode steps go through graphs: real CUDA graphs on CUDA, eager_capture on CPU."""
    config.setdefault("num_kv_blocks", 96)
    resolved = EngineConfig(**config).resolved(loaded.device.type, loaded.config.max_position_embeddings)
    if capture is None and loaded.device.type != "cuda":
        capture = eager_capture
    runner = ModelRunner(loaded, resolved, graph_capture=capture)
    assert runner.graphs is not None
    return runner


class DecodeHarness:
    """Sequences decoding on one runner, every step through the eager path and then the graph path on the same
    inputs (teacher-forced with the eager greedy token). The pool's free list is shuffled, so block tables are
    scattered, and sequences join and leave between steps, so rows change blocks between replays."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.rng = random.Random(seed)
        self.bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        every = self.bm.allocate(runner.num_blocks)
        self.rng.shuffle(every)
        self.bm.free(every)
        self.seqs: list[DraftSeq] = []
        self.buckets: set[int] = set()

    def add(self, prompt_len: int) -> None:
        vocab = self.runner.model_config.vocab_size
        seq = DraftSeq([self.rng.randrange(1, vocab) for _ in range(prompt_len)])
        seq.block_ids = self.bm.allocate(self.bm.blocks_needed(prompt_len))
        logits = self.runner.execute_eager([ScheduledSeq(seq, prompt_len)])
        seq.num_computed_tokens = prompt_len
        seq.token_ids.append(int(logits[0].argmax()))
        self.seqs.append(seq)

    def drop(self, *indices: int) -> None:
        for i in sorted(indices, reverse=True):
            self.bm.free(self.seqs.pop(i).block_ids)

    def scheduled(self) -> list[ScheduledSeq]:
        for seq in self.seqs:
            need = self.bm.blocks_needed(seq.num_tokens) - len(seq.block_ids)
            if need > 0:
                seq.block_ids.extend(self.bm.allocate(need))
        return [ScheduledSeq(seq, 1) for seq in self.seqs]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        scheduled = self.scheduled()
        graphs = self.runner.graphs
        assert graphs.can_run(scheduled)
        eager = self.runner.execute_eager(scheduled)
        replays = graphs.replays
        graph = self.runner.execute(scheduled)
        assert graphs.replays == replays + 1, "the step did not go through a graph"
        self.buckets.add(pick_bucket(len(scheduled), graphs.sizes))
        for seq, row in zip(self.seqs, eager):
            seq.num_computed_tokens += 1
            seq.token_ids.append(int(row.argmax()))
        return eager, graph


def assert_same_logits(graph: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: equal up to summation order, same greedy token. bf16/fp16: per row within bf16 rounding of the
    computation (relative L2 error), and the same greedy token wherever eager's top-2 margin is clear of the
    largest difference."""
    assert graph.shape == eager.shape and graph.dtype == eager.dtype == torch.float32
    rel = ((graph - eager).norm(dim=-1) / eager.norm(dim=-1)).max().item()
    if dtype == torch.float32:
        assert rel < 1e-5, rel
        assert torch.equal(graph.argmax(-1), eager.argmax(-1))
        return
    assert rel < 2e-2, rel
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (graph - eager).abs().amax(dim=-1)
    assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])


def run_scenario(runner: ModelRunner, dtype: torch.dtype, long_prompt: int = 0, wide: int = 0) -> set[int]:
    """Growing contexts across block boundaries, batches that shrink and grow across buckets; returns the buckets
    replayed. long_prompt: one more sequence with that context (split-KV slices on GPU); wide: a step at that
    batch size."""
    h = DecodeHarness(runner)
    for n in (5, 15, 31):
        h.add(n)
    for _ in range(3):  # 3 rows in bucket 4; the 31-token context crosses into its third block
        assert_same_logits(*h.step(), dtype)
    h.add(1)
    h.add(long_prompt or 47)
    for _ in range(3):  # 5 rows in bucket 8
        assert_same_logits(*h.step(), dtype)
    h.drop(0, 2, 3)  # 2 rows: the others' blocks go back to the pool and are handed out again below
    for _ in range(2):
        assert_same_logits(*h.step(), dtype)
    h.drop(0)
    for _ in range(10):  # one row (the 47-token prompt's), growing over a block boundary
        assert_same_logits(*h.step(), dtype)
    h.add(9)  # joins on blocks freed above
    assert_same_logits(*h.step(), dtype)
    if wide:
        while len(h.seqs) < wide:
            h.add(h.rng.randrange(1, 40))
        assert_same_logits(*h.step(), dtype)
    return h.buckets


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graph_path_matches_eager_step_by_step(tiny_llama_loaded, triton_attention, kv_cache_dtype):
    # max_model_len 128: the interpreter runs one program per split, and a grid sized for 128 tokens has one
    runner = graph_runner(tiny_llama_loaded, kv_cache_dtype=kv_cache_dtype, max_model_len=128)
    assert run_scenario(runner, torch.float32) == {1, 2, 4, 8}
    assert set(runner.graphs.graphs) == {1, 2, 4, 8}


def _slots_written(before, after) -> set[tuple[int, int]]:
    changed = (before != after).flatten(2).any(-1)  # [blocks, block_size]
    return {tuple(x) for x in changed.nonzero().tolist()}


def check_graph_step_writes_only_its_slots(runner: ModelRunner) -> None:
    h = DecodeHarness(runner, seed=1)
    for n in (3, 16, 20):
        h.add(n)
    scheduled = h.scheduled()
    bs, scratch = runner.block_size, runner.num_blocks
    mine = {(s.seq.block_ids[s.seq.num_computed_tokens // bs], s.seq.num_computed_tokens % bs) for s in scheduled}
    before = [t.clone() for t in runner.kv_caches[-1][:2]]  # K and V of the last layer (int8 values for int8)
    runner.execute(scheduled)  # first use of bucket 4: warm-up and capture on padding rows, then the replay
    assert runner.graphs.replays == 1
    for old, new in zip(before, runner.kv_caches[-1][:2]):
        written = _slots_written(old, new)
        assert mine <= written and written - mine <= {(scratch, 0)}, written


def test_graph_step_writes_only_its_slots_and_the_scratch_block(tiny_llama_loaded, triton_attention):
    check_graph_step_writes_only_its_slots(graph_runner(tiny_llama_loaded, max_model_len=128))


def engine_tokens(loaded, prompts, params, graphs: bool, capture=None, **config):
    engine = make_engine(loaded, cuda_graphs=graphs, **config)
    if capture is not None or (graphs and loaded.device.type != "cuda"):  # the graph path on CPU: graph_runner
        engine.runner = ModelRunner(loaded, engine.config, graph_capture=capture or eager_capture)
    results = generate(engine, prompts, params)
    return engine, [r.token_ids for r in results], [[lp.logprob for lp in r.logprobs] for r in results]


def test_engine_greedy_tokens_identical_with_graphs(tiny_llama_loaded, triton_attention, kv_cache_dtype="auto"):
    """Five requests that finish at different lengths (the batch shrinks through buckets 8, 4, 2, 1) with chunked
    prefills in between (eager steps): the same tokens and logprobs as without graphs. (The int8 cache goes through
    the graph path step by step above, and through the engine on GPU.)"""
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 40, 17, 9, 25)]
    params = [SamplingParams(max_tokens=m, logprobs=0, **GREEDY) for m in (12, 4, 9, 6, 2)]
    kw = dict(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, max_model_len=128)
    _, want, want_lp = engine_tokens(tiny_llama_loaded, prompts, params, graphs=False, **kw)
    engine, got, got_lp = engine_tokens(tiny_llama_loaded, prompts, params, graphs=True, **kw)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert a == pytest.approx(b, abs=1e-4)
    graphs = engine.runner.graphs
    assert graphs.replays >= 5 and set(graphs.graphs) == {1, 2, 4, 8}
    assert engine.runner.attention is TRITON and graphs.attention is TRITON


def test_failed_capture_falls_back_to_eager(tiny_llama_loaded, triton_attention):
    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    prompts, params = [[5, 9, 11], [7, 7]], SamplingParams(max_tokens=5, logprobs=0, **GREEDY)
    _, want, _ = engine_tokens(tiny_llama_loaded, prompts, params, graphs=False, max_model_len=128)
    engine, got, _ = engine_tokens(tiny_llama_loaded, prompts, params, graphs=True, capture=broken, max_model_len=128)
    assert got == want
    graphs = engine.runner.graphs
    assert "capturing batch 2 failed" in graphs.disabled and graphs.replays == 0 and not graphs.graphs


# ---- CUDA ------------------------------------------------------------------------------------------------------

LLAMA3_8B_2_LAYERS = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                          intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def llama3_shaped():
    """A random-weight Llama-3-8B-shaped model with 2 layers, bf16 on CUDA."""
    from llmd.model.config import ModelConfig
    from llmd.model.loader import LoadedModel
    from llmd.model.weights import build_empty

    config = ModelConfig(**LLAMA3_8B_2_LAYERS)
    model = build_empty(config, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02, generator=gen)
    return LoadedModel(model, None, config, "llama3-8b-2-layers", torch.bfloat16, torch.device("cuda"), 0.0)


@pytest.fixture(scope="module")
def tiny_llama_cuda(tiny_llama):
    from llmd.model.loader import load_model

    return {dtype: load_model(tiny_llama, dtype=dtype, device="cuda") for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture
def reset_attention():
    yield  # (each ModelRunner keeps its own backend: nothing to restore)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tiny_llama_graphs_match_eager(tiny_llama_cuda, reset_attention, dtype, kv_cache_dtype):
    runner = graph_runner(tiny_llama_cuda[dtype], kv_cache_dtype=kv_cache_dtype, num_kv_blocks=160)
    assert run_scenario(runner, dtype, wide=32) == {1, 2, 4, 8, 32}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_gpu_llama3_shaped_graphs_match_eager(llama3_shaped, reset_attention, kv_cache_dtype):
    """Real head shapes (32 query heads on 8 KV heads, head_dim 128), a 600-token context (split-KV slices inside
    the graph, whose grid is sized for 8192 tokens) and a step at batch 16."""
    runner = graph_runner(llama3_shaped, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256)
    assert run_scenario(runner, torch.bfloat16, long_prompt=600, wide=16) == {1, 2, 4, 8, 16}


@pytest.mark.gpu
def test_gpu_graph_step_writes_only_its_slots(tiny_llama_cuda, reset_attention):
    check_graph_step_writes_only_its_slots(graph_runner(tiny_llama_cuda[torch.float32]))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_gpu_engine_greedy_tokens_identical(tiny_llama_cuda, reset_attention, kv_cache_dtype):
    """fp32 on CUDA, engine with graphs (the default) vs --no-cuda-graphs: the same tokens, logprobs within 1e-4."""
    loaded = tiny_llama_cuda[torch.float32]
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 40, 17, 9, 25, 60, 2)]
    params = [SamplingParams(max_tokens=m, logprobs=0, **GREEDY) for m in (40, 4, 12, 7, 2, 30, 21)]
    kw = dict(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64)
    off, want, want_lp = engine_tokens(loaded, prompts, params, graphs=False, **kw)
    assert off.runner.graphs is None
    on, got, got_lp = engine_tokens(loaded, prompts, params, graphs=True, **kw)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert a == pytest.approx(b, abs=1e-4)
    # the decode-only steps hold 6, 5, 4, 3, 2 and 1 sequences (37 steps): buckets 8, 4, 2, 1
    assert on.runner.graphs.replays >= 30 and set(on.runner.graphs.graphs) == {1, 2, 4, 8}
