"""What suffix decoding (suffix.py) keeps: its settings, and per sequence its own index, its
matches there and in the global cache, the tokens not indexed yet, and the acceptance gate's state
(the last draft, the accepted average, the pause)."""

from __future__ import annotations

from dataclasses import dataclass

from foretell.speculative_config import SpeculativeConfig
from foretell.spec_decode.suffix_gate import AUTO_PRIOR_BAR
from foretell.spec_decode.suffix_tree import Match, SuffixIndex

FIRST_PAUSE = 4  # tokens a sequence stops drafting after its drafts fell below the bar
MAX_PAUSE = 64  # ... doubling while its probes keep failing, at most this many


@dataclass
class SuffixSettings:
    """The drafter's settings; the defaults are SpeculativeConfig's suffix_decoding_* ones (its
    documentation: config.py), but for the gate, off unless asked for (the engine's default "auto"
    needs timed steps: suffix_gate.py)."""

    max_tree_depth: int = SpeculativeConfig.suffix_decoding_max_tree_depth
    max_cached_requests: int = SpeculativeConfig.suffix_decoding_max_cached_requests
    max_cached_tokens: int = SpeculativeConfig.suffix_decoding_max_cached_tokens
    max_spec_factor: float = SpeculativeConfig.suffix_decoding_max_spec_factor
    min_token_prob: float = SpeculativeConfig.suffix_decoding_min_token_prob
    min_match_length: int = SpeculativeConfig.suffix_decoding_min_match_length
    min_accepted_tokens: float | str = 0.0  # the acceptance gate's bar (0: off; "auto": suffix_gate.py)
    topk: int = 1  # > 1: draft trees, each node's topk likeliest next tokens (suffix_draft_tree.py)
    max_tree_nodes: int = 0  # a tree's nodes below the root (speculative_config num_draft_tokens - 1)

    @classmethod
    def from_config(cls, config) -> "SuffixSettings":
        bar = config.suffix_decoding_min_accepted_tokens
        if bar == "auto" and getattr(config, "hybrid", None):  # no plain steps to time (module docstring)
            bar = AUTO_PRIOR_BAR
        return cls(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_cached_tokens=config.suffix_decoding_max_cached_tokens,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
            min_match_length=config.suffix_decoding_min_match_length,
            min_accepted_tokens=bar,
            topk=config.topk,
            max_tree_nodes=config.num_draft_tokens - 1,
        )

    @property
    def key_length(self) -> int:
        """The indexes' gram length: the shortest match, within the depth."""
        return min(self.min_match_length, self.max_tree_depth)


class SequenceState:
    """What the drafter keeps of one sequence between steps: its own index (its tokens so far,
    less `pending`: those not indexed yet) and its matches there and in the global cache."""

    def __init__(self, settings: SuffixSettings):
        self.index = SuffixIndex(settings.key_length, settings.max_tree_depth)
        # Tokens seen after the index's, not indexed yet: a step without a lookup (paused by the
        # gate, a prefill chunk, a step nobody drafts) only stores its tokens here; the next lookup
        # (or forget) indexes them in one extend and moves the matches on by them.
        self.pending: list[int] = []
        self.own_match = Match()
        self.cache_match = Match()
        self.prompt_length: int | None = None  # known at its first sampling step
        # The acceptance gate: the draft proposed last (what the next tokens are checked
        # against), the moving average of accepted tokens per draft, no draft before the
        # history reaches resume_at tokens, and the next pause's length.
        self.last_draft: list[int] = []
        self.last_tree = None  # last_draft's TreeDraft under topk > 1 (its nodes in tree order)
        self.last_match_length = 0  # the match last_draft came from (its calibration class)
        self.run_going = False  # the last draft was accepted whole (the next one is not held to its class)
        self.accepted_average = float("inf")  # no draft yet: nothing against drafting
        self.resume_at = 0
        self.pause = FIRST_PAUSE

    @property
    def num_seen(self) -> int:
        """How many of the sequence's tokens this state has seen (indexed or pending)."""
        return len(self.index.tokens) + len(self.pending)

    @property
    def tokens(self) -> list[int]:
        """Every token seen (a copy when some are pending)."""
        return self.index.tokens + self.pending if self.pending else self.index.tokens

    def tokens_from(self, start: int) -> list[int]:
        """The tokens seen from position start on, a new list (no copy of those before start)."""
        indexed = self.index.tokens
        if start >= len(indexed):
            return self.pending[start - len(indexed) :]
        return indexed[start:] + self.pending

    def follows(self, history: list[int]) -> bool:
        """Whether history continues what this state has seen (a cheap check: length and the
        last token seen)."""
        return self.new_tokens(history) is not None

    def new_tokens(self, history: list[int]) -> list[int] | None:
        """The tokens of history after those seen; None when history does not continue them
        (length and last token checked: cheap). One read of history (a TokenHistory's slice)."""
        last = self.pending or self.index.tokens
        n = self.num_seen
        if n == 0:
            return history[:]
        tail = history[n - 1 :]  # the last token seen, then the new ones
        if not tail or tail[0] != last[-1]:
            return None
        return tail[1:]
