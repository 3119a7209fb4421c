"""Paged KV blocks: allocation with reference counts, and prefix caching over full blocks.

A block is identified by an integer id; the runner's cache tensors are indexed by it. A full block
whose tokens are all final gets a hash chained from its parent's hash and its own tokens, so a new
sequence that starts with the same tokens reuses it. Freed blocks keep their hash and stay findable
until they are handed out again (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from foretell.engine.sequence import Sequence


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(",".join(map(str, tokens)).encode())  # the same bytes as joining each token's
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reuse_margin_blocks: int = 0,
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for no block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Cached blocks at the end of a hit that are recomputed rather than reused. A drafter
        # whose KV at position t depends on token t + 1 (EAGLE3, MTP) needs 1: the draft KV at a
        # block's last slot was written for the token that followed it in the *earlier*
        # sequence, which is known to match only inside the hit.
        self.reuse_margin_blocks = reuse_margin_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # How many leading blocks of each sequence are hashed (so commit only hashes new ones).
        self._num_hashed: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def admit(self, seq: Sequence) -> None:
        """Attach the longest cached prefix of a new (or preempted) sequence's tokens.

        At least one token is left to compute, so the step that follows produces logits.
        """
        seq.num_cached_prompt_tokens = 0
        # A request for prompt logprobs needs the logits of every prompt position: no reuse.
        wants_prompt_logprobs = seq.sampling_params.prompt_logprobs is not None
        if not self.enable_prefix_caching or seq.block_ids or wants_prompt_logprobs:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = None
        hit: list[int] = []
        for i in range(max_blocks):
            parent = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(parent)
            if block is None:
                break
            hit.append(block)
        hit = hit[: max(0, len(hit) - self.reuse_margin_blocks)]
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        for block in hit:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        seq.block_ids = hit
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens
        self._num_hashed[seq.seq_id] = len(hit)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's blocks to hold num_tokens tokens; False (and no change) if full."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)  # blocks_needed, inline
        if needed <= 0:  # the common decode step: its slot is in a block it holds
            return True
        if needed > len(self.free_queue):
            return False
        seq.block_ids.extend(self._take_free_block() for _ in range(needed))
        return True

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that became full of final tokens, so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        done = self._num_hashed.get(seq.seq_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= done:
            return
        parent = self.block_hash[seq.block_ids[done - 1]] if done else None
        for i in range(done, full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hash_block(parent, tokens)
            block = seq.block_ids[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = parent
                self.cached.setdefault(parent, block)
        self._num_hashed[seq.seq_id] = full

    def free(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are reused before its prefix blocks.
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_ids = []
        self._num_hashed.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the hit statistics (after the start-up warm-up).
        Only while no sequence holds a block: a held block's hash would be lost."""
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError("reset_prefix_cache needs every KV block free")
        self.block_hash = [None] * self.num_blocks
        self.cached.clear()
        self.prefix_queries = self.prefix_hits = 0
