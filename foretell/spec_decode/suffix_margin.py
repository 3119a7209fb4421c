"""The realised margin of suffix decoding's "auto" gate: what its drafts actually accepted against
the break-even bar they were admitted under, added to that bar.

The gate (suffix_gate.py) prices a drafting step from timed steps and admits a draft when its
match class expects it to accept at least the break-even bar (suffix.py's MatchCalibration; the
sequence's own average; a run going on; a probe). Those predictions can be biased: on GSM8K on
the H200 (docs/perf-log.md, the twenty-fifth GPU session) the admitted drafts accepted well under
the bars they were admitted under, so every drafting step lost, and the cheaper the steps around a
draft became the more were let through. The margin closes that loop with what the drafts
realised: after each judged draft made under a learned bar,

    margin <- clamp(margin + RATE * (break_even - accepted), 0, max_margin)

so drafts that accept less than the bar they were admitted under raise the bar the next drafts
face, and drafts that accept more lower it again, until the admitted drafts break even on average
(a stochastic approximation of the bar at which they do). A margin that stops all drafting would
never be judged again, so it halves every HALF_LIFE timed steps (the gate's interval count) and
drafting resumes, to be judged afresh.
"""

from __future__ import annotations

#: How far one judged draft moves the margin per token it fell short of (or beat) its bar.
RATE = 0.1
#: Timed steps (StepCostBar.num_intervals) over which the margin halves when nothing is judged.
HALF_LIFE = 2048


class RealisedMargin:
    """The margin (module docstring); `value(now)` at the gate's interval count `now`."""

    __slots__ = ("max_margin", "margin", "set_at", "num_judged")

    def __init__(self, max_margin: float):
        self.max_margin = max_margin  # a margin this high stops every draft (k + 1)
        self.margin = 0.0  # as last set, before its decay
        self.set_at = 0  # the interval count when it was last set
        self.num_judged = 0  # drafts judged into it

    def value(self, now: int) -> float:
        """The margin at interval count `now`, halved every HALF_LIFE intervals since it was set."""
        if self.margin == 0.0:
            return 0.0
        return self.margin * 0.5 ** (max(0, now - self.set_at) / HALF_LIFE)

    def judge(self, break_even: float, accepted: int, now: int) -> None:
        """A draft admitted under `break_even` accepted `accepted` tokens (judged at interval count now)."""
        moved = self.value(now) + RATE * (break_even - accepted)
        self.margin = min(max(moved, 0.0), self.max_margin)
        self.set_at = now
        self.num_judged += 1
