"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix"): a model-free drafter
that matches the end of a sequence against suffix tries and drafts the most frequent
continuation, as long as the match and its frequency justify.

Two tries (suffix_tree.py): one per sequence over its prompt and output so far, updated with only
the tokens new since the last step, and the global cache (suffix_cache.py) over the responses of
recent finished requests. Each step, for each sequence that sampled:
  1. match: the longest suffix of the sequence (< max_tree_depth tokens) that occurred before
     with a continuation, in each trie;
  2. budget: at most min(k, floor(max_spec_factor * match length)) tokens;
  3. walk: follow the most frequent child while the path's empirical probability (product of
     child.count / parent.out) stays >= min_token_prob;
  4. take the trie whose draft scores higher (sum of the prefixes' probabilities).
When branches compete the engine would gain from a tree of drafts; host drafters verify chains
only for now, so the best chain is drafted.

The drafts are deterministic (argmax of the empirical distribution): no draft probabilities, so
rejection sampling treats them as one-hot and sampling stays exact.

Per-sequence state is keyed by DraftBatch.seq_ids; forget(seq_id) (a finished, aborted or
preempted sequence) moves its response (the tokens after its prompt) into the global cache. A
batch without seq_ids is drafted from fresh tries (slow, same drafts as a first step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foretell.spec_decode.proposer import DraftBatch, Proposal, ProposerBase, ProposerCapabilities
from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_tree import EMPTY_DRAFT, Draft, SuffixTrie


@dataclass
class SuffixSettings:
    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_cached_tokens: int = 1 << 17
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    @classmethod
    def from_config(cls, config) -> "SuffixSettings":
        return cls(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_cached_tokens=config.suffix_decoding_max_cached_tokens,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )


@dataclass
class SequenceState:
    """What the drafter keeps of one sequence between steps."""

    trie: SuffixTrie  # over this sequence's own tokens
    active: list[int]  # nodes of its last 0 .. max_depth - 1 tokens in `trie`
    tokens: list[int] = field(default_factory=list)  # every token seen, in order
    prompt_length: int | None = None  # known at its first sampling step
    cache_active: list[int] | None = None  # its suffixes' nodes in the global trie
    cache_version: int = -1  # the global cache's version cache_active was computed at

    def follows(self, history: list[int]) -> bool:
        """Whether history continues what this state has seen (a cheap check: length and the
        last token seen)."""
        n = len(self.tokens)
        return n <= len(history) and (n == 0 or history[n - 1] == self.tokens[-1])


class SuffixProposer(ProposerBase):
    method = "suffix"

    def __init__(self, num_speculative_tokens: int, settings: SuffixSettings | None = None):
        super().__init__(num_speculative_tokens)
        self.settings = settings or SuffixSettings()
        s = self.settings
        self.cache = GlobalSuffixCache(s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)
        self.states: dict[int, SequenceState] = {}
        self.anchor_length = max(1, s.max_tree_depth // 2)

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities(deterministic=True)

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "SuffixProposer":
        return cls(config.num_speculative_tokens, SuffixSettings.from_config(config))

    # ---- state ---------------------------------------------------------------------------
    def _new_state(self) -> SequenceState:
        trie = SuffixTrie(self.settings.max_tree_depth)
        return SequenceState(trie=trie, active=[0])

    def observe(self, key: int | None, history: list[int], samples: bool) -> SequenceState:
        """The sequence's state brought up to `history` (only the new tokens are inserted)."""
        state = self.states.get(key) if key is not None else None
        if state is None or not state.follows(history):
            state = self._new_state()
            if key is not None:
                self.states[key] = state
        new = history[len(state.tokens) :]
        if new:
            state.active = state.trie.extend(state.active, new)
            state.tokens.extend(new)
        if samples and state.prompt_length is None:
            state.prompt_length = len(history) - 1  # the first sampled token ends the history
        if self.cache.trie.out[0] == 0:  # nothing cached
            state.cache_active = None
        elif state.cache_version != self.cache.version or state.cache_active is None:
            state.cache_active = self.cache.trie.suffix_nodes(history)
            state.cache_version = self.cache.version
        elif new:
            state.cache_active = self.cache.trie.advance(state.cache_active, new)
        return state

    def forget(self, seq_id: int) -> None:
        """A sequence is done (or preempted): its response joins the global cache."""
        state = self.states.pop(seq_id, None)
        if state is not None and state.prompt_length is not None:
            self.cache.add(state.tokens[state.prompt_length :])

    # ---- drafting ------------------------------------------------------------------------
    def draft(self, state: SequenceState, history: list[int], max_tokens: int) -> Draft:
        """The better of the two tries' drafts for a sequence whose state has seen history."""
        best = EMPTY_DRAFT
        if max_tokens <= 0:
            return best
        s = self.settings
        candidates = [(state.trie, state.active)]
        if state.cache_active is not None:
            candidates.append((self.cache.trie, state.cache_active))
        for trie, active in candidates:
            node, match = trie.longest_continuing(active)
            if node < 0:
                continue
            budget = min(max_tokens, int(s.max_spec_factor * match))
            if budget <= 0:
                continue
            tokens, score = trie.draft(node, match, history, budget, s.min_token_prob, self.anchor_length)
            if tokens and score > best.score:
                best = Draft(tokens, match, score)
        return best

    def propose_drafts(self, batch: DraftBatch) -> list[Draft]:
        """Every sequence's draft (empty for those that did not sample); states updated."""
        seq_ids = batch.seq_ids if batch.seq_ids else [None] * batch.num_seqs
        drafts = []
        for i, (key, history) in enumerate(zip(seq_ids, batch.histories)):
            state = self.observe(key, history, batch.samples[i])
            drafts.append(self.draft(state, history, batch.num_useful_drafts(i, self.k)))
        return drafts

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = self.propose_drafts(batch)
        return Proposal([d.token_ids for d in drafts], [None] * len(drafts))
