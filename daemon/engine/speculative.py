"""Speculative decoding inside the engine's step: propose, verify in the same batched forward, roll back.

Per step, after the scheduler has planned the batch, `propose` picks the decoding sequences that speculate this step
(SpecPolicy), gets k proposals for each (prompt lookup or the draft model), appends them to the sequence's token
list and widens its chunk to 1 + k positions with 1 + k logits rows: the target then scores every proposal and the
bonus position in the same forward as the other sequences' plain decodes and prefill chunks. `verify` accepts a
prefix (rejection.py), resets num_computed_tokens to the verified length, frees the blocks past it, registers only
fully verified blocks in the prefix cache, and hands the emitted tokens one at a time to the engine's normal
stop/EOS/max_tokens logic, which cuts the run exactly where plain decoding would have stopped.

Modes: off; ngram (prompt lookup, always on); draft (draft model, always on); auto (adaptive: prompt lookup first,
the draft model when lookup finds nothing and a draft is configured; per step and per request the policy decides
whether to speculate and how far, and switches itself off on a busy batch or at low acceptance).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .rejection import greedy_verify, rejection_sample, row_distributions
from .sampler import top_logprobs
from .spec_ngram import ngram_propose
from .spec_policy import Acceptance, SpecPolicy

log = logging.getLogger(__name__)

MODES = ("off", "ngram", "draft", "auto")


@dataclass
class Proposal:
    base_len: int  # the sequence's token count before the proposal was appended
    tokens: list[int]
    draft_probs: torch.Tensor | None  # [k, V] for sampled requests with a draft model; None = point mass


def _flops_per_token(config) -> float:
    c = config
    layer = 4 * c.hidden_size * c.num_attention_heads * c.head_dim + 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * layer + c.vocab_size * c.hidden_size


def load_draft(engine, spec):
    """The draft as a LoadedModel: given loaded, 'self:N' (the target's first N layers), or a model name/path."""
    from .spec_draft import truncated_draft

    if hasattr(spec, "model") and hasattr(spec, "config"):
        return spec
    if isinstance(spec, str) and spec.startswith("self:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"draft model {spec!r}: use self:N with N the number of target layers to keep") from None
        return truncated_draft(engine.loaded, n)
    from ..model.loader import load_model

    return load_model(spec, dtype=engine.runner.dtype, device=str(engine.device))


class Speculator:
    def __init__(self, engine):
        from .spec_draft import DraftModel, check_same_tokenizer

        cfg = engine.config
        self.engine = engine
        self.mode = cfg.speculative_mode
        self.draft: DraftModel | None = None
        if cfg.draft_model is not None and self.mode in ("draft", "auto"):
            draft_loaded = load_draft(engine, cfg.draft_model)
            check_same_tokenizer(engine.loaded, draft_loaded, engine.loaded.name, draft_loaded.name)
            self.draft = DraftModel(draft_loaded, cfg, engine.runner.num_blocks)
            log.info("speculative decoding: draft %s, k=%d", draft_loaded.name, cfg.num_speculative_tokens)
        if self.mode == "draft" and self.draft is None:
            raise ValueError("speculative_mode 'draft' needs a draft model (--draft MODEL)")
        cuda = engine.device.type == "cuda"
        draft_cost = 0.0
        if self.draft is not None:
            ratio = _flops_per_token(self.draft.loaded.config) / _flops_per_token(engine.loaded.config)
            draft_cost = ratio + (0.02 if cuda else 0.05)  # plus the fixed cost of one more (small) forward
        self.policy = SpecPolicy(
            k_max=cfg.num_speculative_tokens, adaptive=self.mode == "auto",
            max_batch=cfg.spec_max_batch if cfg.spec_max_batch is not None else 8,
            verify_cost=0.03 if cuda else 0.1, draft_cost=draft_cost)
        self.acceptance: dict[str, Acceptance] = {}
        self.num_drafts_total = 0  # verify runs
        self.proposed_total = 0
        self.accepted_total = 0

    # ---- propose ----------------------------------------------------------------------------------------------
    def propose(self, plan, budget: int) -> dict[str, Proposal]:
        if self.mode == "off":
            return {}
        # Load is every request in the engine, not just this step's batch: while a burst is still being
        # prefilled, few sequences are scheduled, but speculating then only delays the rest.
        sched = self.engine.scheduler
        batch_size = max(len(plan.scheduled), sched.num_running + sched.num_waiting)
        if self.policy.adaptive and batch_size > self.policy.max_batch:
            return {}  # busy: do not even look for proposals
        engine = self.engine
        max_len = engine.config.max_model_len
        proposals: dict[str, Proposal] = {}
        want_draft = []
        by_id = {}
        for s in plan.scheduled:
            seq = s.seq
            if budget <= 0:
                break
            if not (s.samples and s.num_new_tokens == 1):
                continue  # prefill chunks do not speculate
            room = min(self.policy.k_max, seq.params.max_tokens - seq.num_output_tokens - 1,
                       max_len - seq.num_tokens - 1, budget)
            if room <= 0:
                continue
            acc = self.acceptance.setdefault(seq.request_id, Acceptance())
            use_draft = self.draft is not None and self.mode != "ngram"
            k = min(room, self.policy.choose_k(acc, batch_size, use_draft))
            if k <= 0:
                continue
            by_id[seq.request_id] = s
            if self.mode in ("ngram", "auto"):
                tokens = ngram_propose(seq.token_ids, k)
                if tokens:
                    proposals[seq.request_id] = Proposal(seq.num_tokens, tokens, None)
                    budget -= len(tokens)
                    continue
            if use_draft:
                want_draft.append((seq, k))
                budget -= k
        if want_draft:
            for rid, (tokens, probs) in self.draft.propose(want_draft, engine.vocab_size).items():
                proposals[rid] = Proposal(by_id[rid].seq.num_tokens, tokens, probs)
        bm = engine.block_manager
        for rid in list(proposals):
            s, prop = by_id[rid], proposals[rid]
            seq = s.seq
            k = len(prop.tokens)
            need = bm.blocks_needed(seq.num_computed_tokens + 1 + k) - len(seq.block_ids)
            if need > 0 and bm.can_allocate(need):
                seq.block_ids.extend(bm.allocate(need))
            else:  # never preempt for a guess: use only the slots already held
                k = min(k, len(seq.block_ids) * bm.block_size - seq.num_computed_tokens - 1)
            if k <= 0:
                del proposals[rid]
                continue
            prop.tokens = prop.tokens[:k]
            if prop.draft_probs is not None:
                prop.draft_probs = prop.draft_probs[:k]
            seq.token_ids.extend(prop.tokens)
            s.num_new_tokens = 1 + k
            s.num_logits = 1 + k
        return proposals

    # ---- verify -----------------------------------------------------------------------------------------------
    def verify(self, scheduled, samples: list[bool], logits: torch.Tensor, proposals: dict[str, Proposal],
               now: float) -> tuple[torch.Tensor, list, int]:
        """Verify every speculating sequence. Returns the logits rows of the plain sampled sequences (in order),
        the speculating sequences' outputs, and how many tokens they emitted."""
        plain_rows, outputs, emitted = [], [], 0
        row = 0
        for s, samp in zip(scheduled, samples):
            if not samp:
                continue
            prop = proposals.get(s.seq.request_id)
            if prop is None:
                plain_rows.append(row)
                row += 1
                continue
            k = len(prop.tokens)
            out, n = self._verify_one(s.seq, prop, logits[row : row + k + 1], now)
            row += k + 1
            emitted += n
            if out is not None:
                outputs.append(out)
        index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index), outputs, emitted

    def _verify_one(self, seq, prop: Proposal, rows: torch.Tensor, now: float):
        engine = self.engine
        params = seq.params
        base, k = prop.base_len, len(prop.tokens)
        dist = row_distributions(rows, params, seq.prompt_token_ids, seq.token_ids[seq.num_prompt_tokens : base],
                                 prop.tokens, seq.generator)
        if params.greedy:
            accepted, run = greedy_verify(dist, prop.tokens)
        else:
            drafted = torch.tensor([prop.tokens], dtype=torch.long, device=rows.device)
            probs = None if prop.draft_probs is None else prop.draft_probs.unsqueeze(0).to(dist.dtype)
            num, toks = rejection_sample(dist.unsqueeze(0), probs, drafted, seq.generator)
            accepted = int(num[0])
            run = toks[0, : accepted + 1].tolist()
        # KV: the forward wrote base + k positions; only base + accepted hold verified tokens.
        verified = base + accepted
        del seq.token_ids[verified:]
        seq.num_computed_tokens = verified
        bm = engine.block_manager
        bm.rollback(seq.block_ids, seq.block_hashes, verified)
        bm.register_full_blocks(seq.block_ids, seq.block_hashes, seq.token_ids, verified)
        if self.draft is not None:
            self.draft.rollback(seq.request_id, seq.token_ids)
        del seq.token_ids[base:]  # the run is re-appended token by token through the normal stop logic
        self.acceptance.setdefault(seq.request_id, Acceptance()).update(k, accepted)
        seq.timings.spec_proposed += k
        seq.timings.spec_accepted += accepted
        self.num_drafts_total += 1
        self.proposed_total += k
        self.accepted_total += accepted
        engine.spec_proposed_total = self.proposed_total
        engine.spec_accepted_total = self.accepted_total
        lps = None
        if params.logprobs is not None:
            lps = torch.log_softmax(rows.float(), dim=-1)
        outs = []
        for j, token in enumerate(run):
            lp = top_logprobs(lps[j], token, params.logprobs) if lps is not None else None
            out = engine._append_token(seq, token, lp, now)
            outs.append(out)
            if out.finished:
                break
        return _merge(outs), len(outs)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)

    def check_no_leaks(self) -> None:
        if self.draft is not None:
            assert not self.draft.states, f"draft states still alive: {list(self.draft.states)[:5]}"
            self.draft.bm.check_idle()

    def stats(self) -> dict:
        drafts = self.num_drafts_total
        return {
            "spec_mode": self.mode,
            "spec_num_drafts_total": drafts,
            "spec_acceptance_rate": self.accepted_total / self.proposed_total if self.proposed_total else 0.0,
            "spec_mean_accepted_length": self.accepted_total / drafts if drafts else 0.0,
        }


def _merge(outs: list):
    """One RequestOutput for a run of tokens emitted in the same step."""
    if not outs:
        return None
    first = outs[0]
    for o in outs[1:]:
        first.new_token_ids = first.new_token_ids + o.new_token_ids
        first.text_delta += o.text_delta
        if o.logprobs is not None:
            first.logprobs = (first.logprobs or []) + o.logprobs
        first.finished, first.finish_reason, first.timings = o.finished, o.finish_reason, o.timings
        first.error = o.error
    return first
