"""Adaptive draft length (DESIGN §5): how many tokens to draft for a sequence this round.

Each sequence keeps an exponential moving average of acceptance per draft position: p_i, the
chance that draft i is accepted given that drafts 1..i-1 were. A draft of k tokens then yields
E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i tokens per verify pass of k + 1 rows, and the policy picks
the k that maximises E(k) / cost(k + 1), where `cost` is the verify-cost table of the device
(time of a pass with that many rows per sequence, relative to one row). Row counts that the
table says are slower than some longer one are never chosen (drafting more would be free).

A sequence whose acceptance made drafting not worth it is probed again: after `probe_every` rounds
without a draft it drafts once at the best positive length (the one its estimates rate highest), so
acceptance that recovers (the text turns repetitive, say) is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Relative cost of a pass with r rows per sequence, r = 1, 2, ... (index r - 1); beyond the table the
# last step's slope continues. The CPU default is the embedded model's, measured on this project's 2-core CPU
# machine (`deltaspec bench verify --rows 1,2,3,4,5,6,7,8,10,12,14,16 --device cpu --context 128`: 1.43 at 2 rows,
# 1.52 at 4, 1.69 at 8, 2.19 at 16) and smoothed: a verify pass costs 1.43 one-row passes at 2 rows (the speculative
# path's fixed work), then 5 % more per row. A CUDA device's table comes from its own measured verify costs.
DEFAULT_CPU_COSTS = tuple([1.0] + [round(1.43 + 0.05 * (rows - 2), 2) for rows in range(2, 17)])


@dataclass
class VerifyCostTable:
    costs: tuple[float, ...] = DEFAULT_CPU_COSTS

    def cost(self, rows: int) -> float:
        if rows <= len(self.costs):
            return self.costs[rows - 1]
        slope = self.costs[-1] - self.costs[-2] if len(self.costs) > 1 else 0.0
        return self.costs[-1] + slope * (rows - len(self.costs))

    def allowed(self, max_k: int) -> list[int]:
        """Draft lengths 0..max_k whose pass is not slower than the pass of some longer allowed draft."""
        return [
            k
            for k in range(max_k + 1)
            if all(self.cost(k + 1) < self.cost(longer + 1) for longer in range(k + 1, max_k + 1))
        ]


@dataclass
class DraftLengthPolicy:
    max_k: int
    table: VerifyCostTable = field(default_factory=VerifyCostTable)
    decay: float = 0.7  # weight of the past in the moving average
    prior: float = 0.8  # acceptance assumed before a position has been observed
    probe_every: int = 16  # rounds without a draft after which a sequence drafts once anyway
    ema: dict[str, list[float]] = field(default_factory=dict)
    idle: dict[str, int] = field(default_factory=dict)  # rounds since the sequence last drafted

    def choose(self, seq_id: str, budget: int) -> int:
        """Draft length for this round, at most `budget` (and `max_k`)."""
        limit = min(self.max_k, budget)
        if limit <= 0:
            return 0
        p = self.ema.get(seq_id, [])
        best_k, best_rate, expected, reach = 0, 1.0 / self.table.cost(1), 1.0, 1.0
        probe_k, probe_rate = 0, 0.0
        allowed = set(self.table.allowed(limit))
        for k in range(1, limit + 1):
            reach *= p[k - 1] if k <= len(p) else self.prior
            expected += reach
            rate = expected / self.table.cost(k + 1)
            if k in allowed and rate > best_rate:
                best_k, best_rate = k, rate
            if k in allowed and rate > probe_rate:
                probe_k, probe_rate = k, rate
        if best_k == 0:
            self.idle[seq_id] = self.idle.get(seq_id, 0) + 1
            if self.idle[seq_id] < self.probe_every:
                return 0
            best_k = probe_k
        self.idle[seq_id] = 0
        return best_k

    def update(self, seq_id: str, drafted: int, accepted: int) -> None:
        """Fold one round in: positions 1..accepted were accepted, position accepted+1 (if drafted) was not."""
        p = self.ema.setdefault(seq_id, [])
        for i in range(min(drafted, accepted + 1)):
            if i == len(p):
                p.append(self.prior)
            p[i] = self.decay * p[i] + (1 - self.decay) * (1.0 if i < accepted else 0.0)

    def forget(self, seq_id: str) -> None:
        self.ema.pop(seq_id, None)
        self.idle.pop(seq_id, None)


@dataclass
class FixedDraftLength:
    """Always `k` draft tokens (within the budget): for benchmarks that time a given verify row count."""

    k: int

    def choose(self, seq_id: str, budget: int) -> int:
        return max(min(self.k, budget), 0)

    def update(self, seq_id: str, drafted: int, accepted: int) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass
