"""Speculative decoding counters: drafts, draft tokens, accepted tokens, per position, and the
distribution of accepted counts; with the derived acceptance rate and mean acceptance length.

mean_acceptance_length = 1 + accepted / drafts (the target's own token counts once per verify),
the per-position rate is accepted_at_position / drafts (unconditional), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_count_histogram: list[int] = field(default_factory=list)  # index a: verifies that accepted a

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.accepted_count_histogram = self.accepted_count_histogram or [0] * (k + 1)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if num_accepted >= len(self.accepted_count_histogram):  # a verify past k: grammar-forced drafts
            grow = num_accepted + 1 - len(self.accepted_count_histogram)
            self.accepted_per_position.extend([0] * grow)
            self.accepted_count_histogram.extend([0] * grow)
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1
        self.accepted_count_histogram[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": self.per_position_rates(),
            "accepted_count_histogram": list(self.accepted_count_histogram),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }

    def log_line(self) -> str:
        total = sum(self.accepted_count_histogram) or 1
        dist = "/".join(f"{100 * c / total:.0f}" for c in self.accepted_count_histogram)
        counts = "/".join(str(i) for i in range(len(self.accepted_count_histogram)))
        return (
            f"spec: acceptance {100 * self.acceptance_rate:.1f}%, mean length "
            f"{self.mean_acceptance_length:.2f}, accepted {counts} = {dist}%"
        )
