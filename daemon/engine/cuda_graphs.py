"""CUDA graphs for decode steps, so that a step of a small model is not bound by kernel launches.

A decode step runs a few hundred small kernels; launched one by one from Python, the GPU waits on the host. A CUDA
graph records them once and replays them with one launch. What is captured: the model's forward plus the logits of a
decode-only step (every sequence adds one token) at a fixed batch size, a bucket (1, 2, 4, 8, 16, 32, capped by
max_num_seqs). A step of n sequences replays the smallest bucket >= n. Prefill chunks, speculative verifies, larger
batches and contexts past max_model_len run eagerly.

A graph replays the same kernels on the same addresses, so every per-step input lives in static buffers that are
refilled in place before each replay, with one host->device copy (`DecodeInputs`). Rows n.. of a bucket are padding:
token 0 at position 0 with a one-token context, whose K/V go to a scratch block the block manager never hands out
(the runner allocates it past the pool's last block); their logits are dropped. Nothing in the step may take a
per-step value from the host: the attention backend must be marked `cuda_graph_safe` (llmd.model.attention_backends.TritonBackend:
llmd.kernels.paged_attention sizes its grid from the bound max_model_len, which the captured metadata carries, and slices each context on the
device).

Capture is lazy, on the first step that needs a bucket: one eager warm-up forward (compiles and autotunes the
Triton kernels, fills the layers' per-dtype caches outside the graph), then the capture, both on padding rows only,
so no sequence's KV is touched. All graphs share one memory pool; that is safe because a graph's output is copied
out right after its own replay and never read after another graph ran.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..model.attention import AttentionMetadata
from ..model.attention_backends import AttentionBackend

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)

# A capture strategy: given a function that runs the step on the static buffers and returns its output tensor,
# return (replay, output): replay() recomputes the step into `output`.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """Batch sizes to capture: the buckets below min(max_num_seqs, largest bucket), then that cap itself."""
    top = max(1, min(max_num_seqs, buckets[-1]))
    return tuple(b for b in buckets if b < top) + (top,)


def pick_bucket(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds num_seqs rows, or None when the batch is too large (or empty)."""
    if num_seqs < 1:
        return None
    return next((b for b in sizes if b >= num_seqs), None)


def graph_blocker(model: torch.nn.Module, attention: AttentionBackend) -> str | None:
    """Why decode steps of this model, attending through `attention`, cannot be captured here (None: they can)."""
    if not attention.cuda_graph_safe:
        return f"the attention backend {attention.name} is not marked cuda_graph_safe"
    if (why := getattr(model, "graph_blocker", None)) is not None:  # a model whose layers need the host (Gemma)
        return why
    for module in model.modules():
        if type(module).__module__.startswith("bitsandbytes"):
            return "bitsandbytes layers choose kernels from the data (outliers) on the host"
        if (why := getattr(module, "graph_blocker", None)) is not None:  # a layer that needs the host (Experts)
            return why
    return None


