"""Suffix decoding's drafts (spec_decode/suffix.py, suffix_tree.py, suffix_cache.py) against a
straightforward reference written here from the rules alone, with none of the index's machinery
(no gram keys, hash chains, runs, windows or compaction): plain lists and scans.

The rules the reference follows, per sequence and step (the acceptance gate off):
  - a match is a length and the positions right after its occurrences, in the sequence's own
    tokens (its prompt and output so far) and in the global cache (recent responses, each
    followed by a separator; the oldest evicted first past max_cached_requests or
    max_cached_tokens, a response longer than that keeping its last tokens);
  - the new tokens of a step move a match on (the occurrences whose next tokens are the new ones);
    a match with no occurrence left is looked up again: the occurrences of the context's last
    key_length tokens that have a next token (its own end and a response's last token excluded),
    the MAX_CANDIDATES most recent, each extended backwards to at most max_tree_depth matched
    tokens, those of the longest kept;
  - the draft walks from a match by the most frequent next token (ties: the newest occurrence's),
    an ended occurrence counting for none, while the product of each step's share stays >=
    min_token_prob, at most min(k, max_spec_factor x match length) tokens; a single occurrence is
    copied (on into the draft itself past the own tokens' end); the score sums each step's
    probability; the better scoring of the own and the cache draft is proposed (own on ties).
Driven through random, repetitive and looping outputs, with sequences finishing into the cache
and evictions, the drafter must propose exactly the reference's drafts every step."""

from __future__ import annotations

import random

import pytest

from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_tree import MAX_CANDIDATES
from foretell.spec_decode.token_history import TokenHistory

END = None  # the reference's separator after each cached response


class ReferenceMatch:
    def __init__(self, length: int = 0, positions: list[int] | None = None):
        self.length = length
        self.positions = positions or []


def reference_lookup(store: list, start: int, context: list[int], key_length: int, max_depth: int) -> ReferenceMatch:
    """Scan the whole store for the context's last key_length tokens (positions >= start)."""
    m = key_length
    if len(context) < m:
        return ReferenceMatch()
    gram = context[-m:]
    occurrences = [i for i in range(start + m, len(store))
                   if store[i - m:i] == gram and store[i] is not END]
    occurrences = occurrences[-MAX_CANDIDATES:]  # the most recent
    lengths = {}
    for i in occurrences:
        length = m
        while (length < max_depth and i - length - 1 >= start and length < len(context)
               and store[i - length - 1] == context[-length - 1]):
            length += 1
        lengths[i] = length
    if not lengths:
        return ReferenceMatch()
    longest = max(lengths.values())
    return ReferenceMatch(longest, [i for i in occurrences if lengths[i] == longest])


def reference_advance(store: list, start: int, match: ReferenceMatch, new: list[int]) -> ReferenceMatch:
    n = len(new)
    kept = [p + n for p in match.positions if p >= start and store[p:p + n] == new]
    return ReferenceMatch(match.length + n, kept) if kept else ReferenceMatch()


def reference_walk(store: list, start: int, match: ReferenceMatch, max_tokens: int, min_token_prob: float,
                   own: bool) -> tuple[list[int], float]:
    """own: the store is the sequence's own tokens; what follows its end is the draft itself."""
    positions = [p for p in match.positions if p >= start]
    draft: list[int] = []

    def token_at(p):
        if p < len(store):
            return store[p]
        return draft[p - len(store)] if own and p - len(store) < len(draft) else END

    prob, score = 1.0, 0.0
    while positions and len(draft) < max_tokens:
        if len(positions) == 1:
            p, copied = positions[0], 0
            while len(draft) < max_tokens and token_at(p) is not END:
                draft.append(token_at(p))
                p += 1
                copied += 1
            score += prob * copied
            break
        counts: dict[int, int] = {}
        newest: dict[int, int] = {}
        for rank, p in enumerate(positions):  # oldest first: the last rank seen is the newest
            t = token_at(p)
            if t is not END:
                counts[t] = counts.get(t, 0) + 1
                newest[t] = rank
        if not counts:
            break
        choice = max(counts, key=lambda t: (counts[t], newest[t]))
        prob *= counts[choice] / sum(counts.values())
        if prob < min_token_prob:
            break
        positions = [p + 1 for p in positions if token_at(p) == choice]
        draft.append(choice)
        score += prob
    return draft, score


