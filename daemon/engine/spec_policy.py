"""When to speculate and how far: a per-step decision from the batch size and each request's recent acceptance.

Speculation turns one weight read into several tokens when the forward is memory-bound (a lone user), but every
verified position costs compute; on a busy batch that compute is better spent on other sequences. The model used:
a step costs `1 + c * (tokens - 1)` units, an extra verified token costs `c` (plus `d` per draft-model token), and a
request whose proposals are accepted with probability a emits E(k) = (1 - a^(k+1)) / (1 - a) tokens for k
proposals. Per request the k with the best gain (E(k) - 1 tokens) minus cost (the extra step time, in tokens at the
batch's plain rate) is chosen; none when that is not positive or the batch is larger than `max_batch`.
Acceptance is tracked as a decayed count of accepted over tried proposals; a request that stopped speculating is
probed with one proposal now and then so that its estimate can recover.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8
PROBE_EVERY = 8


@dataclass
class Acceptance:
    accepted: float = 1.0  # optimistic prior: one accepted out of 1.5 tried
    tried: float = 1.5
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried else 0.0

    def update(self, num_proposed: int, num_accepted: int) -> None:
        # Proposals after the first rejection are never tested: count only the Bernoulli trials that happened.
        trials = num_accepted + (1 if num_accepted < num_proposed else 0)
        self.accepted = DECAY * self.accepted + num_accepted
        self.tried = DECAY * self.tried + trials
        self.idle_steps = 0


def expected_tokens(rate: float, k: int) -> float:
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class SpecPolicy:
    k_max: int = 4
    adaptive: bool = True  # False: always propose k_max (forced on)
    max_batch: int = 8  # no speculation when more sequences than this share a step
    verify_cost: float = 0.1  # c: cost of one extra verified token relative to a 1-token decode step
    draft_cost: float = 0.0  # d: cost of one draft-model token relative to a target decode step

    def choose_k(self, acc: Acceptance, batch_size: int, uses_draft: bool) -> int:
        if not self.adaptive:
            return self.k_max
        if batch_size > self.max_batch:
            return 0
        per_token = self.verify_cost + (self.draft_cost if uses_draft else 0.0)
        base = 1.0 + self.verify_cost * (batch_size - 1)  # plain step cost
        best_k, best = 0, 0.0
        for k in range(1, self.k_max + 1):
            gain = expected_tokens(acc.rate, k) - 1.0
            cost = per_token * k / base * batch_size  # extra time, in tokens the plain batch would make
            if gain - cost > best:
                best_k, best = k, gain - cost
        if best_k == 0:
            acc.idle_steps += 1
            if acc.idle_steps >= PROBE_EVERY:
                return 1
        return best_k
