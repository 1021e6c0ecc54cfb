"""Speculative decoding: the proposers (prompt lookup, a draft model), when to use them (SpecPolicy), and the
acceptance counts.

The speculator is the scheduler's `Proposer`: while the scheduler plans a step, it asks for guesses for the decodes
that have their slot (engine/scheduler.py), and each guess rides in that sequence's ScheduledSeq. The engine scores
the proposals and the bonus position in the same forward as the other sequences' decodes and prefill chunks,
accepts a prefix (one acceptance path for every row, engine/accept.py), rolls the KV back to the verified length,
and calls `verified` here so the acceptance estimate and the draft model's own KV follow.

Modes: off; ngram (prompt lookup, always on); draft (draft model, always on); auto (adaptive: prompt lookup first,
the draft model when lookup finds nothing and a draft is configured; per step and per request the policy decides
whether to speculate and how far, and switches itself off on a busy batch or at low acceptance).

A grammar-constrained request proposes first what its grammar forces (llguidance's fast-forward tokens: a JSON key
and its quotes and colon, say) when there is any, else prompt lookup. Its point-mass proposals (prompt lookup,
greedy drafts) are cut at the first token its grammar rejects: such a token could never be accepted, and cutting
changes nothing in the output (a point mass rejected leaves the target's own distribution as the residual). A draft
model's rows are masked by the grammar too (spec_draft.py), so its sampled proposals stay inside it as well.
"""

from __future__ import annotations

import logging

import torch

from .config import DEFAULT_SPEC_MAX_BATCH, EngineConfig
from .scheduler import Proposal
from .sequence import Sequence
from .spec_ngram import ngram_propose
from .spec_policy import Acceptance, SpecPolicy
from .types import SpecStats

log = logging.getLogger(__name__)

MTP = "mtp"  # draft_model: the target's own multi-token-prediction head (llmd.engine.spec_mtp)


def _flops_per_token(config) -> float:
    c = config
    layer = 4 * c.hidden_size * c.num_attention_heads * c.head_dim + 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * layer + c.vocab_size * c.hidden_size


