"""The suffix index and the global suffix cache of suffix decoding against brute force: the
longest matched suffix and its occurrences by scanning, advancing a match equals scanning again,
drafts (copies, loops past the end, frequencies and min_token_prob, ties), eviction by count and
by size leaving the index a fresh build would have, bad arguments."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_tree import MAX_CANDIDATES, SEPARATOR, Match, SuffixIndex


def occurrences(store: list[int], pattern: list[int], before: int) -> list[int]:
    """Positions right after each occurrence of pattern in store that ends before `before`
    (its next token stored) and crosses no separator."""
    m = len(pattern)
    return [p for p in range(m, before) if store[p - m : p] == pattern and SEPARATOR not in store[p - m : p]]


def brute_lookup(store: list[int], context: list[int], key_length: int, max_depth: int,
                 own: bool) -> tuple[int, list[int]]:
    """The longest suffix of context (key_length .. max_depth tokens) occurring in store with a
    stored next token (not the separator; in a sequence's own store: earlier than its end), and
    where; (0, []) when none."""
    best = (0, [])
    for length in range(key_length, min(max_depth, len(context)) + 1):
        found = [p for p in occurrences(store, context[len(context) - length :], len(store))
                 if store[p] != SEPARATOR]
        if not found:
            break
        best = (length, found)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_lookup_finds_the_longest_suffix_and_all_its_occurrences(seed):
    rng = random.Random(seed)
    key_length, depth = rng.choice([(1, 4), (2, 6), (3, 8)])
    vocab = 3 if key_length > 1 else 6
    text = [rng.randrange(vocab) for _ in range(rng.randrange(5, 30))]
    whole, pieces = SuffixIndex(key_length, depth), SuffixIndex(key_length, depth)
    whole.extend(text)
    i = 0
    while i < len(text):  # appended a few tokens at a time: the same index
        step = rng.randrange(1, 5)
        pieces.extend(text[i : i + step])
        i += step
    assert (pieces.head, pieces.prev) == (whole.head, whole.prev)
    length, positions = brute_lookup(text, text, key_length, depth, own=True)
    match = whole.lookup(text)
    if len(occurrences(text, text[len(text) - key_length :], len(text))) <= MAX_CANDIDATES:
        assert (match.length, match.positions) == (length, positions)
    else:  # only the most recent occurrences of the key were followed
        assert key_length <= match.length <= length
        suffix = text[len(text) - match.length :]
        assert all(text[p - match.length : p] == suffix and p < len(text) for p in match.positions)


@pytest.mark.parametrize("seed", range(6))
def test_advance_follows_a_growing_context_like_scanning(seed):
    rng = random.Random(seed)
    index = SuffixIndex(3, 6)  # few enough occurrences that none is left out
    text = [rng.randrange(3) for _ in range(12)]
    index.extend(text)
    match = index.lookup(text)
    for _ in range(25):
        new = [rng.randrange(3) for _ in range(rng.randrange(1, 3))]
        index.extend(new)
        text += new
        match = index.advance(match, new)
        if match.positions:  # every occurrence of the matched suffix earlier than the end
            assert match.positions == occurrences(text, text[len(text) - match.length :], len(text))
            assert match.length >= 3
        else:
            match = index.lookup(text)


def test_draft_copies_one_occurrence_and_loops_past_the_end():
    span = list(range(100, 140))
    context = [1, 2] + span + [7, 8] + span[:5]
    index = SuffixIndex(3, 8)
    index.extend(context)
    match = index.lookup(context)
    assert match.length == 5 and match.positions == [2 + 5]
    tokens, score = index.draft(match, 30, 0.1)
    assert tokens == span[5:35]  # longer than the depth: a copy of the one occurrence
    assert score == pytest.approx(30.0)
    loop = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    index = SuffixIndex(2, 8)
    index.extend(loop)
    match = index.lookup(loop)
    assert index.draft(match, 7, 0.1)[0] == [7, 8, 5, 6, 7, 8, 5]  # on past the end, from the draft
    # advanced by the draft's first tokens, the match still drafts the loop
    index.extend([7, 8])
    assert index.draft(index.advance(match, [7, 8]), 4, 0.1)[0] == [5, 6, 7, 8]


def test_draft_follows_the_most_frequent_continuation_and_stops_below_min_token_prob():
    cache = GlobalSuffixCache(key_length=2, max_depth=6, max_requests=100, max_tokens=1000)
    for response in [[1, 2, 4, 5]] * 5 + [[1, 2, 4, 6]] * 4 + [[1, 2, 3]]:
        cache.add(response)
    index = cache.index
    match = index.lookup([9, 1, 2])
    assert match.length == 2 and len(match.positions) == 10
    assert index.draft(match, 4, 0.95) == ([], 0.0)  # 4 follows 9 times in 10
    tokens, score = index.draft(match, 4, 0.6)
    assert tokens == [4] and score == pytest.approx(0.9)  # then 5: 0.9 * 5 / 9 = 0.5 < 0.6
    tokens, score = index.draft(match, 4, 0.5)
    assert tokens == [4, 5] and score == pytest.approx(0.9 + 0.5)  # a response's end stops it
    # ties go to the most recent occurrence
    tie = GlobalSuffixCache(key_length=1, max_depth=4, max_requests=10, max_tokens=100)
    tie.add([3, 7, 1])
    tie.add([3, 8, 2])
    assert tie.index.draft(tie.index.lookup([3]), 2, 0.0)[0] == [8, 2]


def test_matches_do_not_cross_responses():
    cache = GlobalSuffixCache(key_length=2, max_depth=6, max_requests=10, max_tokens=100)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    assert cache.index.lookup([2, 3]).positions == []  # 3 ends its response: nothing follows
    assert cache.index.lookup([3, 4]).positions == []  # no gram spans two responses
    match = cache.index.lookup([1, 2])
    assert cache.index.draft(match, 5, 0.0)[0] == [3]


def chains(index: SuffixIndex) -> dict[int, list[int]]:
    """Every gram key's live occurrences (positions after them, oldest first), by its chain."""
    out = {}
    for key, p in index.head.items():
        positions = []
        while p >= index.start:
            positions.append(p)
            p = index.prev[p - index.base]
        out[key] = positions[::-1]
    return out


def index_as_responses(cache: GlobalSuffixCache) -> dict:
    """The cache's index with positions as (response number, offset), comparable between caches."""
    index, starts = cache.index, []
    p = index.start
    for response in cache.responses:
        starts.append(p)
        p += len(response) + 1
    def where(q):
        r = max(i for i, s in enumerate(starts) if s <= q)
        return r, q - starts[r]
    return {key: [where(q) for q in hits] for key, hits in chains(index).items()}


@pytest.mark.parametrize("seed", range(3))
def test_eviction_leaves_the_index_a_fresh_build_would_have(seed):
    rng = random.Random(seed)
    responses = [[rng.randrange(4) for _ in range(rng.randrange(1, 25))] for _ in range(12)]
    cache = GlobalSuffixCache(key_length=2, max_depth=5, max_requests=4, max_tokens=40)
    for r in responses:
        cache.add(r)
        fresh = GlobalSuffixCache(key_length=2, max_depth=5, max_requests=100, max_tokens=1000)
        for kept in cache.responses:
            fresh.add(kept)
        assert index_as_responses(cache) == index_as_responses(fresh)
        assert len(cache.index.tokens) <= 2 * (cache.num_tokens + len(cache)) + 1  # compacted
        context = [rng.randrange(4) for _ in range(6)]
        got, want = cache.index.lookup(context), fresh.index.lookup(context)
        assert got.length == want.length
        assert [cache.index.draft(got, 4, 0.0)[0]] == [fresh.index.draft(want, 4, 0.0)[0]]


def test_a_match_held_across_an_eviction_drops_the_evicted_occurrences():
    cache = GlobalSuffixCache(key_length=2, max_depth=6, max_requests=2, max_tokens=100)
    cache.add([1, 2, 3, 4])
    cache.add([1, 2, 3, 5])
    match = cache.index.lookup([1, 2])
    assert len(match.positions) == 2
    cache.add([9, 9])  # evicts [1, 2, 3, 4]
    match = cache.index.advance(match, [3])
    assert match.length == 3 and cache.index.draft(match, 3, 0.0)[0] == [5]


def test_global_cache_evicts_oldest_by_count_and_by_size():
    cache = GlobalSuffixCache(key_length=1, max_depth=4, max_requests=2, max_tokens=100)
    a, b, c = [1, 2, 3], [4, 5, 6, 7], [1, 2, 9]
    for r in (a, b, c):
        cache.add(r)
    assert list(cache.responses) == [b, c]
    by_size = GlobalSuffixCache(key_length=1, max_depth=4, max_requests=10, max_tokens=8)
    for r in (a, b, c):
        by_size.add(r)
    assert list(by_size.responses) == [b, c] and by_size.num_tokens == 7
    by_size.add(list(range(20, 40)))  # longer than the whole cache: its last 8 tokens stay
    assert list(by_size.responses) == [list(range(32, 40))]
    assert Counter(len(h) for h in chains(by_size.index).values()) == Counter({1: 7})
    by_size.add([])
    assert len(by_size) == 1
    off = GlobalSuffixCache(key_length=1, max_depth=4, max_requests=0, max_tokens=8)
    off.add(a)
    assert len(off) == 0 and not off.index.head


def test_bad_arguments():
    with pytest.raises(ValueError, match="key_length"):
        SuffixIndex(0, 4)
    with pytest.raises(ValueError, match="max_depth must be >= key_length 4"):
        SuffixIndex(4, 3)
    with pytest.raises(ValueError, match="max_requests"):
        GlobalSuffixCache(2, 4, -1, 10)
    assert SuffixIndex(2, 4).lookup([1]) == Match()
