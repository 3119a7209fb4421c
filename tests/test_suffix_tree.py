"""The suffix trie and the global suffix cache of suffix decoding against brute force: counts by
scanning every sequence, the most frequent continuation, eviction by count and by size."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_tree import SuffixTrie


def brute_counts(sequences: list[list[int]], max_depth: int) -> tuple[Counter, Counter]:
    """count[s]: occurrences of substring s (len <= max_depth); out[s]: those followed by a
    token (and len < max_depth: the trie stores no deeper node)."""
    count, out = Counter(), Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for length in range(1, min(max_depth, len(seq) - start) + 1):
                s = tuple(seq[start : start + length])
                count[s] += 1
                if length < max_depth and start + length < len(seq):
                    out[s] += 1
    return count, out


def trie_counts(trie: SuffixTrie) -> tuple[Counter, Counter]:
    count, out = Counter(), Counter()
    paths = {0: ()}
    stack = [0]
    children: dict[int, list[tuple[int, int]]] = {}
    for key, child in trie.edges.items():
        parent, token = divmod(key, 1 << 24)
        children.setdefault(parent, []).append((token, child))
    while stack:
        node = stack.pop()
        for token, child in children.get(node, []):
            paths[child] = paths[node] + (token,)
            count[paths[child]] = trie.count[child]
            if trie.out[child]:
                out[paths[child]] = trie.out[child]
            stack.append(child)
    return count, out


def random_sequences(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, length))] for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_counts_match_scanning_and_appending_equals_inserting(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5])
    sequences = random_sequences(rng, 4, 30, 3)
    whole, pieces = SuffixTrie(depth), SuffixTrie(depth)
    for seq in sequences:
        whole.insert(seq)
        active, i = [0], 0
        while i < len(seq):  # the same sequence appended a few tokens at a time
            step = rng.randrange(1, 5)
            active = pieces.extend(active, seq[i : i + step])
            assert len(active) == min(i + step, len(seq), depth - 1) + 1 or len(active) == depth
            i += step
    expected = brute_counts(sequences, depth)
    assert trie_counts(whole) == expected
    assert trie_counts(pieces) == expected
    # the most frequent child of each node is one of the most frequent continuations
    for node in range(1, len(whole.count)):
        if whole.out[node]:
            best = whole.best[node]
            assert whole.count[best] == max(
                whole.count[c] for k, c in whole.edges.items() if k >> 24 == node
            )


@pytest.mark.parametrize("seed", range(3))
def test_remove_undoes_insert(seed):
    rng = random.Random(seed)
    sequences = random_sequences(rng, 5, 25, 4)
    trie = SuffixTrie(4, removable=True)
    for seq in sequences:
        trie.insert(seq)
    for seq in sequences[:3]:
        trie.remove(seq)
    assert trie_counts(trie) == brute_counts(sequences[3:], 4)
    assert trie.num_nodes == 1 + len(brute_counts(sequences[3:], 4)[0])
    for node in range(1, len(trie.count)):  # best pointers still name a most frequent child
        if node not in trie.free and trie.out[node]:
            kids = [c for k, c in trie.edges.items() if k >> 24 == node]
            assert trie.count[trie.best[node]] == max(trie.count[c] for c in kids)
    trie.insert(sequences[0])  # freed ids are reused and consistent
    assert trie_counts(trie) == brute_counts(sequences[3:] + sequences[:1], 4)


def test_remove_needs_a_removable_trie():
    trie = SuffixTrie(4)
    trie.insert([1, 2])
    with pytest.raises(ValueError, match="removable"):
        trie.remove([1, 2])
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTrie(1)


def brute_next(context: list[int], max_depth: int) -> tuple[int, Counter]:
    """The longest suffix (< max_depth) of context seen earlier with a continuation, and the
    counts of what followed it there."""
    for m in range(min(max_depth - 1, len(context) - 1), 0, -1):
        pattern = context[len(context) - m :]
        follow = Counter(
            context[s + m] for s in range(len(context) - m) if context[s : s + m] == pattern
        )
        if follow:
            return m, follow
    return 0, Counter()


@pytest.mark.parametrize("seed", range(6))
def test_match_and_first_draft_token_match_brute_force(seed):
    rng = random.Random(seed)
    depth = 6
    context = [rng.randrange(3) for _ in range(rng.randrange(5, 60))]
    trie = SuffixTrie(depth)
    active = trie.extend([0], context)
    node, match = trie.longest_continuing(active)
    m, follow = brute_next(context, depth)
    assert match == m
    if m:
        tokens, score = trie.draft(node, match, context, 1, 0.0, depth // 2)
        top = max(follow.values())
        assert follow[tokens[0]] == top
        assert score == pytest.approx(top / sum(follow.values()))


def test_draft_copies_a_repeated_span_past_the_depth_and_stops_on_rare_branches():
    span = list(range(100, 140))
    context = [1, 2] + span + [7, 8] + span[:5]
    trie = SuffixTrie(8)
    active = trie.extend([0], context)
    node, match = trie.longest_continuing(active)
    assert match == 5
    tokens, score = trie.draft(node, match, context, 30, 0.1, 4)
    assert tokens == span[5:35]  # longer than the trie is deep: re-anchored on the way
    assert score == pytest.approx(30.0)
    # the path's probability is the product of child.count / parent.out along it
    trie = SuffixTrie(6)
    for seq in [[1, 2, 4, 5]] * 5 + [[1, 2, 4, 6]] * 4 + [[1, 2, 3]]:
        trie.insert(seq)
    node = trie.find([1, 2])
    assert trie.draft(node, 2, [1, 2], 4, 0.95, 3) == ([], 0.0)  # 4 follows 9 times in 10
    tokens, score = trie.draft(node, 2, [1, 2], 4, 0.6, 3)
    assert tokens == [4] and score == pytest.approx(0.9)  # then 5: 0.9 * 5 / 9 = 0.5 < 0.6
    tokens, score = trie.draft(node, 2, [1, 2], 4, 0.5, 3)
    assert tokens == [4, 5] and score == pytest.approx(0.9 + 0.5)


def test_suffix_nodes_and_advance_follow_a_context():
    rng = random.Random(3)
    trie = SuffixTrie(5, removable=True)
    for seq in random_sequences(rng, 6, 40, 3):
        trie.insert(seq)
    context = [rng.randrange(3) for _ in range(30)]
    active = trie.suffix_nodes(context[:10])
    for i in range(10, 30):
        active = trie.advance(active, context[i : i + 1])
        expected = trie.suffix_nodes(context[: i + 1])
        assert active == expected
        # every node of the list is the path of that many last tokens
        for d, node in enumerate(active):
            assert trie.find(context[i + 1 - d : i + 1]) == node


def test_global_cache_evicts_oldest_by_count_and_by_size():
    cache = GlobalSuffixCache(max_depth=4, max_requests=2, max_tokens=100)
    a, b, c = [1, 2, 3], [4, 5, 6, 7], [1, 2, 9]
    for r in (a, b, c):
        cache.add(r)
    assert list(cache.responses) == [b, c]
    assert trie_counts(cache.trie) == brute_counts([b, c], 4)
    by_size = GlobalSuffixCache(max_depth=4, max_requests=10, max_tokens=8)
    for r in (a, b, c):
        by_size.add(r)
    assert list(by_size.responses) == [b, c] and by_size.num_tokens == 7
    by_size.add(list(range(20, 40)))  # longer than the whole cache: its last 8 tokens stay
    assert list(by_size.responses) == [list(range(32, 40))]
    assert trie_counts(by_size.trie) == brute_counts([list(range(32, 40))], 4)
    versions = by_size.version
    by_size.add([])
    assert by_size.version == versions
    off = GlobalSuffixCache(max_depth=4, max_requests=0, max_tokens=8)
    off.add(a)
    assert len(off) == 0 and off.trie.num_nodes == 1
