"""Suffix decoding's lazy indexing (spec_decode/suffix.py): a step that looks nothing up (a
sequence the acceptance gate pauses, a prefill chunk) only stores its tokens, indexed in one go at
the sequence's next lookup or when it is forgotten into the global cache. The reference here is
the eager drafter it replaced, every token indexed and both matches moved on the step it arrives:
over random histories and the repetitive prompt set, with the gate pausing and probing, batches
whose sequences finish and are replaced (the global cache), and chunked prompts, both propose the
same drafts every step and leave the same global cache."""

from __future__ import annotations

import random

import pytest

from foretell.bench.repetitive import repetitive_prompts
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SequenceState, SuffixProposer, SuffixSettings
from foretell.spec_decode.token_history import TokenHistory


class EagerSuffixProposer(SuffixProposer):
    """The reference: every token indexed (and both matches advanced) on the step it arrives."""

    def observe(self, key, history, samples, lookup=True):
        num_tokens = len(history)
        state = self.states.get(key) if key is not None else None
        if state is None or not state.follows(history):
            state = SequenceState(self.settings)
            if key is not None:
                self.states[key] = state
        assert not state.pending  # the eager drafter never defers
        own = state.index
        new = list(history[len(own.tokens):])
        if new:
            own.extend(new)
            if state.own_match.positions:
                state.own_match = own.advance(state.own_match, new)
            if state.cache_match.positions:
                state.cache_match = self.cache.index.advance(state.cache_match, new)
            if state.last_draft:
                self._judge(state, new, num_tokens)
        if not samples:
            return None
        if state.prompt_length is None:
            state.prompt_length = num_tokens - 1
        if not lookup or num_tokens < state.resume_at:
            return None
        context = list(history)
        if not state.own_match.positions:
            state.own_match = own.lookup(context)
        if not state.cache_match.positions:
            state.cache_match = self.cache.index.lookup(context)
        return state


def make_batch(histories, seq_ids, samples, k) -> DraftBatch:
    n = len(histories)
    return DraftBatch(
        start_positions=[len(h) - 2 for h in histories], num_valid_rows=[1] * n,
        next_token_ids=[h[-1] for h in histories], samples=samples, token_ids=None, hidden_states=None,
        aux_hidden_states=[], block_table=None, block_size=16, sampling_params=[None] * n,
        sample_indices=[0] * n, max_model_len=1 << 20, histories=histories, seq_ids=seq_ids)


def run_both(workloads, batch_size: int, settings: SuffixSettings, k: int, chunk: int, seed: int,
             make_lazy=SuffixProposer, make_eager=EagerSuffixProposer):
    """Drive a lazy and an eager drafter through the same steps: batch_size sequences at a time from
    workloads ([(prompt, truth)]: the target emits truth's next tokens), prompts prefilled in chunks
    of `chunk` tokens, a draft's accepted prefix plus one token emitted a step, finished sequences
    forgotten and replaced. Asserts every step's drafts equal; returns how many drafts were made and
    in how many (sequence, step) pairs the lazy drafter held tokens pending."""
    rng = random.Random(seed)
    lazy, eager = make_lazy(k, settings), make_eager(k, settings)
    queue = list(enumerate(workloads))
    running = []  # [seq_id, prompt, truth, history (prompt tokens in so far + emitted), drafts]
    num_drafts = num_pending = 0
    while queue or running:
        while queue and len(running) < batch_size:
            seq_id, (prompt, truth) = queue.pop(0)
            running.append([seq_id, prompt, truth, [], []])
        histories, samples = [], []
        for seq in running:
            seq_id, prompt, truth, history, drafts = seq
            if len(history) < len(prompt):  # a prefill chunk; the last one samples the first token
                history.extend(prompt[len(history):len(history) + chunk])
                sampled = len(history) == len(prompt)
                if sampled:
                    history.append(truth[0])
            else:  # a decode step: the draft's accepted prefix and the target's own token
                done = len(history) - len(prompt)
                accepted = 0
                while (accepted < len(drafts) and done + accepted < len(truth)
                       and drafts[accepted] == truth[done + accepted]):
                    accepted += 1
                history.extend(truth[done:done + accepted + 1])
                sampled = True
            # the lazy drafter reads the step's view (the engine's TokenHistory), the eager a list
            histories.append(history)
            samples.append(sampled)
        ids = [seq[0] for seq in running]
        views = [TokenHistory(h[:-1], h[-1:]) if rng.random() < 0.5 else h for h in histories]
        got = lazy.propose(make_batch(views, ids, samples, k)).token_ids
        want = eager.propose(make_batch([list(h) for h in histories], ids, samples, k)).token_ids
        assert got == want
        num_drafts += sum(bool(d) for d in got)
        num_pending += sum(bool(state.pending) for state in lazy.states.values())
        for seq, drafts in zip(running, got):
            seq[4] = drafts
        for seq in list(running):
            if len(seq[3]) >= len(seq[1]) + len(seq[2]):  # its truth is emitted: finished
                lazy.forget(seq[0])
                eager.forget(seq[0])
                running.remove(seq)
                assert lazy.cache.responses == eager.cache.responses
                assert lazy.cache.index.tokens == eager.cache.index.tokens
    assert lazy.cache.index.head == eager.cache.index.head
    return num_drafts, num_pending


