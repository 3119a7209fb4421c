"""The global suffix cache of suffix decoding: the responses of recent requests in one
SuffixIndex, so a request can draft from what other requests answered before (agentic loops,
re-asked templates).

A finished request's response is appended whole; the oldest responses are evicted first (FIFO)
when more than max_requests are cached or their tokens together pass max_tokens (the index holds
one entry per cached token, so max_tokens bounds its memory). Neither invalidates the matches
running sequences hold (suffix.py): positions only grow, an evicted one is below `start` and
dropped where it is read, and a sequence without a match looks up again every step, so it sees
a response as soon as it is cached.
"""

from __future__ import annotations

from collections import deque

from foretell.spec_decode.suffix_tree import SuffixIndex


class GlobalSuffixCache:
    def __init__(self, key_length: int, max_depth: int, max_requests: int, max_tokens: int):
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.index = SuffixIndex(key_length, max_depth)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.responses: deque[list[int]] = deque()  # oldest first
        self.num_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 and self.max_tokens > 0

    def __len__(self) -> int:
        return len(self.responses)

    def add(self, response: list[int]) -> None:
        """Cache a finished response, evicting the oldest ones to stay within both bounds. A
        response longer than max_tokens keeps its last max_tokens tokens (one copy kept)."""
        if not self.enabled or not response:
            return
        response = response[-self.max_tokens :] if isinstance(response, list) else list(response[-self.max_tokens :])
        while self.responses and (
            len(self.responses) >= self.max_requests or self.num_tokens + len(response) > self.max_tokens
        ):
            self.evict_oldest()
        self.index.append_sequence(response)
        self.responses.append(response)
        self.num_tokens += len(response)

    def clear(self) -> None:
        """Forget every cached response (after synthetic requests: engine/warm_up.py). Evicted as
        the oldest are, so the matches running sequences hold stay valid (positions only grow)."""
        while self.responses:
            self.evict_oldest()

    def evict_oldest(self) -> None:
        response = self.responses.popleft()
        self.index.drop_oldest(len(response))
        self.num_tokens -= len(response)
