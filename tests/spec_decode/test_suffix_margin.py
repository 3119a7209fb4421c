"""The realised margin of suffix decoding's "auto" gate (spec_decode/suffix_margin.py): judged drafts
move it by what they accepted against their break-even bar, clamped, halving while nothing is
judged; in the drafter, drafts that keep accepting less than the bar raise the bar the next drafts
face, drafts that accept more leave it at break-even, and get_stats() shows it."""

from __future__ import annotations

import pytest

from foretell.spec_decode.suffix_margin import HALF_LIFE, RATE, RealisedMargin
from tests.spec_decode.test_suffix_cost_gate import auto_proposer, one, teach


def test_judged_drafts_move_the_margin_within_its_bounds():
    margin = RealisedMargin(max_margin=4.0)
    margin.judge(3.0, 1, now=10)  # two short of the bar
    assert margin.value(10) == pytest.approx(2 * RATE) and margin.num_judged == 1
    margin.judge(3.0, 8, now=10)  # five over it: back to 0, not below
    assert margin.value(10) == 0.0
    for _ in range(200):
        margin.judge(3.0, 0, now=10)
    assert margin.value(10) == 4.0  # clamped at max_margin


def test_the_margin_halves_every_half_life_while_nothing_is_judged():
    margin = RealisedMargin(max_margin=9.0)
    margin.judge(5.0, 0, now=100)
    assert margin.value(100 + HALF_LIFE) == pytest.approx(0.25)
    assert margin.value(100 + 3 * HALF_LIFE) == pytest.approx(0.0625)
    margin.judge(5.0, 5, now=100 + HALF_LIFE)  # judged at par: set again from the decayed value
    assert margin.set_at == 100 + HALF_LIFE and margin.value(100 + HALF_LIFE) == pytest.approx(0.25)


def run_drafts(accept_all: bool, steps: int = 120):
    """One sequence over a 5-token loop (a match, drafts up to k = 8) under a learned bar of 2; the
    target either follows the loop (every draft accepted) or answers a token never seen."""
    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=3.0)  # break-even bar 2
    loop, fresh = [5, 6, 7, 8, 9], 10_000
    history = loop * 3
    for _ in range(steps):
        draft = proposer.propose(one(history)).token_ids[0]
        clock.now += 3e-3 if draft else 1e-3  # drafting steps cost what teach() taught
        if accept_all:
            history = history + draft + [loop[(len(history) + len(draft)) % 5]]
        else:
            history = history + [fresh]  # the draft's first token rejected
            fresh += 1
            history = history + loop  # the loop again: the match comes back
    return proposer


def test_losing_drafts_raise_the_bar_and_winning_ones_leave_it_at_break_even():
    losing = run_drafts(accept_all=False)
    stats = losing.stats()["suffix_gate"]
    assert stats["margin_judged"] > 0 and stats["margin"] > 0
    assert losing.bar > losing.break_even >= 1.0
    winning = run_drafts(accept_all=True)
    stats = winning.stats()["suffix_gate"]
    assert stats["margin_judged"] > 0 and stats["margin"] == 0.0
    assert winning.bar == pytest.approx(winning.break_even)


def test_a_fixed_bar_has_no_margin():
    from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings

    fixed = SuffixProposer(8, SuffixSettings(min_accepted_tokens=1.0))
    assert fixed.margin is None and fixed.stats() == {"suffix_gate": {"auto": False, "bar": 1.0}}
