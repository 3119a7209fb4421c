"""Per-step attention metadata: where each sequence's queries sit, how long its context is, and
which cache slots its new tokens go to.

One object is built per forward by the runner and passed down the call; nothing here is global.
Every batch is "varlen": sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]
(a prefill chunk, one decode token, or 1 + k verify tokens), and after this step's writes its
cache holds seq_lens[i] tokens. The queries are the *last* rows of that context, so query row j of
sequence i sits at position seq_lens[i] - query_len[i] + j and attends causally to keys 0..that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step's writes
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch backend loops over sequences with them, no device sync needed.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # A tree verify (or a draft tree's frontier rows): [num_tokens, W] bool, which of its sequence's
    # last W keys each row sees (ops/attention/reference.py); None: causal.
    tree_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def check_cache_block_size(self, cache_block_size: int, cache: str = "cache") -> None:
        """A kernel reads the cache paged as this metadata says: ValueError naming both sizes if
        the cache (`cache` names it in the message) has blocks of another size."""
        if cache_block_size != self.block_size:
            raise ValueError(f"metadata is paged with block_size {self.block_size} but the {cache} has blocks of "
                             f"{cache_block_size}; derive it with AttentionMetadata.with_block_size")

    def with_block_size(self, block_size: int) -> "AttentionMetadata":
        """The same batch seen through a cache paged with a smaller block size.

        A draft's cache may use its own block size. Both caches index the same flat token
        slots, so a target block b of size B maps to draft blocks b*r .. b*r + r-1 with
        r = B / block_size, and the slot mapping is unchanged.
        """
        if block_size == self.block_size:
            return self
        table = subdivide_block_table(self.block_table, self.block_size, block_size)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=table,
            slot_mapping=self.slot_mapping,
            block_size=block_size,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
            tree_mask=self.tree_mask,
        )


def subdivide_block_table(block_table: torch.Tensor, block_size: int, new_block_size: int) -> torch.Tensor:
    """A block table [num_seqs, max_blocks] of block_size-token blocks seen in blocks of
    new_block_size (which divides it): [num_seqs, max_blocks * r], r = block_size / new_block_size,
    block b becoming blocks b*r .. b*r + r - 1."""
    if new_block_size == block_size:
        return block_table
    if block_size % new_block_size != 0:
        raise ValueError(f"draft block size {new_block_size} must divide the target block size {block_size}")
    ratio = block_size // new_block_size
    sub = torch.arange(ratio, device=block_table.device, dtype=block_table.dtype)
    return (block_table.unsqueeze(-1) * ratio + sub).flatten(1)  # [num_seqs, max_blocks, ratio] flattened
