"""The global suffix cache of suffix decoding: the responses of recent requests in one SuffixTrie,
so a request can draft from what other requests answered before (agentic loops, re-asked
templates).

A finished request's response is inserted whole; the oldest responses are evicted first (FIFO)
when more than max_requests are cached or their tokens together pass max_tokens (the trie's size
is at most max_depth nodes per cached token, so max_tokens bounds its memory). `version` counts
changes, so a request's match state against the trie knows when to recompute (suffix.py).
"""

from __future__ import annotations

from collections import deque

from foretell.spec_decode.suffix_tree import SuffixTrie


class GlobalSuffixCache:
    def __init__(self, max_depth: int, max_requests: int, max_tokens: int):
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.trie = SuffixTrie(max_depth, removable=True)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.responses: deque[list[int]] = deque()  # oldest first
        self.num_tokens = 0
        self.version = 0

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 and self.max_tokens > 0

    def __len__(self) -> int:
        return len(self.responses)

    def add(self, response: list[int]) -> None:
        """Cache a finished response, evicting the oldest ones to stay within both bounds. A
        response longer than max_tokens keeps its last max_tokens tokens."""
        if not self.enabled or not response:
            return
        response = list(response[-self.max_tokens :])
        while self.responses and (
            len(self.responses) >= self.max_requests or self.num_tokens + len(response) > self.max_tokens
        ):
            self.evict_oldest()
        self.trie.insert(response)
        self.responses.append(response)
        self.num_tokens += len(response)
        self.version += 1

    def evict_oldest(self) -> None:
        response = self.responses.popleft()
        self.trie.remove(response)
        self.num_tokens -= len(response)
        self.version += 1