def cuda_graph_capture() -> Capture:
    """The real strategy: warm up on a side stream, then record a CUDA graph into a pool shared by every capture."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out

    return capture


def eager_capture(fn):
    """Stands in for a CUDA graph where there is none (the CPU tests): replay re-runs the step eagerly, on the same
    static buffers and padding, into the same output tensor."""
    out = fn()

    def replay():
        out.copy_(fn())

    return replay, out


class DecodeInputs:
    """The static per-step inputs of a padded decode batch, in one int64 buffer so that one copy uploads them:
    [token ids | positions | cache slots | context lengths] (max_batch each), then the block tables
    [max_batch, max_blocks] row-major. `host` is its staging copy (pinned on CUDA), `device` the buffer graphs read.
    A bucket of b rows uses the first b entries of each part."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device):
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.scratch_block = scratch_block
        size = 4 * max_batch + max_batch * max_blocks
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.device = torch.zeros(size, dtype=torch.long, device=device)
        self._np = self.host.numpy()
        m = max_batch
        self._ids, self._pos, self._slots, self._lens = (self._np[i * m:(i + 1) * m] for i in range(4))
        self._tables = self._np[4 * m:].reshape(max_batch, max_blocks)
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        """Device views of a bucket's inputs: input_ids, positions, slot_mapping, seq_lens [bucket] and
        block_tables [bucket, max_blocks]."""
        m, d = self.max_batch, self.device
        return dict(input_ids=d[:bucket], positions=d[m:m + bucket], slot_mapping=d[2 * m:2 * m + bucket],
                    seq_lens=d[3 * m:3 * m + bucket],
                    block_tables=d[4 * m:4 * m + bucket * self.max_blocks].view(bucket, self.max_blocks))

    def fill(self, seqs: list, bucket: int) -> None:
        """Write the next token of each sequence (it has num_computed_tokens computed; its token at that index is
        the one this step processes) into rows 0..len-1, padding rows up to `bucket`, into the host staging buffer.
        Columns of a block-table row past its context keep older ids: the kernel never reads them."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's upload has finished reading the staging buffer
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            n_blocks = pos // bs + 1
            self._ids[i] = seq.token_ids[pos]
            self._pos[i] = pos
            self._lens[i] = pos + 1
            self._slots[i] = seq.block_ids[pos // bs] * bs + pos % bs
            self._tables[i, :n_blocks] = seq.block_ids[:n_blocks]
        n = len(seqs)
        self._ids[n:bucket] = 0
        self._pos[n:bucket] = 0
        self._lens[n:bucket] = 1
        self._slots[n:bucket] = self.scratch_block * bs
        self._tables[n:bucket, 0] = self.scratch_block

    def upload(self, bucket: int) -> None:
        """Copy the staged rows (all four vectors, the first `bucket` block-table rows) to the device buffer."""
        count = 4 * self.max_batch + bucket * self.max_blocks
        self.device[:count].copy_(self.host[:count], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


class CudaGraphRunner:
    """Captures and replays decode steps of one model over one KV pool (see the module docstring)."""

    def __init__(self, model, kv_caches: list, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, capture: Capture, attention: AttentionBackend):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = next(model.parameters()).device
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks, block_size, scratch_block, self.device)
        self.capture = capture
        self.attention = attention  # the runner's backend, which the graphs record
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.disabled: str | None = None
        self.replays = 0
        self.capture_seconds: dict[int, float] = {}  # bucket -> warm-up + capture time

    def can_run(self, scheduled: list) -> bool:
        """Whether this step is a decode-only step that fits a bucket (cheap: called every step)."""
        if self.disabled is not None or len(scheduled) > self.sizes[-1] or not scheduled:
            return False
        limit = self.max_model_len
        return all(s.num_tokens == 1 and s.seq.num_computed_tokens < limit for s in scheduled)

    def execute(self, scheduled: list) -> torch.Tensor | None:
        """Run the step through a graph; fp32 logits of the sampling rows, as ModelRunner.execute returns them.
        None when the bucket could not be captured (graphs are then off and the caller runs the step eagerly)."""
        n = len(scheduled)
        bucket = pick_bucket(n, self.sizes)
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self._capture(bucket)
            if entry is None:
                return None
        replay, logits = entry
        self.inputs.fill([s.seq for s in scheduled], bucket)
        self.inputs.upload(bucket)
        replay()
        self.replays += 1
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        if len(rows) == n:
            return logits[:n].clone()
        if not rows:
            return logits.new_empty((0, logits.shape[1]))
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))

    def _capture(self, bucket: int):
        v = self.inputs.views(bucket)
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"], seq_lens=v["seq_lens"], block_tables=v["block_tables"],
            query_start_loc=torch.arange(bucket + 1, dtype=torch.long, device=self.device),
            block_size=self.block_size, query_lens_list=[1] * bucket,
            seq_lens_list=[self.max_model_len] * bucket,  # a static bound: see AttentionMetadata
            backend=self.attention,
        )
        model, kv_caches = self.model, self.kv_caches

        def step() -> torch.Tensor:
            return model.compute_logits(model(v["input_ids"], v["positions"], kv_caches, meta))

        self.inputs.fill([], bucket)  # padding rows only: warm-up and capture touch just the scratch block
        self.inputs.upload(bucket)
        start = time.perf_counter()
        try:
            entry = self.capture(step)
        except Exception as exc:  # an op that cannot be captured: keep serving, eagerly
            self.disabled = f"capturing batch {bucket} failed: {exc!r}"
            log.warning("CUDA graphs off: %s", self.disabled)
            return None
        self.graphs[bucket] = entry
        self.capture_seconds[bucket] = time.perf_counter() - start
        log.info("captured the decode step for batch %d in %.2f s", bucket, self.capture_seconds[bucket])
        return entry
