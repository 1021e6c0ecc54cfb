"""Model runner: owns the KV pool and runs one forward per step over a flattened batch of decodes and prefill chunks.

Logits are computed only for rows that are sampled (the last token of a chunk that completes its sequence's token
list), since the vocabulary projection is the most expensive matmul of a small model.

On CUDA, attention runs through the Triton kernels (llmd.kernels), and decode-only steps of up to 32 sequences are
replayed from CUDA graphs (llmd.engine.cuda_graphs; EngineConfig.cuda_graphs, `llmd serve --no-cuda-graphs`), with
one scratch KV block past the pool's end for the padding rows. Everything else runs eagerly.

A model that mixes sliding-window and global layers (Gemma 2/3) gets two KV pools, one per KV group
(llmd.engine.block_manager): the global layers' and the window layers' caches, each with its own block ids and
scratch block, and each step's AttentionMetadata carries the window group's tables in `window_group`. The budget is
split so that the window pool holds what max_num_seqs sequences' windows can use (never more than an even split by
tokens would give it); the global pool takes the rest. (Such models run without CUDA graphs.)
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from ..model.attention import AttentionMetadata, allocate_kv_cache
from ..model.attention_backends import AttentionBackend, CpuBackend, choose_backend
from ..model.cpu_stack import CompiledCpuForward
from ..model.kv_int8 import bytes_per_token, cache_dtype
from ..model.recurrent import StateMetadata, allocate_states, layer_caches, state_bytes_per_sequence
from .config import DEFAULT_SPEC_MAX_BATCH, EngineConfig
from .cuda_graphs import Capture, CudaGraphRunner, cuda_graph_capture, graph_blocker
from .scheduler import ScheduledSeq
from .sequence import rope_positions

log = logging.getLogger(__name__)

# CPU BLAS picks another kernel (another summation order) for a matmul of fewer rows than this, so a step that pools
# embeddings is padded up to it: an input's vector is then bit-identical alone or in a batch (tests/test_embed.py).
MIN_POOLING_ROWS = 16


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       layers: Iterable[int] | None = None) -> int:
    """Bytes of one block across the layers that keep K/V (or the given ones), each with its own head shape: K and V,
    plus the int8 cache's per-token scales."""
    c = model_config
    return block_size * sum(bytes_per_token(c.layer_num_kv_heads(i), c.layer_head_dim(i), dtype, kv_cache_dtype)
                            for i in (c.kv_layers if layers is None else layers))


def layer_windows(model_config) -> list[int | None]:
    """Each KV-holding layer's sliding window (None: global attention), in the order of model_config.kv_layers."""
    windows = getattr(model_config, "layer_windows", None)
    windows = list(windows) if windows is not None else [None] * model_config.num_hidden_layers
    return [windows[i] for i in model_config.kv_layers]


def kv_group_layers(model_config) -> tuple[list[int], list[int]]:
    """The KV-holding layers of the global group and of the window group (layer indices)."""
    pairs = list(zip(model_config.kv_layers, layer_windows(model_config)))
    return [i for i, w in pairs if w is None], [i for i, w in pairs if w is not None]


