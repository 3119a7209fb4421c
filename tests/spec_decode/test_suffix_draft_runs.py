"""SuffixIndex's slice fast paths against the token-at-a-time loops they replace, kept here as the
references: draft (every occurrence going on with the same tokens taken at once: the same drafts
and scores) on sequences' own stores (loops past the end) and on the global cache (separators,
evicted occurrences, frequencies, ties, min_token_prob); lookup (an occurrence extended backwards
to the full depth by one slice compare: the same match) on repetitive stores."""

from __future__ import annotations

import random

import pytest

from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_tree import MAX_CANDIDATES, SEPARATOR, Match, SuffixIndex


def reference_draft(index: SuffixIndex, match: Match, max_tokens: int, min_token_prob: float):
    """The walk one token at a time (the drafter's before the run fast path)."""
    tokens, base, end = index.tokens, index.base, index.end
    positions = [p for p in match.positions if p >= index.start]
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while positions and len(draft) < max_tokens:
        if len(positions) == 1:
            copied = index._copy(positions[0], max_tokens - len(draft), draft)
            score += prob * copied
            break
        counts: dict[int, int] = {}
        newest: dict[int, int] = {}
        for rank, p in enumerate(positions):
            t = tokens[p - base] if p < end else (draft[p - end] if p - end < len(draft) else SEPARATOR)
            if t != SEPARATOR:
                counts[t] = counts.get(t, 0) + 1
                newest[t] = rank
        if not counts:
            break
        total = sum(counts.values())
        choice = max(counts, key=lambda t: (counts[t], newest[t]))
        prob *= counts[choice] / total
        if prob < min_token_prob:
            break
        draft.append(choice)
        score += prob
        positions = [p + 1 for p in positions
                     if (tokens[p - base] if p < end else (draft[p - end] if p - end < len(draft) - 1 else SEPARATOR))
                     == choice]
    return draft, score


def repetitive(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Tokens that repeat a few phrases with random edits: long common runs that branch."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    out: list[int] = []
    while len(out) < length:
        phrase = list(rng.choice(phrases))
        if rng.random() < 0.3:
            phrase[rng.randrange(len(phrase))] = rng.randrange(vocab)
        out += phrase
    return out[:length]


@pytest.mark.parametrize("seed", range(12))
def test_own_store_drafts_equal_the_token_walk(seed):
    rng = random.Random(seed)
    index = SuffixIndex(2, 12)
    context = repetitive(rng, 300, vocab=6 + seed)
    index.extend(context)
    checked = 0
    for cut in range(20, len(context), 7):
        match = index.lookup(context[:cut])
        if not match.positions:
            continue
        for max_tokens, min_prob in ((16, 0.1), (5, 0.0), (40, 0.5), (3, 1.0), (8, 1.5)):
            assert index.draft(match, max_tokens, min_prob) == reference_draft(index, match, max_tokens, min_prob)
            checked += 1
    # the context's own end: occurrences that run into it draft on from the draft itself
    match = index.lookup(context)
    for max_tokens in (1, 16, 64):
        assert index.draft(match, max_tokens, 0.1) == reference_draft(index, match, max_tokens, 0.1)
    assert checked > 20


@pytest.mark.parametrize("seed", range(8))
def test_global_cache_drafts_equal_the_token_walk(seed):
    rng = random.Random(100 + seed)
    cache = GlobalSuffixCache(key_length=2, max_depth=10, max_requests=6, max_tokens=10_000)
    base = repetitive(rng, 40, vocab=5)
    for _ in range(10):  # evicts the oldest: occurrences below the index's start are skipped
        response = list(base[: rng.randint(5, 40)])
        for _ in range(rng.randint(0, 3)):
            response[rng.randrange(len(response))] = rng.randrange(5)
        cache.add(response)
    index = cache.index
    for cut in range(3, 40, 3):
        match = index.lookup(base[:cut])
        for max_tokens, min_prob in ((16, 0.1), (30, 0.0), (4, 0.6)):
            assert index.draft(match, max_tokens, min_prob) == reference_draft(index, match, max_tokens, min_prob)


def test_a_common_run_stops_at_a_separator_and_at_a_branch():
    cache = GlobalSuffixCache(key_length=2, max_depth=6, max_requests=100, max_tokens=1000)
    for response in [[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2, 3, 4]] * 2 + [[1, 2, 3, 4, 5, 7]]:
        cache.add(response)
    index = cache.index
    match = index.lookup([9, 1, 2])
    assert len(match.positions) == 6
    taken: list[int] = []
    run, after = index._agreed_run(match.positions, 16, taken)  # 3, 4 by all; two end, then 5 by 4
    assert (run, taken, len(after)) == (3, [3, 4, 5], 4)  # then 6 and 7 branch
    tokens, score = index.draft(match, 16, 0.0)
    assert (tokens, score) == reference_draft(index, match, 16, 0.0)
    assert tokens[:3] == [3, 4, 5]  # 4 of 6 go on with 5 (two end), then 6 beats 7 (3 to 1)
    assert tokens == [3, 4, 5, 6]


def reference_lookup(index: SuffixIndex, context: list[int]) -> Match:
    """The lookup extending each occurrence backwards a token at a time (before the slice path)."""
    m, n = index.key_length, len(context)
    if n < m:
        return Match()
    p = index.head.get(index.gram_key(context[n - m :]), -1)
    if p < index.start:
        return Match()
    tokens, prev, base, start = index.tokens, index.prev, index.base, index.start
    low = start - base
    best_length, best = 0, []
    for _ in range(MAX_CANDIDATES):
        if p < start:
            break
        length, q, c = m, p - m - 1 - base, n - m - 1
        while length < index.max_depth and q >= low and c >= 0 and tokens[q] == context[c]:
            length, q, c = length + 1, q - 1, c - 1
        if length > best_length:
            best_length, best = length, [p]
        elif length == best_length:
            best.append(p)
        p = prev[p - base]
    best.reverse()
    return Match(best_length, best) if best else Match()


@pytest.mark.parametrize("seed", range(8))
def test_lookup_equals_the_token_loop_on_repetitive_stores(seed):
    rng = random.Random(200 + seed)
    context = repetitive(rng, 400, vocab=4 + seed)
    index = SuffixIndex(2, 6 + 3 * seed)
    index.extend(context)
    for cut in range(2, len(context), 5):
        got, ref = index.lookup(context[:cut]), reference_lookup(index, context[:cut])
        assert (got.length, got.positions) == (ref.length, ref.positions)
    cache = GlobalSuffixCache(key_length=2, max_depth=8, max_requests=4, max_tokens=10_000)
    for _ in range(7):  # evictions: the walk stops at the index's start
        cache.add(repetitive(rng, rng.randint(5, 60), vocab=3))
    for cut in range(2, 60, 4):
        query = context[:cut]
        got, ref = cache.index.lookup(query), reference_lookup(cache.index, query)
        assert (got.length, got.positions) == (ref.length, ref.positions)
