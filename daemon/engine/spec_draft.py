"""A draft model in the same engine: its own paged KV pool, block manager and prefix cache.

Each speculating request has a DraftSeq mirroring the target sequence's tokens. A proposal round runs one batched
catch-up forward (the tokens the draft has not seen yet, usually the last accepted run) and then k-1 batched
one-token decodes; after verification the draft's KV is rolled back to the verified prefix, like the target's.
A grammar-constrained request's draft rows are masked by its grammar too (stepping the matcher through the proposal
and rolling it back), so the draft proposes only tokens the target could accept.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import LlmdError
from .block_manager import BlockManager
from .config import EngineConfig
from .grammar import step_masks
from .rejection import row_distributions
from .runner import ModelRunner
from .scheduler import ScheduledSeq

PIECE_SAMPLES = 512  # token pieces compared when checking that two tokenizers agree


class TokenizerMismatch(LlmdError):
    pass


def check_same_tokenizer(target, draft, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose token ids mean something else: vocabulary size, special tokens and sampled pieces."""
    t, d = target.tokenizer, draft.tokenizer

    def refuse(what: str):
        raise TokenizerMismatch(
            f"draft model {draft_name!r} cannot speculate for {target_name!r}: {what}; a draft must share the "
            "target's tokenizer (e.g. qwen2.5:0.5b for qwen2.5:7b, llama3.2:1b for llama3.1:8b)")

    if t is None or d is None:
        return
    if t.vocab_size != d.vocab_size:
        refuse(f"vocabulary sizes differ ({t.vocab_size} vs {d.vocab_size})")
    if set(t.eos_token_ids) != set(d.eos_token_ids):
        refuse(f"end-of-sequence tokens differ ({sorted(t.eos_token_ids)} vs {sorted(d.eos_token_ids)})")
    if t.bos_token_id != d.bos_token_id:
        refuse(f"begin-of-sequence tokens differ ({t.bos_token_id} vs {d.bos_token_id})")
    step = max(1, t.vocab_size // PIECE_SAMPLES)
    for i in list(range(0, t.vocab_size, step)) + list(range(max(0, t.vocab_size - 64), t.vocab_size)):
        if t.id_to_piece(i) != d.id_to_piece(i):
            refuse(f"token {i} is {t.id_to_piece(i)!r} in one and {d.id_to_piece(i)!r} in the other")


class _TruncatedLM(nn.Module):
    """The target's first layers plus its final norm and head: a free, weight-sharing draft (CPU demos, tests)."""

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        self.target = target
        self.num_layers = num_layers

    def forward(self, input_ids, positions, kv_caches, meta):
        if getattr(self.target, "runs_given_layers", False):  # its forward runs the first len(kv_caches) layers
            return self.target(input_ids, positions, kv_caches, meta)
        inner = self.target.model
        x, cos, sin = self.target.embed(input_ids, positions)  # the model's own (Gemma scales its embeddings)
        for layer, kv_cache in zip(list(inner.layers)[: self.num_layers], kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return inner.norm(x)

    def compute_logits(self, hidden):
        return self.target.compute_logits(hidden)


def truncated_draft(loaded, num_layers: int):
    """A LoadedModel-like draft made of the first num_layers of `loaded` (shares its weights)."""
    n = max(1, min(num_layers, loaded.config.num_hidden_layers))
    per_layer = {key: value[:n] for key in ("layer_types", "layer_head_dims", "layer_kv_heads", "kv_sources")
                 if (value := getattr(loaded.config, key, None)) is not None}  # cut with the layers
    config = dataclasses.replace(loaded.config, num_hidden_layers=n, **per_layer)
    return dataclasses.replace(loaded, model=_TruncatedLM(loaded.model, n), config=config,
                               name=f"{loaded.name}[:{n} layers]")


class DraftSeq:
    """The draft's view of one request: same token list prefix, its own KV blocks."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.embed = None  # never an embedding request (ScheduledSeq reads it)
        self.images: list = []  # the draft reads an image's placeholder tokens as text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModel:
    def __init__(self, draft_loaded, engine_config: EngineConfig, num_blocks: int):
        self.loaded = draft_loaded
        cfg = EngineConfig(block_size=engine_config.block_size, num_kv_blocks=num_blocks,
                           max_num_seqs=engine_config.max_num_seqs,
                           max_num_batched_tokens=engine_config.max_num_batched_tokens,
                           max_model_len=engine_config.max_model_len,
                           kv_cache_dtype=engine_config.kv_cache_dtype, cuda_graphs=engine_config.cuda_graphs)
        self.runner = ModelRunner(draft_loaded, cfg, kv_groups=False)  # one block table per sequence
        salt = f"draft|{draft_loaded.name}|{draft_loaded.config.architecture}|{self.runner.dtype}"
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size, engine_config.enable_prefix_caching, salt)
        self.states: dict[str, DraftSeq] = {}

    # ---- per-request state ------------------------------------------------------------------------------------
    def _state(self, seq) -> DraftSeq | None:
        st = self.states.get(seq.request_id)
        if st is None:
            st = DraftSeq(seq.token_ids)
            match = self.bm.match_prefix(seq.token_ids, seq.num_tokens - 1)
            self.bm.claim(match.block_ids)
            st.block_ids, st.block_hashes = list(match.block_ids), list(match.hashes)
            st.num_computed_tokens = match.num_blocks * self.bm.block_size
            self.states[seq.request_id] = st
        else:  # drop KV of any proposal that was dropped before verification, then mirror the target
            self.rollback(seq.request_id, seq.token_ids[: seq.num_tokens - 1])
            st.token_ids = list(seq.token_ids)
        return st

    def release(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None and st.block_ids:
            self.bm.free(st.block_ids)
            st.block_ids = []

    def rollback(self, request_id: str, verified_tokens: list[int]) -> None:
        """Keep only KV of the verified prefix (the target's tokens up to the last accepted proposal)."""
        st = self.states.get(request_id)
        if st is None:
            return
        n = len(verified_tokens)
        limit = min(st.num_computed_tokens, n)
        if st.token_ids[:limit] == verified_tokens[:limit]:  # the usual case, compared at C speed
            common = limit
        else:
            common = 0
            while common < limit and st.token_ids[common] == verified_tokens[common]:
                common += 1
        st.num_computed_tokens = common
        st.token_ids = list(verified_tokens)
        self.bm.rollback(st.block_ids, st.block_hashes, common)
        self.bm.register_full_blocks(st.block_ids, st.block_hashes, st.token_ids, common)

    # ---- proposing --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wants: list[tuple[object, int]], vocab: int) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """wants: (target sequence, k). Returns request_id -> (proposal, draft probs [k, V] or None if greedy)."""
        active = []
        for seq, k in wants:
            st = self._state(seq)
            if not self.bm.grow(st.block_ids, seq.num_tokens + k - 1):
                self.release(seq.request_id)
                continue
            active.append([seq, k, st, [], []])
        if not active:
            return {}
        # Round 0 catches up on unseen tokens; each later round feeds the previous proposal.
        stepped: dict[str, int] = {}  # tokens each request's grammar stepped through
        try:
            for r in range(max(k for _, k, *_ in active)):
                batch = [item for item in active if len(item[3]) < item[1]]
                scheduled = [ScheduledSeq(st, st.num_tokens - st.num_computed_tokens) for _, _, st, _, _ in batch]
                logits = self.runner.execute(scheduled)
                for (seq, _k, st, proposal, probs), s, row in zip(batch, scheduled, logits):
                    st.num_computed_tokens += s.num_new_tokens
                    if seq.grammar is not None:  # propose only what the grammar allows (the state follows)
                        step_masks([(seq.grammar, [])]).apply(row.unsqueeze(0))
                    # penalties must see the proposal so far: extend a view of the output
                    view = ProposalView(seq, proposal)
                    token, p = sample_draft(row, view, vocab)
                    proposal.append(token)
                    st.token_ids.append(token)
                    if p is not None:
                        probs.append(p)
                    if seq.grammar is not None and seq.grammar.step(token):
                        stepped[seq.request_id] = stepped.get(seq.request_id, 0) + 1
        finally:  # the grammar state is the output's again
            for seq, *_ in active:
                if stepped.get(seq.request_id):
                    seq.grammar.rollback(stepped[seq.request_id])
        out = {}
        for seq, k, st, proposal, probs in active:
            out[seq.request_id] = (proposal, torch.stack(probs) if probs else None)
        return out


def sample_draft(logits_row: torch.Tensor, seq, vocab: int) -> tuple[int, torch.Tensor | None]:
    """A draft's token from its logits row under the request's sampling: (token, None) when greedy, else the
    token drawn with the request's generator and the draft's distribution, aligned to the target's vocabulary."""
    dist = row_distributions(logits_row.unsqueeze(0), seq.params, seq.prompt_token_ids, seq.output_token_ids, [])
    if seq.params.greedy:
        return int(torch.argmax(dist[0][:vocab])), None
    probs = dist[0]
    if probs.numel() != vocab:  # a draft with a narrower/wider padded head: align to the target's width
        aligned = probs.new_zeros(vocab)
        w = min(vocab, probs.numel())
        aligned[:w] = probs[:w]
        probs = aligned / aligned.sum()
    return int(torch.multinomial(probs, 1, generator=seq.generator)), probs


class ProposalView:
    """A sequence as the sampler sees it after the proposal so far has been appended."""

    def __init__(self, seq, proposal: list[int]):
        self.params = seq.params
        self.generator = seq.generator
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + proposal