class ReferenceSuffixDrafter:
    def __init__(self, k: int, settings: SuffixSettings):
        self.k, self.s = k, settings
        self.key_length = min(settings.min_match_length, settings.max_tree_depth)
        self.cache: list = []  # every response ever cached, each followed by END
        self.cache_start = 0  # first live position
        self.responses: list[list[int]] = []  # live ones, oldest first
        self.sequences: dict[int, dict] = {}

    def forget(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id)
        s = self.s
        response = seq["tokens"][seq["prompt_length"]:][-s.max_cached_tokens:]
        if not response or s.max_cached_requests <= 0 or s.max_cached_tokens <= 0:
            return
        while self.responses and (len(self.responses) >= s.max_cached_requests
                                  or sum(map(len, self.responses)) + len(response) > s.max_cached_tokens):
            self.cache_start += len(self.responses.pop(0)) + 1
        self.responses.append(list(response))
        self.cache += list(response) + [END]

    def propose(self, histories: list[list[int]], seq_ids: list[int]) -> list[list[int]]:
        s, m = self.s, self.key_length
        drafts = []
        for seq_id, history in zip(seq_ids, histories):
            seq = self.sequences.get(seq_id)
            if seq is None:
                seq = self.sequences[seq_id] = {"tokens": [], "own": ReferenceMatch(), "cached": ReferenceMatch(),
                                                "prompt_length": len(history) - 1}
            new = list(history[len(seq["tokens"]):])
            seq["tokens"] += new
            tokens = seq["tokens"]
            if new:
                seq["own"] = reference_advance(tokens, 0, seq["own"], new)
                seq["cached"] = reference_advance(self.cache, self.cache_start, seq["cached"], new)
            if not seq["own"].positions:
                seq["own"] = reference_lookup(tokens, 0, tokens, m, s.max_tree_depth)
            if not seq["cached"].positions:
                seq["cached"] = reference_lookup(self.cache, self.cache_start, tokens, m, s.max_tree_depth)
            best, best_score = [], 0.0
            for store, start, match, own in ((tokens, 0, seq["own"], True),
                                             (self.cache, self.cache_start, seq["cached"], False)):
                if not match.positions:
                    continue
                budget = min(self.k, int(s.max_spec_factor * match.length))
                draft, score = reference_walk(store, start, match, budget, s.min_token_prob, own)
                if draft and score > best_score:
                    best, best_score = draft, score
            drafts.append(best)
        return drafts


def make_batch(histories, seq_ids) -> DraftBatch:
    n = len(histories)
    return DraftBatch(
        start_positions=[len(h) - 2 for h in histories], num_valid_rows=[1] * n,
        next_token_ids=[h[-1] for h in histories], samples=[True] * n, token_ids=None, hidden_states=None,
        aux_hidden_states=[], block_table=None, block_size=16, sampling_params=[None] * n,
        sample_indices=[0] * n, max_model_len=1 << 20, histories=histories, seq_ids=seq_ids)


def run_against_reference(workloads, batch_size: int, k: int, settings: SuffixSettings, seed: int) -> int:
    """batch_size sequences at a time from workloads ([(prompt, truth)]); a step emits the draft's
    accepted prefix of truth and one more token (at times a few more: tokens a draft did not
    predict), finished sequences are forgotten (into the cache) and replaced. Asserts every
    step's drafts equal the reference's; returns how many tokens were drafted."""
    rng = random.Random(seed)
    drafter, reference = SuffixProposer(k, settings), ReferenceSuffixDrafter(k, settings)
    queue = list(enumerate(workloads))
    running = []  # [seq_id, truth, history, tokens of truth emitted, last draft]
    drafted = 0
    while queue or running:
        while queue and len(running) < batch_size:
            seq_id, (prompt, truth) = queue.pop(0)
            running.append([seq_id, truth, prompt + truth[:1], 1, []])
        histories = [seq[2] for seq in running]
        ids = [seq[0] for seq in running]
        # the engine hands the drafter a TokenHistory view; a list reads the same
        views = [TokenHistory(h[:-1], h[-1:]) if rng.random() < 0.5 else list(h) for h in histories]
        got = drafter.propose(make_batch(views, ids)).token_ids
        assert got == reference.propose([list(h) for h in histories], ids)
        drafted += sum(map(len, got))
        for seq, draft in zip(list(running), got):
            seq_id, truth, history, done, _ = seq
            accepted = 0
            while accepted < len(draft) and done + accepted < len(truth) and draft[accepted] == truth[done + accepted]:
                accepted += 1
            emitted = truth[done:done + accepted + 1 + rng.choice((0, 0, 0, 1, 3))]
            history.extend(emitted)
            seq[3] = done + len(emitted)
            if seq[3] >= len(truth):
                drafter.forget(seq_id)
                reference.forget(seq_id)
                running.remove(seq)
                assert list(drafter.cache.responses) == reference.responses
    return drafted


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def repetitive_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """A few phrases repeated with edits: long agreed runs that branch."""
    phrases = [random_tokens(rng, rng.randint(2, 10), vocab) for _ in range(4)]
    out: list[int] = []
    while len(out) < n:
        phrase = list(rng.choice(phrases))
        if rng.random() < 0.3:
            phrase[rng.randrange(len(phrase))] = rng.randrange(vocab)
        out += phrase
    return out[:n]