def random_workload(rng: random.Random, vocab: int, prompt_len: int, output_len: int):
    """A prompt over a small vocabulary (matches everywhere) and a truth output that copies a piece
    of it with tokens changed now and then, or is random (drafts rejected: the gate pauses)."""
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    if rng.random() < 0.5:
        start = rng.randrange(prompt_len - 8)
        truth = [t if rng.random() > 0.15 else rng.randrange(vocab) for t in prompt[start:start + output_len]]
    else:
        truth = []
    truth += [rng.randrange(vocab) for _ in range(output_len - len(truth))]
    return prompt, truth


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bar", [0.0, 1.0, 2.5])
def test_lazy_and_eager_indexing_draft_the_same_on_random_histories(seed, bar):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    workloads = [random_workload(rng, vocab, rng.randrange(10, 60), rng.randrange(5, 60)) for _ in range(8)]
    settings = SuffixSettings(max_tree_depth=rng.choice([4, 8, 24]), min_match_length=rng.choice([1, 2, 4]),
                              max_cached_tokens=rng.choice([64, 4096]), max_cached_requests=rng.choice([2, 100]),
                              min_token_prob=rng.choice([0.0, 0.1, 0.4]), min_accepted_tokens=bar)
    settings.max_tree_depth = max(settings.max_tree_depth, settings.min_match_length)
    num_drafts, num_pending = run_both(workloads, batch_size=rng.choice([1, 3]), settings=settings,
                                       k=rng.choice([3, 8]), chunk=rng.choice([4, 1000]), seed=seed)
    assert num_drafts > 0 and (num_pending > 0 or bar == 0)


def _word_ids(text: str, ids: dict[str, int]) -> list[int]:
    return [ids.setdefault(word, len(ids)) for word in text.split()]


@pytest.mark.parametrize("bar", [1.0, 3.0])
def test_lazy_and_eager_indexing_draft_the_same_on_the_repetitive_set(bar):
    ids: dict[str, int] = {}
    workloads = []
    for prompt in repetitive_prompts(12):
        words = _word_ids(prompt.text, ids)
        cut = max(8, int(0.6 * len(words)))
        # the truth goes on with the text, then quotes its beginning with a word changed now and then
        rng = random.Random(len(words))
        truth = words[cut:] + [w if rng.random() > 0.1 else 0 for w in words[:40]]
        workloads.append((words[:cut], truth))
    settings = SuffixSettings(min_accepted_tokens=bar)
    num_drafts, num_pending = run_both(workloads, batch_size=4, settings=settings, k=16, chunk=32, seed=0)
    assert num_drafts > 0 and num_pending > 0


def test_a_paused_sequence_indexes_nothing_until_its_probe():
    proposer = SuffixProposer(4, SuffixSettings(min_match_length=2, max_tree_depth=8, min_accepted_tokens=1.0))
    loop = [5, 6, 7, 8, 9]
    history = [loop[i % 5] for i in range(12)]
    assert proposer.propose(make_batch([history], [1], [True], 4)).token_ids[0]
    history += [99]  # the draft is rejected whole: the gate pauses the sequence
    assert proposer.propose(make_batch([history], [1], [True], 4)).token_ids[0] == []
    state = proposer.states[1]
    indexed = len(state.index.tokens)  # the step that paused it stores its token only
    assert indexed == len(history) - 1 and state.pending == [99]
    while len(history) < state.resume_at - 1:  # paused steps: stored, not indexed
        history.append(loop[len(history) % 5])
        assert proposer.propose(make_batch([history], [1], [True], 4)).token_ids[0] == []
        assert len(state.index.tokens) == indexed and state.num_seen == len(history)
        assert state.tokens == history
    history.append(loop[len(history) % 5])  # the probe: every pending token indexed, a draft
    assert proposer.propose(make_batch([history], [1], [True], 4)).token_ids[0]
    assert state.index.tokens == history and not state.pending


def test_a_sequence_forgotten_while_paused_caches_its_whole_response():
    proposer = SuffixProposer(4, SuffixSettings(min_match_length=2, max_tree_depth=8, min_accepted_tokens=1.0))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
    history = prompt + [5]
    proposer.propose(make_batch([history], [1], [True], 4))
    history += [1]  # rejected: paused
    proposer.propose(make_batch([history], [1], [True], 4))
    history += [2, 3]
    proposer.propose(make_batch([history], [1], [True], 4))
    assert proposer.states[1].pending == [1, 2, 3]  # the step that paused it, and the paused one
    proposer.forget(1)
    assert list(proposer.cache.responses) == [[5, 1, 2, 3]]


def test_the_host_cost_bench_holds_every_sequence_paused():
    from foretell.bench.suffix_host_cost import measure_host_cost

    paused = measure_host_cost(2, num_steps=20, prompt_len=128, output_len=32, paused=True)
    drafting = measure_host_cost(2, num_steps=20, prompt_len=128, output_len=32)
    assert paused["tokens_per_sequence_step"] == 1.0  # no draft at all: one token a step
    assert drafting["tokens_per_sequence_step"] > 1.5
    assert paused["us_per_step_cpu"] > 0


def test_engine_bench_paused_on_the_stub_takes_no_draft():
    from foretell.bench.suffix_host_cost import measure_engine_steps

    result = measure_engine_steps(1, "suffix", num_prompts=1, max_tokens=12, k=4, count_calls=False,
                                  paused=True, stub_forward=True)
    assert result["steps"] >= 12 and result["mean_acceptance_length"] == 0.0
    plain = measure_engine_steps(1, "none", num_prompts=1, max_tokens=12, count_calls=False, stub_forward=True)
    assert plain["steps"] == result["steps"]