def window_tokens_held(window: int, tokens: int, chunk: int, block_size: int) -> int:
    """Token slots a window layer holds for a sequence of `tokens` tokens computed in chunks of at most `chunk`:
    the blocks its window and one chunk can span (llmd.engine.block_manager.BlockManager.max_blocks_held)."""
    blocks = min(-(-tokens // block_size), (window + chunk + block_size - 2) // block_size + 2)
    return blocks * block_size


def kv_bytes_per_sequence(model_config, tokens: int, block_size: int, dtype: torch.dtype,
                          kv_cache_dtype: str = "auto", chunk: int | None = None) -> int:
    """KV bytes one sequence of `tokens` tokens holds: every layer the whole context, except that a window layer
    holds only its window (plus one chunk of `chunk` tokens, the prefill step; None: the saving is off)."""
    full = -(-tokens // block_size) * block_size
    total = 0
    for i, w in zip(model_config.kv_layers, layer_windows(model_config)):
        held = full if w is None or chunk is None else window_tokens_held(w, tokens, chunk, block_size)
        total += held * kv_bytes_per_block(model_config, 1, dtype, kv_cache_dtype, [i])
    return total


def sequences_that_fit(model_config, budget_bytes: int, block_size: int, dtype: torch.dtype,
                       tokens: int = 8192, chunk: int | None = None) -> dict[str, int]:
    """How many sequences of `tokens` tokens a KV budget holds, per KV cache dtype ("fp32", "fp16", "bf16", "int8"):
    the trade between long contexts and batch size. chunk: the prefill chunk, to count sliding-window layers at
    their window (kv_bytes_per_sequence); None counts every layer at the whole context."""
    return {kind: int(budget_bytes // kv_bytes_per_sequence(model_config, tokens, block_size, dtype, kind, chunk))
            for kind in ("fp32", "fp16", "bf16", "int8")}


def activation_headroom_bytes(model_config, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous estimate of the transient memory of one forward (kept free when sizing the pool on CUDA)."""
    elem = torch.empty((), dtype=dtype).element_size()
    c = model_config
    t = config.max_num_batched_tokens
    per_token = (4 * c.hidden_size + 3 * c.intermediate_size + 2 * c.num_attention_heads * c.head_dim) * elem
    logits = config.max_num_seqs * c.vocab_size * 4 * 3
    return 2 * t * per_token + logits + 256 * 1024**2


def _kv_budget(model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    free, _total = torch.cuda.mem_get_info(device)
    return int((free - activation_headroom_bytes(model_config, config, dtype)) * config.kv_cache_fraction)


def plan_pools(model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device,
               reserved: int = 0) -> tuple[int, int]:
    """(global pool blocks, window pool blocks): the second is 0 unless the model mixes window and global layers
    (see the module docstring); num_kv_blocks, when set, is each pool's size. reserved: bytes of the budget taken
    by a hybrid's recurrent states."""
    windows = layer_windows(model_config)
    n_window = sum(w is not None for w in windows)
    if n_window in (0, len(windows)):
        return plan_num_blocks(model_config, config, dtype, device, reserved), 0
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, config.num_kv_blocks
    global_layers, window_layers = kv_group_layers(model_config)
    per_global = kv_bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype, global_layers)
    per_window = kv_bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype, window_layers)
    budget = _kv_budget(model_config, config, dtype, device)
    budget -= min(reserved, budget // 2)  # states beyond half the budget come on top of it (plan_states)
    max_len = config.max_model_len or model_config.max_position_embeddings
    usable = config.max_num_seqs * window_tokens_held(max(w for w in windows if w is not None), max_len,
                                                      config.max_num_batched_tokens, config.block_size)
    window_bytes = min(usable // config.block_size * per_window, budget * per_window // (per_window + per_global))
    num_window = window_bytes // per_window - 1  # each pool pays for its own scratch block
    num_global = (budget - (num_window + 1) * per_window) // per_global - 1
    if num_window < 1 or num_global < 1:
        raise ValueError(f"the KV cache budget ({budget / 2**20:.0f} MiB) cannot hold two blocks in each of the "
                         "global and window layers' pools")
    return int(num_global), int(num_window)


MIN_STATES = 16  # a hybrid's state pool holds at least this many states (sequences, checkpoints, backups)


def plan_states(model_config, config: EngineConfig, dtype: torch.dtype,
                device: torch.device) -> tuple[int, int, int]:
    """(sequence slots, prefix checkpoints, speculation backups) of a hybrid model's state pool
    (llmd.engine.state_pool); zeros for a model without recurrent layers. The states take half the cache budget (at
    least MIN_STATES of them, the ones beyond half on top of it): with speculation on, a backup for each sequence that
    verifies a proposal in a step (spec_max_batch, at most); with prefix caching, a third of the rest kept for
    checkpoints (at least one: a chat's next turn restores its last); as many sequence slots as max_num_seqs asks for and the rest holds (at least one); then up to twice as
    many checkpoints as slots in what is left."""
    per = state_bytes_per_sequence(model_config, dtype)
    if per == 0:
        return 0, 0, 0
    # half the budget, or room for MIN_STATES (a recurrent state is a fixed cost per sequence: a Qwen3.5-4B's is 50 MiB,
    # and the CPU's default budget would leave a single prefix checkpoint, which a prompt's next save evicts)
    share = max(_kv_budget(model_config, config, dtype, device) // 2 // per, MIN_STATES) - 1  # less the scratch slot
    backups = min(max(1, share // 4), config.spec_max_batch or DEFAULT_SPEC_MAX_BATCH) \
        if config.speculative_mode != "off" else 0
    kept = max(1, (share - backups) // 3) if config.enable_prefix_caching else 0
    slots = max(1, min(config.max_num_seqs, share - backups - kept))
    checkpoints = min(2 * slots, max(kept, share - slots - backups)) if config.enable_prefix_caching else 0
    return slots, checkpoints, backups


def plan_num_blocks(model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                    reserved: int = 0) -> int:
    """Blocks of the KV pool: config.num_kv_blocks, else what the budget holds after `reserved` bytes (states)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype)
    budget = _kv_budget(model_config, config, dtype, device)
    budget -= min(reserved, budget // 2)  # states beyond half the budget come on top of it (plan_states)
    num = budget // per_block - 1  # the scratch block (see ModelRunner) is paid from the budget too
    if num < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) is smaller than two blocks ({per_block / 2**20:.1f} MiB "
            "each: one for sequences, one for padding rows)"
        )
    return int(num)


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig, graph_capture: Capture | None = None,
                 attention: AttentionBackend | None = None, kv_groups: bool = True):
        """graph_capture: how decode steps are captured; None picks CUDA graphs on CUDA when config.cuda_graphs
        is on (tests on CPU pass llmd.engine.cuda_graphs.eager_capture to run the same static-buffer path).
        attention: this model's attention backend; None picks it for the device (llmd.model.attention_backends).
        Each runner (a draft model's too) keeps its own. kv_groups False: one pool for every layer even in a model
        that mixes window and global layers (a draft model, whose block manager has one group)."""
        self.model = loaded.model
        self.model_config = loaded.config
        param = next(self.model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = config.block_size
        self.kv_cache_dtype = config.kv_cache_dtype
        self.layer_windows = layer_windows(self.model_config)
        # multimodal RoPE (Qwen3.5): a sequence with images on a grid gets [3, T] positions (sequence.rope_positions)
        self.mrope = getattr(self.model_config, "mrope_section", None) is not None
        # a hybrid's recurrent layers: a state per sequence slot and per prefix checkpoint, plus a scratch slot
        # (slots: [sequences][checkpoints][speculation backups][scratch])
        self.num_state_slots, self.num_state_checkpoints, backups = plan_states(self.model_config, config,
                                                                                self.dtype, self.device)
        self.state_backups = range(self.num_state_slots + self.num_state_checkpoints,
                                   self.num_state_slots + self.num_state_checkpoints + backups)
        self.state_bytes_per_seq = state_bytes_per_sequence(self.model_config, self.dtype)
        self.state_scratch_slot = self.state_backups.stop
        state_bytes = (self.state_scratch_slot + 1) * self.state_bytes_per_seq if self.num_state_slots else 0
        if kv_groups:
            self.num_blocks, self.num_window_blocks = plan_pools(self.model_config, config, self.dtype, self.device,
                                                                 state_bytes)
        else:
            self.num_blocks, self.num_window_blocks = plan_num_blocks(self.model_config, config, self.dtype,
                                                                      self.device, state_bytes), 0
        self.attention = attention or choose_backend(self.device, self.model_config, self.dtype,
                                                     config.kv_cache_dtype)
        # what runs a step: the model, or on the CPU its layers as one C call where that applies (llmd.model.llama)
        compiled = CompiledCpuForward.try_build(self.model) if isinstance(self.attention, CpuBackend) else None
        self.forward = compiled or self.model
        if self.device.type == "cuda" and graph_capture is None and config.cuda_graphs:
            graph_capture = cuda_graph_capture()
        if graph_capture is not None and self.num_window_blocks:
            log.info("CUDA graphs off: the window layers' second KV group is not captured")
            graph_capture = None
        if graph_capture is not None and self.mrope:  # the graphs' decode positions would lack the rope delta
            log.info("CUDA graphs off: multimodal RoPE positions are not captured")
            graph_capture = None
        if graph_capture is not None and (why := graph_blocker(self.model, self.attention)) is not None:
            log.info("CUDA graphs off: %s", why)
            graph_capture = None
        # the block manager hands out blocks 0..num_blocks-1; padding rows (graphs', embedding steps') write to one more
        self.scratch_block = self.num_blocks
        pool_blocks = self.num_blocks + 1
        c = self.model_config
        # per KV-holding layer, a cache of its own head shape in its group's pool (one group unless the model mixes
        # window and global layers); a layer that shares another's K/V, or a recurrent one, reads that instead
        global_layers, window_layers = kv_group_layers(c) if self.num_window_blocks else (c.kv_layers, [])
        self.window_scratch_block = self.num_window_blocks
        kv_caches = {}
        for layers, blocks in ((global_layers, pool_blocks), (window_layers, self.num_window_blocks + 1)):
            for i in layers:
                kv_caches[i] = allocate_kv_cache(1, blocks, self.block_size, c.layer_num_kv_heads(i),
                                                 c.layer_head_dim(i), dtype=self.dtype, device=self.device,
                                                 kv_cache_dtype=self.kv_cache_dtype)[0]
        self.states = allocate_states(c, self.state_scratch_slot + 1, self.dtype, self.device) \
            if self.num_state_slots else {}
        self.kv_caches = layer_caches(c, kv_caches, self.states)  # per layer: its KV cache, or its recurrent state
        self.kv_cache_bytes = pool_blocks * kv_bytes_per_block(c, self.block_size, self.dtype, self.kv_cache_dtype,
                                                               global_layers)
        n_global, n_window = len(global_layers), len(window_layers)
        if n_window:
            self.kv_cache_bytes += (self.num_window_blocks + 1) * kv_bytes_per_block(
                c, self.block_size, self.dtype, self.kv_cache_dtype, window_layers)
        self.kv_element = cache_dtype(self.kv_cache_dtype, self.dtype)  # what the pool holds
        kind = "int8 + scales" if self.kv_cache_dtype == "int8" else str(self.kv_element).removeprefix("torch.")
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB, %s)", self.num_blocks, self.block_size,
                 self.kv_cache_bytes / 2**20, kind)
        if n_window:
            log.info("KV groups: %d global layers over %d blocks, %d window layers over %d blocks", n_global,
                     self.num_blocks, n_window, self.num_window_blocks)
        self.state_cache_bytes = state_bytes
        if self.states:
            log.info("recurrent state: %d layers, %d sequence slots and %d prefix checkpoints of %.1f MiB (%.0f MiB)",
                     len(self.states), self.num_state_slots, self.num_state_checkpoints,
                     self.state_bytes_per_seq / 2**20, state_bytes / 2**20)
        # called with (scheduled, hidden [rows, H]) after each eager forward, the rows in the order of `scheduled`,
        # s.num_tokens each: the MTP draft reads the target's hidden states there (llmd.engine.spec_mtp)
        self.hidden_observer: Callable[[list[ScheduledSeq], torch.Tensor], None] | None = None
        self.graphs: CudaGraphRunner | None = None
        if graph_capture is not None:
            self.graphs = CudaGraphRunner(
                self.model, self.kv_caches, max_num_seqs=config.max_num_seqs or 32,
                max_model_len=config.max_model_len or c.max_position_embeddings, block_size=self.block_size,
                scratch_block=self.num_blocks, capture=graph_capture, attention=self.attention)
            log.info("CUDA graphs: decode steps of up to %d sequences (batch sizes %s), captured on first use",
                     self.graphs.sizes[-1], ", ".join(map(str, self.graphs.sizes)))

    def _restore_state(self, seq) -> None:
        """A prefix hit's state: copy its checkpoint into the sequence's slot before the sequence's first step."""
        if seq.restore_from is not None:
            self.copy_state(seq.restore_from, seq.state_slot)
            seq.restore_from = None

    @torch.inference_mode()
    def copy_state(self, src: int, dst: int) -> None:
        """Copy one state slot to another in every recurrent layer (a checkpoint saved or restored)."""
        for state in self.states.values():
            state.conv[dst].copy_(state.conv[src])
            state.ssm[dst].copy_(state.ssm[src])

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the batch; return fp32 logits [rows, vocab]: for each scheduled chunk that samples, its last
        `num_logits` positions (one, or 1 + k for a speculative proposal of k), in the order of `scheduled`.
        An embedding chunk (`s.pools`) gets the final hidden states of all its positions in `s.hidden` instead."""
        if self.graphs is not None and self.hidden_observer is None and not any(s.pools for s in scheduled) \
                and self.graphs.can_run(scheduled):
            logits = self.graphs.execute(scheduled)
            if logits is not None:
                return logits
        return self.execute_eager(scheduled)

    @torch.inference_mode()
    def execute_eager(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """`execute` without graphs: any mix of prefill chunks, decodes and verifies."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, window_tables, sample_rows = [], [], [], [], []
        state_slots: list[int] = []
        fresh: list[bool] = []
        image_rows: list[int] = []  # flat rows whose embeddings an image gives (llmd.model.vision)
        image_embeds: list[torch.Tensor] = []
        both_ways: dict[int, list[tuple[int, int]]] = {}  # sequence index -> its chunk's images seeing each other
        pooled: list[tuple[ScheduledSeq, int]] = []  # embedding chunks and their first row
        grid_rows: dict[int, tuple[list[int], list[int]]] = {}  # first row -> a sequence's h and w positions
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            if s.pools:
                pooled.append((s, len(input_ids)))
            for image in seq.images:  # the chunk's image positions read the image's embeddings
                lo, hi = max(image.start, start), min(image.end, start + s.num_new_tokens)
                if lo < hi:
                    image_rows.extend(range(len(input_ids) + lo - start, len(input_ids) + hi - start))
                    image_embeds.append(image.embeds[lo - image.start : hi - image.start])
                    if image.bidirectional:
                        both_ways.setdefault(len(query_lens), []).append((image.start, image.end))
            input_ids.extend(seq.token_ids[start : start + s.num_new_tokens])
            input_ids.extend(s.spec)  # a speculative proposal runs right after its decode token
            n = s.num_tokens
            if self.mrope and any(image.grid is not None for image in seq.images):
                t, h, w = rope_positions(seq.images, start, n)
                positions.extend(t)
                if h != t or w != t:  # an image's tokens in this chunk (past them, the three agree)
                    grid_rows[len(input_ids) - n] = (h, w)
            else:
                positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if self.states:
                self._restore_state(seq)
                if s.spec:  # the state before a proposal, restored if some of it is rejected (Engine._keep_verified)
                    s.state_backup = self.state_backups[sum(x.state_backup is not None for x in scheduled)]
                    self.copy_state(seq.state_slot, s.state_backup)
                state_slots.append(self.state_scratch_slot if seq.state_slot is None else seq.state_slot)
                fresh.append(start == 0)
            if self.num_window_blocks:
                window_tables.append(seq.window_blocks.ids)
            if s.samples:
                end = len(input_ids)
                sample_rows.extend(range(end - min(s.num_logits, n), end))
        if pooled and len(input_ids) < MIN_POOLING_ROWS:  # a padding query of its own, on the scratch block
            pad = MIN_POOLING_ROWS - len(input_ids)
            input_ids.extend([0] * pad)
            positions.extend(range(pad))
            query_lens.append(pad)
            seq_lens.append(pad)
            tables.append([self.scratch_block] * -(-pad // self.block_size))
            window_tables.append([self.window_scratch_block] * -(-pad // self.block_size))
            state_slots.append(self.state_scratch_slot)
            fresh.append(True)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device=self.device,
                                       backend=self.attention)
        if self.num_window_blocks:  # the window layers' own tables (their second KV group)
            meta.window_group = AttentionMetadata.build(query_lens, seq_lens, window_tables, self.block_size,
                                                        device=self.device, backend=self.attention)
        if self.states:
            meta.state = StateMetadata.build(state_slots, fresh, query_lens, self.device)
        if image_rows:
            meta.input_embeds = (torch.tensor(image_rows, dtype=torch.long, device=self.device),
                                 torch.cat(image_embeds).to(device=self.device, dtype=self.dtype))
            meta.bidirectional = both_ways or None
            if meta.window_group is not None:
                meta.window_group.bidirectional = meta.bidirectional
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if grid_rows:  # multimodal RoPE: [3, T], the (t, h, w) positions (one value for text)
            pos = pos.expand(3, -1).clone()
            for row, (h, w) in grid_rows.items():
                pos[1:, row : row + len(h)] = torch.tensor([h, w], dtype=torch.long, device=self.device)
        hidden = self.forward(ids, pos, self.kv_caches, meta)
        if self.hidden_observer is not None:
            self.hidden_observer(scheduled, hidden)
        for s, first in pooled:
            s.hidden = hidden[first : first + s.num_new_tokens].clone()
        if not sample_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
