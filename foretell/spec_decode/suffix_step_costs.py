"""BucketCosts: one batch-size bucket's recent step intervals for suffix decoding's "auto" gate
(spec_decode/suffix_gate.py's StepCostBar, whose docstring says what the drafting, fallback and
plain intervals are and why a low quantile of each is its cost), and the ratio t_draft / t_plain
the gate's bar comes from.
"""

from __future__ import annotations

from collections import deque

from foretell.spec_decode.cost_buckets import SlidingQuantile, low_quantile


class BucketCosts:
    """One batch-size bucket's recent drafting, fallback and plain step seconds (module docstring)."""

    __slots__ = ("quantile", "min_samples", "draft", "plain", "fallback", "draft_s", "plain_s", "fallback_s", "run_length", "num_draft",
                 "explored_at", "drafted_at", "ratio", "plain_stale")

    def __init__(self, window: int, quantile: float, min_samples: int):
        self.quantile = quantile  # a kind's cost: this quantile of its last `window` intervals
        self.min_samples = min_samples  # intervals of a kind before its cost is known
        self.draft = SlidingQuantile(window)
        self.plain = SlidingQuantile(window)
        self.fallback: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, its run's m)
        self.draft_s: float | None = None  # the quantiles, None until min_samples intervals
        self.plain_s: float | None = None
        self.fallback_s: float | None = None
        self.run_length = 1.0  # drafting intervals per timed fallback (its runs' mean m)
        self.num_draft = 0  # drafting intervals recorded in all
        self.explored_at: int | None = None  # num_draft at the last exploration
        self.drafted_at = 0  # StepCostBar.num_intervals at the last drafting interval
        self.ratio: float | None = None  # t_draft / t_plain, None until both are known (kept by _update)
        self.plain_stale = False  # plain intervals added since plain_s (and ratio) were worked out

    def add(self, seconds: float, drafted: bool) -> None:
        """A drafting interval (draft_s and ratio worked out now), or a plain one: only stored,
        plain_s and ratio are worked out by settle_plain (or the next _update). A plain interval
        comes with most steps and the bar is read on fewer (StepCostBar.quiet_step reads none)."""
        if not drafted:
            self.plain.append(seconds)
            self.plain_stale = True
            return
        self.num_draft += 1
        self.draft.append(seconds)
        if len(self.draft) >= self.min_samples:
            self.draft_s = self.draft.quantile(self.quantile)
            self._update()

    def settle_plain(self) -> bool:
        """plain_s (and ratio) from the plain intervals stored so far; whether the ratio changed."""
        self.plain_stale = False
        plain = self.plain
        if len(plain) < self.min_samples:
            return False
        plain_s = plain.quantile(self.quantile)
        if plain_s == self.plain_s:
            return False
        self.plain_s = plain_s
        before = self.ratio
        self._update()
        return self.ratio != before

    def add_fallback(self, seconds: float, run_length: int) -> None:
        """A fallback interval, after a run of run_length drafting intervals."""
        self.fallback.append((seconds, run_length))
        if len(self.fallback) >= self.min_samples:
            self.fallback_s = low_quantile([f for f, _ in self.fallback], self.quantile)
            self.run_length = sum(m for _, m in self.fallback) / len(self.fallback)
            self._update()

    def forget_drafting(self) -> None:
        """Drop the drafting and fallback costs (stale: module docstring)."""
        self.draft.clear()
        self.fallback.clear()
        self.draft_s = self.fallback_s = None
        self.run_length = 1.0
        self.ratio = None

    @property
    def charged_draft_s(self) -> float | None:
        """t_draft: a drafting interval plus its share of the fallback's excess over a plain step
        (D + (F - P) / m), D alone before min_samples fallbacks; None until D is known."""
        if self.draft_s is None or self.fallback_s is None or self.plain_s is None:
            return self.draft_s
        return self.draft_s + (self.fallback_s - self.plain_s) / self.run_length

    def _update(self) -> None:
        """ratio after a cost changed (an attribute: the gate reads it every step)."""
        if self.plain_stale:
            self.settle_plain()  # (which calls this again)
            return
        if self.draft_s is None or not self.plain_s:  # (a plain step timed at 0 s: a coarse clock)
            self.ratio = None
        else:
            self.ratio = self.charged_draft_s / self.plain_s
