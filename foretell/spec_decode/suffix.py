"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix"): a model-free drafter
that matches the end of a sequence against what came before and drafts the most frequent
continuation, as long as the match and its frequency justify.

Two suffix indexes (suffix_tree.py: a suffix trie kept as occurrence positions): one per
sequence over its prompt and output so far, and the global cache (suffix_cache.py) over the
responses of recent finished requests. Each sequence keeps its match in both (the matched
length and the occurrences) between steps. Each step, for each sequence that sampled:
  1. observe: store the tokens new since the last step and move both matches on by them (a
     match whose occurrences all stop is looked up again from the context's last
     min_match_length tokens): host work in proportion to the new tokens;
  2. budget: at most min(k, floor(max_spec_factor * match length)) tokens; no draft at all
     without a match of min_match_length tokens (a step without drafts costs what a plain
     decode step costs);
  3. walk: follow the most frequent next token while the path's empirical probability stays
     >= min_token_prob;
  4. take the index whose draft scores higher (sum of the prefixes' probabilities).
When branches compete the engine would gain from a tree of drafts; host drafters verify chains
only for now, so the best chain is drafted.

The drafts are deterministic (argmax of the empirical distribution): no draft probabilities, so
rejection sampling treats them as one-hot and sampling stays exact.

Per-sequence state is keyed by DraftBatch.seq_ids; forget(seq_id) (a finished, aborted or
preempted sequence) moves its response (the tokens after its prompt) into the global cache;
drop_cached_responses() empties the cache (the engine's warm-up does, after its dummy requests). A
batch without seq_ids is drafted from fresh indexes (slow, same drafts as a first step).
"""

from __future__ import annotations

from dataclasses import dataclass

from foretell.spec_decode.proposer import DraftBatch, Proposal, ProposerBase, ProposerCapabilities
from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_tree import EMPTY_DRAFT, Draft, Match, SuffixIndex


@dataclass
class SuffixSettings:
    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_cached_tokens: int = 1 << 17
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    min_match_length: int = 4

    @classmethod
    def from_config(cls, config) -> "SuffixSettings":
        return cls(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_cached_tokens=config.suffix_decoding_max_cached_tokens,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
            min_match_length=config.suffix_decoding_min_match_length,
        )

    @property
    def key_length(self) -> int:
        """The indexes' gram length: the shortest match, within the depth."""
        return min(self.min_match_length, self.max_tree_depth)


class SequenceState:
    """What the drafter keeps of one sequence between steps: its own index (its tokens so far)
    and its matches there and in the global cache."""

    def __init__(self, settings: SuffixSettings):
        self.index = SuffixIndex(settings.key_length, settings.max_tree_depth)
        self.own_match = Match()
        self.cache_match = Match()
        self.prompt_length: int | None = None  # known at its first sampling step

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def follows(self, history: list[int]) -> bool:
        """Whether history continues what this state has seen (a cheap check: length and the
        last token seen)."""
        tokens = self.index.tokens
        n = len(tokens)
        return n <= len(history) and (n == 0 or history[n - 1] == tokens[-1])


class SuffixProposer(ProposerBase):
    method = "suffix"

    def __init__(self, num_speculative_tokens: int, settings: SuffixSettings | None = None):
        super().__init__(num_speculative_tokens)
        self.settings = settings or SuffixSettings()
        s = self.settings
        self.cache = GlobalSuffixCache(s.key_length, s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)
        self.states: dict[int, SequenceState] = {}

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities(deterministic=True, drafts_from_tokens=True)

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "SuffixProposer":
        return cls(config.num_speculative_tokens, SuffixSettings.from_config(config))

    # ---- state ---------------------------------------------------------------------------
    def observe(self, key: int | None, history: list[int], samples: bool) -> SequenceState:
        """The sequence's state brought up to `history`: only the new tokens are stored, and
        both matches move on by them (looked up again when they end)."""
        state = self.states.get(key) if key is not None else None
        if state is None or not state.follows(history):
            state = SequenceState(self.settings)
            if key is not None:
                self.states[key] = state
        own = state.index
        new = history[len(own.tokens) :]
        if new:
            own.extend(new)
            state.own_match = own.advance(state.own_match, new)
        if samples and not state.own_match.positions:
            state.own_match = own.lookup(history)
        if samples and state.prompt_length is None:
            state.prompt_length = len(history) - 1  # the first sampled token ends the history
        cache = self.cache.index
        if new:
            state.cache_match = cache.advance(state.cache_match, new)
        if samples and not state.cache_match.positions and self.cache.responses:
            state.cache_match = cache.lookup(history)
        return state

    def forget(self, seq_id: int) -> None:
        """A sequence is done (or preempted): its response joins the global cache."""
        state = self.states.pop(seq_id, None)
        if state is not None and state.prompt_length is not None:
            self.cache.add(state.tokens[state.prompt_length :])

    def drop_cached_responses(self) -> None:
        """Forget the finished requests' responses in the global cache (after the warm-up's
        synthetic requests, which no later request should draft from)."""
        self.cache.clear()

    # ---- drafting ------------------------------------------------------------------------
    def draft(self, state: SequenceState, max_tokens: int) -> Draft:
        """The better of the two indexes' drafts for a sequence (EMPTY_DRAFT without a match)."""
        best = EMPTY_DRAFT
        if max_tokens <= 0:
            return best
        s = self.settings
        for index, match in ((state.index, state.own_match), (self.cache.index, state.cache_match)):
            if not match.positions:
                continue
            budget = min(max_tokens, int(s.max_spec_factor * match.length))
            if budget <= 0:
                continue
            tokens, score = index.draft(match, budget, s.min_token_prob)
            if tokens and score > best.score:
                best = Draft(tokens, match.length, score)
        return best

    def propose_drafts(self, batch: DraftBatch) -> list[Draft]:
        """Every sequence's draft (empty for those that did not sample); states updated."""
        seq_ids = batch.seq_ids if batch.seq_ids else [None] * batch.num_seqs
        drafts = []
        for i, (key, history) in enumerate(zip(seq_ids, batch.histories)):
            state = self.observe(key, history, batch.samples[i])
            drafts.append(self.draft(state, batch.num_useful_drafts(i, self.k)) if batch.samples[i] else EMPTY_DRAFT)
        return drafts

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = self.propose_drafts(batch)
        return Proposal([d.token_ids for d in drafts], [None] * len(drafts))
