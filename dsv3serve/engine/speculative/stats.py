"""Speculative decoding counters: rounds, draft and accepted tokens, per-position acceptance.

A *round* is one verify of a sequence that had at least one draft token. Its accept
length is the tokens it commits before any stop: accepted drafts plus the target's one
(SGLang's ``accept_length``; 1 means no draft was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv3serve.metrics import Metrics


@dataclass
class SpecStats:
    """Cumulative counters since the engine started (the engine's own view of metrics)."""

    num_steps: int
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # rounds that drafted position j
    accepted_at: list[int] = field(default_factory=list)  # rounds that accepted position j

    def __post_init__(self) -> None:
        self.drafted_at = [0] * self.num_steps
        self.accepted_at = [0] * self.num_steps

    def record(self, num_drafts: int, num_accepted: int, metrics: Metrics | None) -> None:
        """Count one sequence's verify; rounds without drafts are not counted."""
        if num_drafts == 0:
            return
        self.rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.drafted_at[j] += 1
            self.accepted_at[j] += int(j < num_accepted)
        if metrics is not None:
            metrics.spec_observe(num_drafts, num_accepted)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens committed per round (accepted drafts + 1); 0 before any round."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of rounds drafting position ``j`` whose draft ``j`` was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]
