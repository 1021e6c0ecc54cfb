"""The synchronous engine: requests in, one batched forward per step(), outputs out.

Not thread-safe by itself: one thread calls add_request/abort/step (AsyncEngine's engine thread). stats() and
prompt_progress() may be called from another thread: they only read counters (and copy small bounded windows under a
lock).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import InvalidRequest, QueueFull
from ..model.moe import moe_layers
from ..model.ops import release_cpu_threads
from .block_manager import BlockManager
from .config import EngineConfig
from .accept import accept
from .grammar import CompiledGrammar, GrammarCompiler, step_masks
from .pooling import pool
from .runner import ModelRunner, kv_bytes_per_block, sequences_that_fit
from .scheduler import Scheduler, ScheduledSeq
from .sequence import Sequence
from .state_pool import StatePool
from .stop import StopStringMatcher
from .types import (SHORT_DTYPE_NAMES, EmbedParams, EngineStats, FinishReason, ImageSpan, KvStats, LatencyStats,
                    Percentiles, Priority, PromptProgress, RequestOutput, RequestTimings, SamplingParams,
                    TokenLogprob)

LATENCY_WINDOW = 1000  # finished requests kept for percentiles
THROUGHPUT_WINDOW_S = 10.0
# a hybrid model's prompts checkpoint their recurrent state every this many tokens (and at their last full block)
CHECKPOINT_INTERVAL = 1024

log = logging.getLogger("llmd.engine")


class _TextState:
    """Incremental detokenization plus stop-string hold-back for one request."""

    def __init__(self, tokenizer, stop: list[str]):
        self.detok = None
        if tokenizer is not None:
            from ..model.tokenizer import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stop)

    def push(self, token_id: int) -> tuple[str, bool]:
        if self.detok is None:
            return "", False
        return self.matcher.feed(self.detok.push(token_id))

    def finish(self) -> tuple[str, bool]:
        """Text left at the end (a stop string may still complete in the detokenizer's tail)."""
        tail = self.detok.flush() if self.detok is not None else ""
        text, hit = self.matcher.feed(tail)
        return (text, True) if hit else (text + self.matcher.flush(), False)


class Engine:
    def __init__(self, loaded, config: EngineConfig | None = None):
        self.loaded = loaded
        self._moe_layers = moe_layers(loaded.model)  # found once: stats() is read every second by some clients
        self.tokenizer = loaded.tokenizer
        device = next(loaded.model.parameters()).device
        self.config = (config or EngineConfig()).resolved(device.type, loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded, self.config)
        self._seqs_8k = sequences_that_fit(loaded.config, self.runner.kv_cache_bytes, self.config.block_size,
                                           self.runner.dtype, chunk=self.config.max_num_batched_tokens)
        self.device = self.runner.device
        salt = f"{loaded.name}|{loaded.config.architecture}|{self.runner.dtype}"
        # sliding windows (block_manager docstring): every layer windowed -> one group that drops old blocks;
        # window and global layers mixed -> a second group for the window layers (the runner sized both pools)
        windows = [w for w in self.runner.layer_windows if w is not None]
        all_windowed = bool(windows) and len(windows) == len(self.runner.layer_windows)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, salt,
                                          window=max(windows) if all_windowed else None)
        self.window_block_manager: BlockManager | None = None
        if self.runner.num_window_blocks:
            self.window_block_manager = BlockManager(self.runner.num_window_blocks, self.config.block_size,
                                                     self.config.enable_prefix_caching, salt, window=max(windows))
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
            self.eos_token_ids -= self.tokenizer.message_end_ids  # harmony's <|end|>, whatever the config says
        # grammar-constrained output (engine/grammar.py): compiled on first use, cached
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.requests: dict[str, Sequence] = {}
        self._text: dict[str, _TextState] = {}
        self._pending_outputs: list[RequestOutput] = []  # from abort() between steps
        self._rng = random.Random(self.config.seed)
        # counters
        self.steps_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.last_batch_size = 0
        self.last_step_tokens = 0
        self.threads: int | None = None  # CPU threads of the last step, read in the thread that ran it
        self._stats_lock = threading.Lock()
        self._latencies: deque[dict] = deque(maxlen=LATENCY_WINDOW)
        self._throughput: deque[tuple[float, int]] = deque(maxlen=4096)
        self.speculator = None
        # a hybrid model's recurrent states (llmd.engine.state_pool), in slots the runner allocated
        self.state_pool = StatePool(self.runner.num_state_slots, self.runner.num_state_checkpoints) \
            if self.runner.num_state_slots else None
        if self.config.speculative_mode != "off":
            from .speculative import Speculator

            self.speculator = Speculator(loaded, self.config, self.runner.num_blocks, self.runner.dtype, self.device,
                                         self.runner)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   proposer=self.speculator, window_bm=self.window_block_manager,
                                   state_pool=self.state_pool, checkpoint_interval=CHECKPOINT_INTERVAL,
                                   max_verifies=len(self.runner.state_backups) if self.state_pool else None)

    def use_threads(self) -> None:
        """Compute the steps that the calling thread runs with config.threads CPU threads. torch's intra-op count,
        which the C kernels read as their OpenMP team size (torch.get_num_threads), belongs to each thread: the
        thread that steps (AsyncEngine's engine thread) must set it, whatever another thread set."""
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        if self.device.type == "cpu":
            self.threads = torch.get_num_threads()

    def release_threads(self) -> None:
        """The thread that steps goes idle: hand back its OpenMP worker threads (llmd.kernels.openmp: while a
        process holds more of them than it has cores, they all sleep between kernels instead of spinning)."""
        if self.device.type == "cpu":
            release_cpu_threads()

    # ---- requests ---------------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      embed: EmbedParams | None = None) -> None:
        """Raise InvalidRequest for anything that could never be served. Pure: safe from any thread."""
        if embed is not None:
            return self._check_embed(prompt_token_ids, embed)
        params.validate()
        self._check_tokens(prompt_token_ids)
        max_len = self.config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context (max_model_len) is {max_len}, "
                "which leaves no room for output", field="prompt")
        longest = min(len(prompt_token_ids) + params.max_tokens, max_len)
        chunk = self.config.max_num_batched_tokens
        wbm = self.window_block_manager
        need = self.block_manager.max_blocks_held(longest, chunk)
        if need > self.block_manager.num_blocks or (wbm is not None and
                                                    wbm.max_blocks_held(longest, chunk) > wbm.num_blocks):
            fits = self.block_manager.num_blocks * self.config.block_size
            raise InvalidRequest(
                f"the request needs up to {longest} tokens of KV cache but the pool holds only {fits}; "
                "lower max_tokens or the prompt length", field="max_tokens")

    @property
    def max_embed_tokens(self) -> int:
        """The longest input an embedding request may have: the context, or the KV pool when that is smaller."""
        pools = [self.block_manager] + ([self.window_block_manager] if self.window_block_manager else [])
        return min(self.config.max_model_len, *(bm.num_blocks * self.config.block_size for bm in pools))

    def _check_embed(self, prompt_token_ids: list[int], embed: EmbedParams) -> None:
        embed.validate()
        self._check_tokens(prompt_token_ids)
        limit = self.max_embed_tokens
        if len(prompt_token_ids) > limit:
            raise InvalidRequest(f"the input has {len(prompt_token_ids)} tokens; this model embeds at most {limit}",
                                 field="input")
        if embed.dimensions is not None and embed.dimensions > self.loaded.config.hidden_size:
            raise InvalidRequest(f"dimensions must be at most {self.loaded.config.hidden_size}", field="dimensions")

    def _check_images(self, prompt_token_ids: list[int], images: list[ImageSpan]) -> None:
        # an image's embeddings: [tokens, hidden], Qwen3-VL's DeepStack features after them (llmd.model.qwen3_vl)
        hidden, end = self.loaded.config.hidden_size * (1 + self.loaded.config.deepstack_layers), 0
        for i, image in enumerate(images):
            shape = tuple(getattr(image.embeds, "shape", ()))
            if image.start < end or image.end > len(prompt_token_ids) or shape != (image.length, hidden):
                raise InvalidRequest(f"image {i} does not fit the prompt (tokens {image.start}..{image.end}, "
                                     f"embeddings {shape})", field="images")
            if image.grid is not None and (min(image.grid) < 1 or image.grid[0] * image.grid[1] != image.length):
                raise InvalidRequest(f"image {i}'s grid {image.grid} does not hold its {image.length} tokens",
                                     field="images")
            end = image.end

    def _check_tokens(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary (size {self.vocab_size})",
                                 field="prompt")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: Priority = Priority.INTERACTIVE, arrival: float | None = None,
                    grammar: CompiledGrammar | None = None, embed: EmbedParams | None = None,
                    images: list[ImageSpan] | None = None) -> None:
        """grammar: params.constraint compiled already (AsyncEngine does it off this thread); None compiles here.
        embed: an embedding request (params are then unused): its one output carries the pooled vector.
        images: the prompt's images (llmd.model.vision), each at its placeholder tokens."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        self.check_request(prompt_token_ids, params, embed)
        matcher = None
        if params.constraint is not None:
            matcher = (grammar or self.grammars.compile(params.constraint)).matcher()
        # a request that a free running place will take does not count as waiting, even before the next step
        if self.scheduler.num_waiting - self.scheduler.free_slots >= self.config.max_queue:
            raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting)")
        timings = RequestTimings(arrival=time.monotonic() if arrival is None else arrival,
                                 num_prompt_tokens=len(prompt_token_ids))
        generator = None
        if not params.greedy and embed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self._check_images(prompt_token_ids, images or [])
        seq = Sequence(request_id, prompt_token_ids, params, priority, timings, generator, matcher, embed, images)
        self.requests[request_id] = seq
        self._text[request_id] = _TextState(self.tokenizer, params.stop)
        self.prompt_tokens_total += len(prompt_token_ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request from whatever state it is in; its final output comes with the next step()."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._pending_outputs.append(self._finish(seq, FinishReason.ABORT, time.monotonic()))
        return True

    def prompt_progress(self, request_id: str) -> PromptProgress | None:
        """How far a request's prefill has come (None: not here). Safe from another thread: a dict lookup and a few
        int reads, at worst one step old."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        t = seq.timings
        return PromptProgress(seq.num_prompt_tokens, t.num_cached_tokens,
                              min(seq.num_computed_tokens, seq.num_prompt_tokens),
                              0.0 if t.first_scheduled is None else time.monotonic() - t.first_scheduled)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        plan = self.scheduler.schedule()  # speculative proposals included (ScheduledSeq.spec)
        if plan.is_empty:
            return outputs
        if self.device.type == "cpu":
            self.threads = torch.get_num_threads()  # what this step's kernels run with (they read the same)
        now = time.monotonic()
        for s in plan.scheduled:
            if s.seq.timings.first_scheduled is None:
                s.seq.timings.first_scheduled = now
        sampled = [s for s in plan.scheduled if s.samples]
        logits = self.runner.execute(plan.scheduled)  # on CUDA the forward runs while the masks fill here
        runs, logprobs = ([], [])
        if sampled:
            masks = step_masks([(s.seq.grammar, s.spec) for s in sampled])
            runs, logprobs = accept(logits, [s.seq for s in sampled], [s.spec for s in sampled],
                                    [s.draft_probs for s in sampled], masks)
        kv_tokens = {}  # a verified proposal's tokens with KV, until the run is appended
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        for s, run in zip(sampled, runs):
            if s.spec:
                kv_tokens[id(s.seq)] = self._keep_verified(s, len(run) - 1)
        bm = self.block_manager
        now = time.monotonic()
        for s in plan.scheduled:
            seq = s.seq
            if s.pools:
                outputs += self._keep_hidden(s, now)
                continue  # an embedding's KV is dropped when it finishes: never registered in the prefix cache
            kv = seq.cache_keys(kv_tokens.get(id(seq), seq.token_ids))  # an image's tokens keyed by its pixels
            bm.register_full_blocks(seq.block_ids, seq.block_hashes, kv, seq.num_computed_tokens)
            if self.window_block_manager is not None:
                w = seq.window_blocks
                self.window_block_manager.register_full_blocks(w.ids, w.hashes, kv, seq.num_computed_tokens)
            self.scheduler.drop_out_of_window(seq)
            if self.scheduler.is_state_boundary(seq):
                self._checkpoint_state(seq)
        emitted = 0
        for s, run, lps in zip(sampled, runs, logprobs):
            before = s.seq.num_tokens
            outputs.append(self._append_tokens(s.seq, run, lps, now))
            emitted += s.seq.num_tokens - before
        self.steps_total += 1
        self.last_batch_size = len(plan.scheduled)
        self.last_step_tokens = plan.num_tokens
        self.generation_tokens_total += emitted
        with self._stats_lock:
            self._throughput.append((now, emitted))
        return outputs

    def _checkpoint_state(self, seq: Sequence) -> None:
        """Save seq's recurrent state at this prefix (its computed tokens, a block boundary) for later prefix hits."""
        n = seq.num_computed_tokens // self.config.block_size
        if len(seq.block_hashes) >= n:
            slot = self.state_pool.slot_for_checkpoint(seq.block_hashes[n - 1])
            if slot is not None:
                self.runner.copy_state(seq.state_slot, slot)

    def _keep_hidden(self, s: ScheduledSeq, now: float) -> list[RequestOutput]:
        """Keep an embedding chunk's hidden states; after the last chunk, pool them and finish the request."""
        seq = s.seq
        seq.hidden_chunks.append(s.hidden)
        if seq.num_computed_tokens < seq.num_tokens:
            return []
        vector = pool(seq.hidden_chunks, seq.embed)
        seq.hidden_chunks = []
        seq.timings.first_token = now  # the end of its prefill
        out = self._finish(seq, FinishReason.STOP, now)
        out.embedding = vector
        return [out]

    def _keep_verified(self, s: ScheduledSeq, num_accepted: int) -> list[int]:
        """Keep the KV of the accepted proposals only (the forward wrote all k); returns the tokens with KV."""
        seq, k = s.seq, len(s.spec)
        seq.num_computed_tokens += num_accepted
        self.block_manager.rollback(seq.block_ids, seq.block_hashes, seq.num_computed_tokens)
        if self.window_block_manager is not None:
            w = seq.window_blocks
            self.window_block_manager.rollback(w.ids, w.hashes, seq.num_computed_tokens)
        if s.state_backup is not None and num_accepted < k:
            # a hybrid's recurrent state has taken in every proposed token: go back to the state before the step and
            # recompute the accepted tokens next step, in one chunk with the new one (a decode step's cost on a
            # memory-bound device; the K/V they rewrite are the same)
            self.runner.copy_state(s.state_backup, seq.state_slot)
            seq.num_computed_tokens -= 1 + num_accepted
        verified = seq.token_ids + s.spec[:num_accepted]
        self.speculator.verified(seq, verified, k, num_accepted)
        seq.timings.spec_proposed += k
        seq.timings.spec_accepted += num_accepted
        return verified

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None,
                       now: float) -> RequestOutput:
        """Append a run of accepted tokens, applying EOS, stop token ids, stop strings, the grammar, max_tokens and
        the context length to every one of them: the run is cut exactly where plain decoding would have stopped."""
        t = seq.timings
        if t.first_token is None:
            t.first_token = now
        p = seq.params
        text = self._text[seq.request_id]
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            t.token_times.append(now)
            t.num_generated_tokens += 1
            seq.pending_token_ids.append(token)
            if logprobs is not None:
                seq.pending_logprobs.append(logprobs[i])
            reason, hit, stop_reason = None, False, None
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                reason = FinishReason.STOP  # the stop token's own text is not emitted
                stop_reason = token if token in p.stop_token_ids else None
            else:
                delta, hit = text.push(token)
                seq.pending_text += delta
                if hit:
                    reason, stop_reason = FinishReason.STOP, text.matcher.matched
                elif seq.grammar is not None and not seq.grammar.accept(token):  # the masks make this unreachable
                    return self._finish(seq, FinishReason.ABORT, now,
                                        error=f"token {token} broke the output's grammar: {seq.grammar.error}")
                elif seq.grammar is not None and seq.grammar.is_finished:
                    reason = FinishReason.STOP  # the grammar is complete: nothing but EOS could follow
                elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
                    reason = FinishReason.LENGTH
            if reason is not None:
                return self._finish(seq, reason, now, stopped_on_string=hit, stop_reason=stop_reason)
        return self._take_output(seq)

    def _take_output(self, seq: Sequence, **final) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            text_delta=seq.pending_text,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            **final,
        )
        seq.pending_token_ids, seq.pending_logprobs, seq.pending_text = [], [], ""
        return out

    def _finish(self, seq: Sequence, reason: FinishReason, now: float, stopped_on_string: bool = False,
                stop_reason: str | int | None = None, error: str | None = None) -> RequestOutput:
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        self.requests.pop(seq.request_id, None)
        text = self._text.pop(seq.request_id)
        if not stopped_on_string and reason is not FinishReason.ABORT:
            tail, _hit = text.finish()
            seq.pending_text += tail
        seq.finish_reason = reason
        seq.timings.finished = now
        self.requests_finished_total += 1
        self._record_latency(seq.timings)
        return self._take_output(seq, finished=True, finish_reason=reason, timings=seq.timings,
                                 stop_reason=stop_reason, error=error)

    # ---- stats ------------------------------------------------------------------------------------------------
    def _record_latency(self, t: RequestTimings) -> None:
        def ms(x):
            return None if x is None else x * 1000.0

        row = {"queue_ms": ms(t.queue_time), "prefill_ms": ms(t.prefill_time), "ttft_ms": ms(t.ttft),
               "decode_ms": ms(t.decode_time), "tpot_ms": ms(t.tpot), "e2e_ms": ms(t.e2e)}
        with self._stats_lock:
            self._latencies.append(row)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        with self._stats_lock:
            latencies = list(self._latencies)
            throughput = list(self._throughput)
        now = time.monotonic()
        recent = [(ts, n) for ts, n in throughput if ts >= now - THROUGHPUT_WINDOW_S]
        tps = 0.0
        if recent:
            span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else THROUGHPUT_WINDOW_S
            tps = sum(n for _, n in recent) / span
        queries = bm.queries_tokens
        runner = self.runner
        c = self.loaded.config
        unshared = None
        if c.kv_sources is not None:
            attending = [i for i in range(c.num_hidden_layers) if not c.is_recurrent(i)]
            unshared = kv_bytes_per_block(c, 1, runner.dtype, runner.kv_cache_dtype, attending)
        kv = KvStats(
            dtype=SHORT_DTYPE_NAMES.get(str(runner.kv_element).removeprefix("torch."), str(runner.kv_element)),
            block_size=self.config.block_size,
            bytes_per_token=kv_bytes_per_block(c, 1, runner.dtype, runner.kv_cache_dtype),
            bytes_per_token_unshared=unshared,
            cache_bytes=runner.kv_cache_bytes, blocks_total=bm.num_blocks, blocks_used=bm.num_used_blocks,
            blocks_cached=bm.num_cached_blocks, blocks_free=bm.num_free_blocks - bm.num_cached_blocks,
            seqs_8k_by_dtype=dict(self._seqs_8k), prefix_queries_tokens=queries, prefix_hits_tokens=bm.hits_tokens,
            prefix_hit_rate=bm.hits_tokens / queries if queries else 0.0, prefix_evictions=bm.evictions)
        wbm = self.window_block_manager  # the window layers' own group, in a model mixing window and global layers
        if wbm is not None:
            kv.window_blocks_total, kv.window_blocks_used = wbm.num_blocks, wbm.num_used_blocks
            kv.window_blocks_cached = wbm.num_cached_blocks
        states = self.state_pool
        if states is not None:
            kv.state_bytes_per_seq, kv.state_cache_bytes = runner.state_bytes_per_seq, runner.state_cache_bytes
            kv.state_slots, kv.state_slots_used = states.num_slots, states.num_slots - states.num_free
            kv.state_checkpoints, kv.state_checkpoints_cached = states.num_checkpoints, states.num_cached
            kv.state_checkpoint_hits = states.checkpoint_hits
        latency = LatencyStats(**{key: percentiles([r[key] for r in latencies if r[key] is not None])
                                  for key in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "e2e_ms")})
        return EngineStats(
            requests_running=self.scheduler.num_running, requests_waiting=self.scheduler.num_waiting,
            requests_finished_total=self.requests_finished_total, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, num_preemptions=self.scheduler.num_preemptions,
            steps_total=self.steps_total, last_batch_size=self.last_batch_size, last_step_tokens=self.last_step_tokens,
            tokens_per_second=tps, kv=kv, spec=self.speculator.stats() if self.speculator is not None else None,
            latency=latency, threads=self.threads, expert_hits=[m.hit_counts() for m in self._moe_layers] or None)

    def check_no_leaks(self) -> None:
        """With no live requests, every block must be free or evictable cached (raises AssertionError if not)."""
        assert not self.requests, f"requests still alive: {list(self.requests)[:5]}"
        self.block_manager.check_idle()
        if self.window_block_manager is not None:
            self.window_block_manager.check_idle()
        if self.state_pool is not None:
            self.state_pool.check_idle()
        if self.speculator is not None:
            self.speculator.check_no_leaks()


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles()
    v = sorted(values)

    def pick(q: float) -> float:
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    return Percentiles(p50=pick(0.5), p90=pick(0.9), p99=pick(0.99))


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    timings: RequestTimings | None
    stop_reason: str | int | None = None


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             priority: Priority = Priority.INTERACTIVE) -> list[GenerationResult]:
    """Run prompts to completion on an idle-or-busy engine; results in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError("give one SamplingParams, or one per prompt")
    base = f"gen-{id(prompts):x}-{time.monotonic_ns()}"
    results: dict[str, GenerationResult] = {}
    order = []
    for i, (prompt, p) in enumerate(zip(prompts, plist)):
        rid = f"{base}-{i}"
        engine.add_request(rid, prompt, p, priority)
        results[rid] = GenerationResult(rid, list(prompt), [], "", None, [] if p.logprobs is not None else None, None)
        order.append(rid)
    remaining = set(order)
    merged: dict[str, RequestOutput] = {}
    while remaining:
        for out in engine.step():
            if out.request_id not in results:
                continue
            merged[out.request_id] = merged[out.request_id].merge(out) if out.request_id in merged else out
            if out.finished:
                remaining.discard(out.request_id)
    for rid in order:
        out, r = merged[rid], results[rid]
        r.token_ids, r.text, r.finish_reason, r.timings, r.stop_reason = (
            out.new_token_ids, out.text_delta, out.finish_reason, out.timings, out.stop_reason)
        if r.logprobs is not None:
            r.logprobs = out.logprobs or []
    return [results[rid] for rid in order]