def looping_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Short patterns repeated (period 1-5), now and then another: many equally spaced occurrences."""
    out: list[int] = []
    while len(out) < n:
        pattern = random_tokens(rng, rng.randint(1, 5), min(vocab, 6))
        out += pattern * rng.randint(2, 12)
    return out[:n]


def workloads(kind: str, rng: random.Random, count: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    make = {"random": random_tokens, "repetitive": repetitive_tokens, "loop": looping_tokens}[kind]
    shared = make(rng, 80, vocab)  # outputs re-use earlier responses now and then (the cache's case)
    out = []
    for _ in range(count):
        prompt = make(rng, rng.randint(1, 60), vocab)
        truth = make(rng, rng.randint(1, 70), vocab)
        if rng.random() < 0.5:
            cut = rng.randrange(len(shared))
            truth = shared[cut:cut + rng.randint(5, 50)] + truth
        out.append((prompt, truth))
    return out


SETTINGS = [
    SuffixSettings(min_accepted_tokens=0.0),  # the defaults (depth 24, min match 4, min prob 0.1)
    SuffixSettings(max_tree_depth=6, min_match_length=2, min_token_prob=0.0, max_cached_requests=3,
                   max_spec_factor=2.0, min_accepted_tokens=0.0),
    SuffixSettings(max_tree_depth=10, min_match_length=1, min_token_prob=0.4, max_cached_tokens=60,
                   max_spec_factor=0.5, min_accepted_tokens=0.0),
    SuffixSettings(max_tree_depth=3, min_match_length=5, min_token_prob=0.25, max_cached_requests=0,
                   min_accepted_tokens=0.0),  # key length 3 (the depth), no cache
]


@pytest.mark.parametrize("kind", ["random", "repetitive", "loop"])
@pytest.mark.parametrize("which", range(len(SETTINGS)))
def test_drafts_equal_the_reference(kind, which):
    rng = random.Random(f"{kind}-{which}")
    vocab = {"random": 4, "repetitive": 9, "loop": 5}[kind]
    k = (16, 5, 3, 8)[which]
    drafted = run_against_reference(workloads(kind, rng, 14, vocab), batch_size=3, k=k,
                                     settings=SETTINGS[which], seed=which)
    assert drafted > 50  # the walks ran, not only empty drafts


def test_drafts_equal_the_reference_with_many_occurrences():
    """More occurrences of each gram than MAX_CANDIDATES (one token over and over, a two-token
    loop, in the own tokens and across many cached responses) and long drafts: the runs the walk
    takes at once, past the own tokens' end and to the responses' ends."""
    rng = random.Random(5)
    loads = []
    for i in range(24):  # some responses end in their loop: the cache's occurrences end with them
        pattern = ([7], [3, 4], [1, 2, 3], [5, 6, 5, 8])[i % 4]
        loop = pattern * rng.randint(3, 150 // len(pattern))
        loads.append((random_tokens(rng, 20, 50), loop + random_tokens(rng, rng.choice((0, 0, 5)), 50)))
    for settings in (SETTINGS[0], SETTINGS[1]):
        for batch_size in (1, 4):
            assert run_against_reference(loads, batch_size, k=16, settings=settings, seed=1) > 200


def test_reference_agrees_on_a_hand_example():
    """The reference itself on a case worked by hand: 1 2 3 seen three times before the end, after
    9 twice (the longest match, depth 4), followed by 5 and by 4 there."""
    store = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 9, 1, 2, 3]
    match = reference_lookup(store, 0, store, 3, 4)
    assert (match.length, match.positions) == (4, [8, 13])
    # 5 and 4 once each: the newest (4) at probability 1/2, then one occurrence copied, on into
    # the draft past the end
    assert reference_walk(store, 0, match, 8, 0.1, own=True) == ([4, 9, 1, 2, 3, 4, 9, 1], 0.5 + 0.5 * 7)
    assert reference_walk(store, 0, match, 8, 0.6, own=True) == ([], 0.0)
    drafter = SuffixProposer(8, SuffixSettings(max_tree_depth=4, min_match_length=3, min_accepted_tokens=0.0))
    assert drafter.propose(make_batch([store], [0])).token_ids == [[4, 9, 1, 2]]  # budget: the match's 4