def load_draft(loaded, spec, dtype: torch.dtype, device: torch.device):
    """The draft as a LoadedModel: given loaded, 'self:N' (the target's first N layers), or a model name/path."""
    from .spec_draft import truncated_draft

    if hasattr(spec, "model") and hasattr(spec, "config"):
        return spec
    if isinstance(spec, str) and spec.startswith("self:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"draft model {spec!r}: use self:N with N the number of target layers to keep") from None
        return truncated_draft(loaded, n)
    from ..model.loader import load_model

    return load_model(spec, dtype=dtype, device=str(device))


class Speculator:
    """Proposes (the scheduler's Proposer), and learns from what the engine verified."""

    def __init__(self, loaded, cfg: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device,
                 runner=None):
        """runner: the target's ModelRunner (the MTP draft reads its hidden states)."""
        from ..model.qwen3_5_mtp import has_mtp_head
        from .spec_draft import DraftModel, check_same_tokenizer
        from .spec_mtp import MtpDraft

        self.mode = cfg.speculative_mode
        self.max_model_len = cfg.max_model_len
        self.vocab_size = loaded.config.vocab_size
        self.draft: DraftModel | MtpDraft | None = None
        draft_cost = 0.0
        mtp = cfg.draft_model == MTP or (cfg.draft_model is None and has_mtp_head(loaded))
        if mtp and self.mode in ("draft", "auto"):
            if runner is None:
                raise ValueError("the MTP draft needs the target's runner (its hidden states)")
            self.draft = MtpDraft(loaded, cfg, num_blocks, runner)
            c = loaded.config  # one attention layer, the fc and the head, in target forwards (+ a forward's fixed cost)
            head = 4 * c.hidden_size * c.num_attention_heads * c.head_dim + 3 * c.hidden_size * c.intermediate_size \
                + 2 * c.hidden_size ** 2 + c.vocab_size * c.hidden_size
            draft_cost = head / _flops_per_token(c) + (0.02 if device.type == "cuda" else 0.05)
            log.info("speculative decoding: draft %s's MTP head, k=%d", loaded.name, cfg.num_speculative_tokens)
        elif cfg.draft_model is not None and self.mode in ("draft", "auto"):
            draft_loaded = load_draft(loaded, cfg.draft_model, dtype, device)
            check_same_tokenizer(loaded, draft_loaded, loaded.name, draft_loaded.name)
            if draft_loaded.config.recurrent is not None:
                raise ValueError(f"draft model {draft_loaded.name!r} has recurrent layers, whose state a draft cannot "
                                 "roll back yet: use a draft without them, or speculative mode ngram")
            self.draft = DraftModel(draft_loaded, cfg, num_blocks)
            log.info("speculative decoding: draft %s, k=%d", draft_loaded.name, cfg.num_speculative_tokens)
        if self.mode == "draft" and self.draft is None:
            raise ValueError("speculative_mode 'draft' needs a draft model (--draft MODEL, or --draft mtp for a "
                             "model with a multi-token-prediction head)")
        cuda = device.type == "cuda"
        if isinstance(self.draft, DraftModel):
            ratio = _flops_per_token(self.draft.loaded.config) / _flops_per_token(loaded.config)
            draft_cost = ratio + (0.02 if cuda else 0.05)  # plus the fixed cost of one more (small) forward
        self.policy = SpecPolicy(
            k_max=cfg.num_speculative_tokens, adaptive=self.mode == "auto",
            max_batch=cfg.spec_max_batch if cfg.spec_max_batch is not None else DEFAULT_SPEC_MAX_BATCH,
            verify_cost=0.03 if cuda else 0.1, draft_cost=draft_cost)
        self.acceptance: dict[str, Acceptance] = {}
        self.num_drafts_total = 0  # verify runs
        self.proposed_total = 0
        self.accepted_total = 0

    # ---- propose ----------------------------------------------------------------------------------------------
    def propose(self, decodes: list[Sequence], budget: int, load: int) -> dict[str, Proposal]:
        if self.mode == "off":
            return {}
        # Load is every request in the engine, not just this step's batch: while a burst is still being
        # prefilled, few sequences are scheduled, but speculating then only delays the rest.
        batch_size = max(len(decodes), load)
        if self.policy.adaptive and batch_size > self.policy.max_batch:
            return {}  # busy: do not even look for proposals
        proposals: dict[str, Proposal] = {}
        want_draft = []
        for seq in decodes:
            if budget <= 0:
                break
            room = min(self.policy.k_max, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1, budget)
            if room <= 0:
                continue
            acc = self.acceptance.setdefault(seq.request_id, Acceptance())
            use_draft = self.draft is not None and self.mode != "ngram"
            k = min(room, self.policy.choose_k(acc, batch_size, use_draft))
            if k <= 0:
                continue
            if self.mode in ("ngram", "auto"):
                tokens = seq.grammar.forced_tokens(k) if seq.grammar is not None else []
                tokens = tokens or _within_grammar(seq, ngram_propose(seq.token_ids, k))
                if tokens:
                    proposals[seq.request_id] = Proposal(tokens)
                    budget -= len(tokens)
                    continue
            if use_draft:
                want_draft.append((seq, k))
                budget -= k
        if want_draft:
            by_id = {seq.request_id: seq for seq, _ in want_draft}
            for rid, (tokens, probs) in self.draft.propose(want_draft, self.vocab_size).items():
                if probs is None:
                    tokens = _within_grammar(by_id[rid], tokens)
                if tokens:
                    proposals[rid] = Proposal(tokens, probs)
        return proposals

    # ---- after verification -----------------------------------------------------------------------------------
    def verified(self, seq: Sequence, verified_tokens: list[int], num_proposed: int, num_accepted: int) -> None:
        """The engine verified a proposal: the sequence's tokens with KV are now `verified_tokens`."""
        if self.draft is not None:
            self.draft.rollback(seq.request_id, verified_tokens)
        self.acceptance.setdefault(seq.request_id, Acceptance()).update(num_proposed, num_accepted)
        self.num_drafts_total += 1
        self.proposed_total += num_proposed
        self.accepted_total += num_accepted

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)

    def check_no_leaks(self) -> None:
        if self.draft is not None:
            assert not self.draft.states, f"draft states still alive: {list(self.draft.states)[:5]}"
            self.draft.bm.check_idle()

    def stats(self) -> SpecStats:
        drafts = self.num_drafts_total
        return SpecStats(
            mode=self.mode, proposed_total=self.proposed_total, accepted_total=self.accepted_total, drafts_total=drafts,
            acceptance_rate=self.accepted_total / self.proposed_total if self.proposed_total else 0.0,
            mean_accepted_length=self.accepted_total / drafts if drafts else 0.0)


def _within_grammar(seq: Sequence, tokens: list[int]) -> list[int]:
    """The proposal up to the first token the request's grammar rejects (all of it when unconstrained)."""
    if seq.grammar is None or not tokens:
        return tokens
    return tokens[: seq.grammar.valid_prefix_len(tokens)]
