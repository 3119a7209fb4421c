"""What a suffix draft is expected to accept, by the length of the match it comes from (issue 29).

A sequence's running average of accepted drafts predicts its next draft poorly (it moves on
drafted steps only, and one draft accepted whole lifts it over the bar); the length of the match
a draft comes from predicts it well (on GSM8K drafts from short matches accept far less than those
from long ones: the figures are in docs/perf-log.md, session 10's CPU work). So under a
learned "auto" bar (suffix.py, suffix_gate.py) each draft is held to its class: the share of
drafted tokens the class's last CALIBRATION_WINDOW judged drafts accepted, times the draft's
length, must reach the bar; one held draft in PROBE_EVERY goes out anyway, which keeps the share
current. Pure Python.
"""

from __future__ import annotations

from collections import deque

CALIBRATION_WINDOW = 32  # judged drafts a match-length class keeps (its share of drafted tokens accepted)
MIN_CALIBRATION = 4  # judged drafts a class needs before its share gates a draft
PROBE_EVERY = 8  # a class expected below the bar still proposes one of this many of its drafts


class MatchCalibration:
    """What a draft is expected to accept, by the length of the match it comes from: per class
    (a match of key_length to 2 key_length - 1 tokens, up to 4 key_length - 1, longer), the share of
    drafted tokens the last CALIBRATION_WINDOW judged drafts of the class had accepted; a draft's
    expectation is that share times its length (module docstring, the acceptance gate)."""

    NUM_CLASSES = 3

    def __init__(self, key_length: int):
        self.key_length = max(1, key_length)
        self.judged: list[deque[tuple[int, int]]] = [deque(maxlen=CALIBRATION_WINDOW) for _ in range(self.NUM_CLASSES)]
        self.sums = [[0, 0] for _ in range(self.NUM_CLASSES)]  # per class: accepted, drafted tokens in the window
        self.skipped = [0] * self.NUM_CLASSES  # drafts not proposed since the class's last probe

    def class_of(self, match_length: int) -> int:
        return min(self.NUM_CLASSES - 1, max(0, (match_length // self.key_length).bit_length() - 1))

    def expected(self, match_length: int, length: int) -> float | None:
        """Tokens a draft of `length` from a match of match_length is expected to accept; None
        before its class has MIN_CALIBRATION judged drafts."""
        c = self.class_of(match_length)
        if len(self.judged[c]) < MIN_CALIBRATION:
            return None
        accepted, drafted = self.sums[c]
        return length * accepted / drafted

    def expected_in_all(self, drafts) -> float:
        """Tokens a batch's drafts (Draft or TreeDraft: .token_ids, .match_length, .depth, .score)
        are expected to accept together: each one's class expectation, its own empirical score
        before its class is calibrated (the batch-wide gate, SuffixProposer._draft_batch)."""
        total = 0.0
        for draft in drafts:
            if draft.token_ids:
                calibrated = self.expected(draft.match_length, draft.depth)
                total += draft.score if calibrated is None else calibrated
        return total

    def probe(self, match_length: int) -> bool:
        """Whether a draft expected below the bar is proposed anyway (one in PROBE_EVERY)."""
        c = self.class_of(match_length)
        self.skipped[c] += 1
        if self.skipped[c] >= PROBE_EVERY:
            self.skipped[c] = 0
            return True
        return False

    def add(self, match_length: int, accepted: int, length: int) -> None:
        c = self.class_of(match_length)
        window, sums = self.judged[c], self.sums[c]
        if len(window) == window.maxlen:
            old_accepted, old_length = window[0]
            sums[0] -= old_accepted
            sums[1] -= old_length
        window.append((accepted, length))
        sums[0] += accepted
        sums[1] += length
