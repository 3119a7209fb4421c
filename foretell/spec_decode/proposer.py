"""The Proposer interface, what it is given each step (DraftBatch), and the table of methods.

After the target's forward and verification, the runner hands the proposer, for every sequence of
the step: the rows whose target outputs are final (a prefill chunk, or the accepted prefix of a
verify: p0 .. p0+v-1), the token after them (the newly sampled one, or the next prompt token of a
chunked prefill), the target's hidden states of those rows, and the block table. A proposer that
keeps its own KV cache writes the rows it needs from that (catch-up), so its cache is correct
for every accepted token before it drafts; then, for sequences that sampled, it proposes k tokens.
Proposers never read the runner's buffers; everything arrives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


class Proposer:
    """Base class: subclasses set the capabilities they need and implement propose()."""

    method: str = ""
    #: Layers (input of layer i) whose residual streams the target must return, in order.
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: Whether the proposer's drafts are always argmax (then no draft probabilities are kept).
    deterministic: bool = False
    #: Whether a greedy verify step's whole draft loop can run as one CUDA graph.
    graph_capable: bool = False
    #: Whether the draft KV at position t depends on token t + 1 (EAGLE3, MTP): then a
    #: prefix-cache hit must stop one block short (see BlockManager.reuse_margin_blocks).
    draft_kv_reads_next_token: bool = False
    #: The most positions the drafter's own model can embed (a draft LM's rotary table), or None
    #: when it has no limit of its own; the runner keeps max_model_len within it.
    max_positions: int | None = None

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        """Build / load the drafter once the target is loaded (it may share the target's
        weights); load_format is the target's ("dummy": random weights, no files)."""

    def kv_layers(self) -> list[nn.Module]:
        """Attention layers of the drafter that need a DraftKVCache (none for n-gram)."""
        return []

    def draft_modules(self) -> list[nn.Module]:
        """The drafter's own modules (after load), e.g. for binding its linears' small-M GEMM."""
        return []

    @property
    def draft_dtype(self) -> torch.dtype | None:
        return None

    def bind_draft_cache(self, block_size: int) -> None:
        """Told once the DraftKVCache is allocated: the block size its metadata must use."""

    def propose(self, batch: DraftBatch) -> Proposal:
        raise NotImplementedError


def catch_up_metadata(
    start_positions: list[int],
    num_rows: list[int],
    block_table: torch.Tensor,
    block_size: int,
    draft_block_size: int,
) -> AttentionMetadata:
    """Metadata for a drafter forward of num_rows[i] rows per sequence starting at position
    start_positions[i], over the draft cache (same slots, its own block size)."""
    device = block_table.device
    query_start = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    for p0, n in zip(start_positions, num_rows):
        query_start.append(query_start[-1] + n)
        seq_lens.append(p0 + n)
        positions.extend(range(p0, p0 + n))
    pos = to_device(positions, torch.int64, device)
    seq_index = torch.repeat_interleave(
        torch.arange(len(num_rows), device=device), to_device(num_rows, torch.int64, device)
    )
    blocks = block_table[seq_index, pos // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + pos % block_size
    metadata = AttentionMetadata(
        query_start_loc=to_device(query_start, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        max_query_len=max(num_rows),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )
    return metadata.with_block_size(draft_block_size)


def build_proposer(config, target_hf_config, options) -> Proposer:
    """Construct the proposer for a SpeculativeConfig from the explicit method table."""
    from foretell.spec_decode.draft_model import DraftModelProposer
    from foretell.spec_decode.eagle3_mla import Eagle3MLAProposer
    from foretell.spec_decode.mtp import MTPProposer
    from foretell.spec_decode.ngram import NgramProposer

    table: dict[str, type[Proposer]] = {
        "eagle3": Eagle3MLAProposer,  # an Eagle3Proposer, or its MLA-head subclass by head config
        "mtp": MTPProposer,
        "draft_model": DraftModelProposer,
        "ngram": NgramProposer,
    }
    if config.method not in table:
        raise ValueError(
            f"speculative method {config.method!r} is not available; available: {sorted(table)}"
        )
    return table[config.method].from_config(config, target_hf_config, options)
