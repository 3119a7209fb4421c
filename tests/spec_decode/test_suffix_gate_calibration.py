"""The "auto" gate's per-draft check (spec_decode/suffix_calibration.py's MatchCalibration, used by suffix.py): a draft is
expected to accept its match-length class's recent share of drafted tokens times its length; under
a learned bar a draft expected below it is not proposed (one in PROBE_EVERY is, and one right after
a draft accepted whole), without pausing the sequence. Held to a reference computed from the
window by hand; in the drafter, short-match drafts that keep failing stop while long-match ones go on."""

from __future__ import annotations

import pytest

from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_calibration import CALIBRATION_WINDOW, MIN_CALIBRATION, PROBE_EVERY, MatchCalibration
from foretell.spec_decode.suffix_tree import Draft


def test_classes_double_from_the_key_length():
    cal = MatchCalibration(4)
    assert [cal.class_of(n) for n in (0, 3, 4, 7, 8, 15, 16, 100)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert MatchCalibration(0).key_length == 1  # (a bad key length cannot divide by zero)


def test_the_expectation_is_the_window_share_times_the_length():
    cal = MatchCalibration(4)
    judged = [(1, 3), (0, 3), (3, 3), (2, 3)] + [(0, 2)] * (CALIBRATION_WINDOW - 1)
    for i, (accepted, length) in enumerate(judged):
        cal.add(5, accepted, length)
        window = judged[max(0, i + 1 - CALIBRATION_WINDOW) : i + 1]
        want = None if i + 1 < MIN_CALIBRATION else 4 * sum(a for a, _ in window) / sum(n for _, n in window)
        assert cal.expected(6, 4) == (None if want is None else pytest.approx(want))
    assert cal.expected(8, 4) is None  # another class: nothing judged yet


def test_one_draft_in_probe_every_of_a_failing_class_is_proposed():
    cal = MatchCalibration(4)
    assert [cal.probe(5) for _ in range(2 * PROBE_EVERY)] == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    assert not cal.probe(20)  # classes count apart


def proposer_with_bar(bar: float) -> SuffixProposer:
    proposer = SuffixProposer(3, SuffixSettings(min_accepted_tokens="auto"))
    proposer.bar = bar
    return proposer


def test_a_draft_of_a_failing_class_waits_for_its_probe():
    proposer = proposer_with_bar(1.5)
    for _ in range(MIN_CALIBRATION):
        proposer.calibration.add(5, 0, 3)  # short matches: nothing accepted
        proposer.calibration.add(12, 3, 3)  # longer ones: everything
    short, long = Draft([1, 2, 3], 5, 3.0), Draft([1, 2, 3], 12, 3.0)
    assert all(proposer._expected_to_pay(long) for _ in range(3 * PROBE_EVERY))
    assert [proposer._expected_to_pay(short) for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [True]


def test_not_calibrated_classes_draft():
    proposer = proposer_with_bar(2.0)
    assert proposer._expected_to_pay(Draft([1, 2, 3], 5, 3.0))
    assert SuffixProposer(3, SuffixSettings(min_accepted_tokens=1.0)).calibration is None  # a fixed bar: no classes


def test_the_judge_calibrates_the_draft_s_class():
    proposer = proposer_with_bar(0.5)
    from foretell.spec_decode.suffix import SequenceState

    state = SequenceState(proposer.settings)
    state.last_draft, state.last_match_length = [7, 8, 9], 9
    proposer._judge(state, [7, 8, 1, 2], 10)  # two accepted, then the target's own
    assert list(proposer.calibration.judged[1]) == [(2, 3)] and not state.run_going
    state.last_draft, state.last_match_length = [7, 8], 9
    proposer._judge(state, [7, 8, 1], 13)
    assert state.run_going  # accepted whole: the next draft is not held to its class
