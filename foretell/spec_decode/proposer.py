"""The Proposer interface: what a drafter is given each step (DraftBatch), what it returns
(Proposal), and what it can do (ProposerCapabilities: typed, read by the runner and the engine
instead of probing the object). The method -> class table is registry.py.

After the target's forward and verification, the runner hands the proposer, for every sequence of
the step: the rows whose target outputs are final (a prefill chunk, or the accepted prefix of a
verify: p0 .. p0+v-1), the token after them (the newly sampled one, or the next prompt token of a
chunked prefill), the target's hidden states of those rows, and the block table. A proposer that
keeps its own KV cache writes the rows it needs from that (catch-up), so its cache is correct
for every accepted token before it drafts; then, for sequences that sampled, it proposes k tokens.
Proposers never read the runner's buffers; everything arrives here.

A drafter whose whole greedy loop can also run on the padded verify step's device tensors (the
runner's graphed step, spec_decode/draft_graph.py) returns itself as a PaddedDrafter from
padded_drafter(); one that cannot (n-gram, on the host) returns None and drafts through propose().
One that drafts from the token lists alone (n-gram, suffix: capabilities.drafts_from_tokens) gets
a DraftBatch without device tensors (runner/host_drafts.py) and no rows gathered for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from foretell.device_util import to_device
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.sampling_params import SamplingParams


@dataclass
class DraftBatch:
    start_positions: list[int]  # per sequence: p0, position of its first row this step
    num_valid_rows: list[int]  # per sequence: v >= 1, rows whose target outputs are final
    next_token_ids: list[int]  # per sequence: the token at position p0 + v
    samples: list[bool]  # per sequence: sampled this step, so it needs k drafts
    token_ids: torch.Tensor  # [sum v] int64, the step's input tokens of the valid rows
    hidden_states: torch.Tensor  # [sum v, hidden] target final hidden (after its last norm)
    aux_hidden_states: list[torch.Tensor]  # each [sum v, hidden]: inputs of the aux layers
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, the target's
    block_size: int  # the target's
    sampling_params: list[SamplingParams]
    sample_indices: list[int]  # per sequence: which of its request's n samples it is
    max_model_len: int  # no row may sit at a position past max_model_len - 1 (rotary, draft KV)
    histories: list[list[int]] = field(default_factory=list)  # all tokens through next token
    seq_ids: list[int] = field(default_factory=list)  # per sequence: its id (a host drafter's state)
    # structured/draft_mask.DraftMask: the grammars a model drafter's loop masks its logits with
    # (None: no drafting sequence has structured outputs, and the loop does nothing extra)
    draft_mask: Any = None
    # At most this many drafts per sequence this step (None: the proposer's k): the choice of
    # adaptive speculation (spec_decode/adaptive.py); 0 only catches up.
    max_drafts: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.start_positions)

    def num_tokens_after_step(self, i: int) -> int:
        """Sequence i's length once its next token is appended (p0 + v + 1): its first draft
        would sit at this position."""
        return self.start_positions[i] + self.num_valid_rows[i] + 1

    def num_useful_drafts(self, i: int, k: int) -> int:
        """How many of k drafts sequence i can ever have verified: only positions below
        max_model_len (the scheduler caps a verify there), none when it did not sample or this
        step ends it at the limit."""
        if not self.samples[i]:
            return 0
        if self.max_drafts is not None:
            k = min(k, self.max_drafts)
        return max(0, min(k, self.max_model_len - self.num_tokens_after_step(i)))

    def valid_row_offsets(self) -> list[int]:
        offsets = [0]
        for v in self.num_valid_rows:
            offsets.append(offsets[-1] + v)
        return offsets


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence: k drafts (empty when it did not sample)
    probs: list[torch.Tensor | None]  # per sequence: [k, target_vocab] draft distribution, or None


@dataclass(frozen=True)
class ProposerCapabilities:
    #: Layers (input of layer i) whose residual streams the target must return, in order.
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: Whether the drafts are always argmax (then no draft probabilities are kept).
    deterministic: bool = False
    #: Whether the draft KV at position t depends on token t + 1 (EAGLE3, MTP): then a
    #: prefix-cache hit must stop one block short (see BlockManager.reuse_margin_blocks).
    draft_kv_reads_next_token: bool = False
    #: Whether the drafts come from the token lists alone (n-gram, suffix): the proposer reads
    #: only DraftBatch's host fields (histories, seq_ids, samples, positions), none of its tensors,
    #: so the runner hands it no device rows and verifies its drafts on the padded step
    #: (runner/host_drafts.py).
    drafts_from_tokens: bool = False
    #: Whether a step may run no drafter at all, its catch-up skipped (adaptive speculation's
    #: steps that draft nothing next: adaptive_skip_catch_up): the drafter reads the target's
    #: hidden states each step (EAGLE3, MTP), so its KV cache may keep holes at the skipped
    #: positions (never-written or stale slots: finite values, read as slightly wrong context;
    #: drafts get worse, the output stays exact). Not a draft LM: its KV cache is its only context.
    catch_up_skippable: bool = False
    #: The most positions the drafter's own model can embed (a draft LM's rotary table), or None
    #: when it has no limit of its own; the runner keeps max_model_len within it.
    max_positions: int | None = None


class PaddedDrafter(Protocol):
    """A drafter whose whole greedy loop runs on the padded step's device tensors (capturable)."""

    row_offset: int  # -1: the row at t pairs features at t with token t + 1 (EAGLE3, MTP); 0: a draft LM
    draft_block_size: int
    greedy_without_logits: bool  # a head split over tensor-parallel ranks: greedy drafts from row maxima

    def padded_catch_up(
        self,
        input_ids: torch.Tensor,  # [rows] token fed at each row (rows = bucket * rows per sequence)
        positions: torch.Tensor,  # [rows]
        metadata: AttentionMetadata,
        hidden: torch.Tensor,  # [verify rows, hidden] target final hidden states
        aux: list[torch.Tensor],  # each [verify rows, hidden]
        last_rows: torch.Tensor,  # [bucket] the row whose output drafts token 1
        greedy_only: bool = False,  # asked only of a drafter with greedy_without_logits
    ) -> tuple[torch.Tensor, Any]:
        """The catch-up over every row: (logits of last_rows [bucket, draft_vocab], chain state);
        with greedy_only their greedy drafts as target ids [bucket] int64 instead."""
        ...

    def chain_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, state: Any,
        greedy_only: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """One single-row step per sequence: logits [n, draft_vocab] (greedy_only: greedy drafts as
        target ids [n] int64) and the next state."""
        ...

    def greedy_target_ids(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's argmax as a target id: [n] int64 (written into out when given)."""
        ...


class Proposer(Protocol):
    method: str
    k: int  # num_speculative_tokens

    @property
    def capabilities(self) -> ProposerCapabilities: ...

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        """Build / load the drafter once the target is loaded (it may share the target's
        weights); load_format is the target's ("dummy": random weights, no files)."""
        ...

    def kv_layers(self) -> list[nn.Module]:
        """Attention layers of the drafter that need a DraftKVCache (none for n-gram)."""
        ...

    def draft_modules(self) -> list[nn.Module]:
        """The drafter's own modules (after load), e.g. for binding its linears' small-M GEMM."""
        ...

    @property
    def draft_dtype(self) -> torch.dtype | None: ...

    def bind_draft_cache(self, block_size: int) -> None:
        """Told once the DraftKVCache is allocated: the block size its metadata must use."""
        ...

    def padded_drafter(self) -> PaddedDrafter | None:
        """This drafter for the padded step's draft loop, or None when it drafts on the host only."""
        ...

    def propose(self, batch: DraftBatch) -> Proposal: ...

    def forget(self, seq_id: int) -> None:
        """A sequence finished, was aborted or preempted: drop (or keep for others, the suffix
        cache) what the drafter held for it."""
        ...

    def drop_cached_responses(self) -> None:
        """Forget what finished requests left for later ones (the suffix drafter's global cache):
        after synthetic requests (engine/warm_up.py)."""
        ...

    def stats(self) -> dict:
        """What the drafter adds to get_stats() (the suffix gate's bar); {} for most."""
        ...


class ProposerBase:
    """Defaults for a Proposer without a model of its own (no KV cache, no padded loop)."""

    method: str = ""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities()

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        pass

    def kv_layers(self) -> list[nn.Module]:
        return []

    def draft_modules(self) -> list[nn.Module]:
        return []

    @property
    def draft_dtype(self) -> torch.dtype | None:
        return None

    def bind_draft_cache(self, block_size: int) -> None:
        pass

    def padded_drafter(self) -> PaddedDrafter | None:
        return None

    def propose(self, batch: DraftBatch) -> Proposal:
        raise NotImplementedError

    def forget(self, seq_id: int) -> None:
        pass

    def drop_cached_responses(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


def catch_up_metadata(
    start_positions: list[int],
    num_rows: list[int],
    block_table: torch.Tensor,
    block_size: int,
    draft_block_size: int,
    slot_mapping: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata for a drafter forward of num_rows[i] rows per sequence starting at position
    start_positions[i], over the draft cache (same slots, its own block size). slot_mapping
    [sum num_rows] int64: the rows' slots when the caller has them (a catch-up pass:
    draft_loop.catch_up_rows), else each position's slot in block_table."""
    device = block_table.device
    query_start = [0]
    seq_lens: list[int] = []
    for p0, n in zip(start_positions, num_rows):
        query_start.append(query_start[-1] + n)
        seq_lens.append(p0 + n)
    if slot_mapping is None:
        positions = [p for p0, n in zip(start_positions, num_rows) for p in range(p0, p0 + n)]
        pos = to_device(positions, torch.int64, device)
        seq_index = torch.repeat_interleave(  # output_size given: no read of the counts back (a sync)
            torch.arange(len(num_rows), device=device), to_device(num_rows, torch.int64, device),
            output_size=len(positions),
        )
        blocks = block_table[seq_index, pos // block_size].to(torch.int64)
        slot_mapping = blocks * block_size + pos % block_size
    # One upload: query starts [B + 1], padding so that the lengths start 16-byte aligned (as a
    # tensor of their own would: Triton specialises pointers on it), the lengths [B].
    lengths_at = -(-len(query_start) // 4) * 4
    packed = to_device(query_start + [0] * (lengths_at - len(query_start)) + seq_lens, torch.int32, device)
    metadata = AttentionMetadata(
        query_start_loc=packed[: len(query_start)],
        seq_lens=packed[lengths_at:],
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        max_query_len=max(num_rows),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )
    return metadata.with_block_size(draft_block_size)

