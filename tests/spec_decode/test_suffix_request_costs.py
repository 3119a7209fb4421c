"""The suffix drafter's once-per-request work without whole-history copies (issue 29): a forgotten
sequence's response is taken from its indexed and pending tokens (SequenceState.tokens_from),
a prompt that waits unindexed is kept as handed over, and the global cache keeps one copy of a
response; against plain list slicing (the drafts and caches of lazy against eager indexing:
test_suffix_lazy_index.py)."""

from __future__ import annotations

import pytest

from foretell.spec_decode.suffix import SequenceState, SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.token_history import TokenHistory


@pytest.mark.parametrize("num_indexed, num_pending", [(0, 0), (0, 5), (6, 0), (6, 5), (1, 1)])
def test_tokens_from_is_a_slice_of_every_token_seen(num_indexed, num_pending):
    state = SequenceState(SuffixSettings(min_match_length=2))
    tokens = list(range(100, 100 + num_indexed + num_pending))
    if num_indexed:
        state.index.extend(tokens[:num_indexed])
    state.pending = tokens[num_indexed:]
    for start in range(len(tokens) + 2):
        got = state.tokens_from(start)
        assert got == tokens[start:]
        got.append(-5)  # a list of its own
        assert state.tokens == tokens


def test_a_waiting_prompt_is_kept_and_the_response_cached_once():
    proposer = SuffixProposer(4, SuffixSettings(min_match_length=2, min_accepted_tokens=0.0))
    prompt = [1, 2, 3, 4, 1, 2, 3]
    stored = prompt[:-1]
    history = TokenHistory(stored, [prompt[-1]])
    assert proposer.observe(7, history, samples=True, lookup=False) is None
    state = proposer.states[7]
    assert state.pending == prompt and state.index.tokens == []
    stored.append(99)  # the engine's list grows after the step: the drafter's copy does not
    assert state.pending == prompt
    proposer.observe(7, TokenHistory(prompt, [4, 9]), samples=True, lookup=False)
    assert state.pending == prompt + [4, 9]
    proposer.forget(7)
    assert list(proposer.cache.responses) == [[3, 4, 9]]  # from the first sampled token (history[-1]) on


def test_cache_keeps_its_own_copy_and_the_tail_of_a_long_response():
    cache = GlobalSuffixCache(2, 6, max_requests=10, max_tokens=5)
    response = [1, 2, 3]
    cache.add(response)
    response.append(4)  # the caller's list changes: the cached one does not
    cache.add((5, 6, 7, 8, 9, 10))  # not a list, longer than max_tokens: its last 5
    assert list(cache.responses) == [[6, 7, 8, 9, 10]] and cache.num_tokens == 5

