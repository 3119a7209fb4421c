"""The k-step loop shared by model-based drafters (EAGLE3, MTP, a draft LM).

Each step of the engine: one catch-up forward over the rows whose target outputs became final
(so the drafter's KV cache is right for every accepted token), then for the sequences that
sampled, draft token 1 from the catch-up's last row and tokens 2..k from single-row steps, each
feeding the previous draft token at the next position. Near max_model_len a sequence drafts
only the positions below it (DraftBatch.num_useful_drafts) and no row goes past max_model_len - 1
(the rotary table and the draft KV may end there). Greedy requests draft by argmax; sampled
requests draw from the drafter's own distribution (the same temperature / top-k / top-p / min-p)
and keep those probabilities for exact rejection sampling.

This loop serves the step from host inputs (runner/host_step.py). A batch where every sequence
verifies k drafts runs the same drafter through padded_catch_up() and chain_step() in the padded
step's draft loop instead (draft_graph.py, greedy drafts for every row): DraftLoopProposer is a
PaddedDrafter.

A drafter whose head splits the vocabulary over tensor-parallel ranks (MTP under the target's
tensor parallelism) sets greedy_without_logits: when every drafting sequence is greedy, the loop
asks its catch_up / chain_step for greedy draft tokens (greedy_only=True) instead of logits, and
no whole logits rows are gathered.

Structured outputs: when DraftBatch.draft_mask is set, each draft position's logits are masked
by the grammar state after the drafts before it (structured/draft_mask.py) before the argmax or
the draw, and a sampled draft's probabilities are those of the masked logits it was drawn from;
where the grammar forces the next token, that token is the draft (its probabilities one-hot).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from foretell.device_util import to_device
from foretell.layers.sampler import (
    NoiseSource,
    SamplingBatch,
    argmax_rows,
    processed_probs,
    row_seed,
    sample_from_probs,
)
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.step import reference
from foretell.spec_decode.proposer import (
    DraftBatch,
    PaddedDrafter,
    Proposal,
    ProposerBase,
    ProposerCapabilities,
    catch_up_metadata,
)

DRAFT_SEED_SALT = 0x2545F4914F6CDD1D


class DraftLoopProposer(ProposerBase):
    """Subclasses implement catch_up(), chain_step() and padded_catch_up(); state is whatever they
    carry between steps (EAGLE3 and MTP: the previous hidden state; a draft LM: nothing). Each is
    also a PaddedDrafter: its greedy loop runs on the padded step's tensors (draft_graph.py)."""

    #: Row position of a fed token relative to the token's own position: EAGLE3 and MTP rows
    #: pair the hidden state at t with token t+1 (offset -1); a draft LM feeds tokens in place (0).
    row_offset: int = -1
    #: Set by subclasses in __init__: the target layers read (EAGLE3), the drafter's own position
    #: limit (a draft LM's rotary table).
    aux_hidden_state_layers: tuple[int, ...] = ()
    max_positions: int | None = None
    #: Whether catch_up and chain_step take greedy_only=True and then return greedy draft tokens
    #: (target ids) [n] int64 in place of logits (a head split over tensor-parallel ranks).
    greedy_without_logits: bool = False
    #: Whether a draft tree's catch-up and expansion may run on tree/draft_graphs.py's graphs (EAGLE3's).
    tree_draft_graphs: bool = False

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities(
            aux_hidden_state_layers=self.aux_hidden_state_layers,
            draft_kv_reads_next_token=self.row_offset == -1,
            catch_up_skippable=self.row_offset == -1,  # reads the target's features (EAGLE3, MTP)
            max_positions=self.max_positions,
        )

    def padded_drafter(self) -> PaddedDrafter:
        return self

    device: torch.device
    draft_block_size: int
    target_vocab_size: int

    def init_loop(self, device: torch.device, target_vocab: int, seed: int = 0):
        self.device = device
        self.target_vocab_size = target_vocab
        self.noise = NoiseSource(device, seed ^ 0x5EED)

    def bind_draft_cache(self, block_size: int) -> None:
        self.draft_block_size = block_size

    # ---- subclass hooks ------------------------------------------------------------------
    def catch_up(
        self, batch: DraftBatch, last_rows: list[int]
    ) -> tuple[torch.Tensor, Any]:
        """Run the catch-up forward; return logits of `last_rows` sequences' last rows
        [n, draft_vocab] and the state for the first chain step."""
        raise NotImplementedError

    def chain_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, metadata, state: Any
    ) -> tuple[torch.Tensor, Any]:
        """One single-row step per sequence: logits [n, draft_vocab] and the next state."""
        raise NotImplementedError

    def padded_catch_up(
        self,
        input_ids: torch.Tensor,  # [rows] token fed at each row (rows = bucket * (k + 1))
        positions: torch.Tensor,  # [rows]
        metadata,
        hidden: torch.Tensor,  # [rows, hidden] target final hidden states
        aux: list[torch.Tensor],  # each [rows, hidden]
        last_rows: torch.Tensor,  # [bucket] the row whose output drafts token 1
    ) -> tuple[torch.Tensor, Any]:
        """The catch-up over every verify row with device-side inputs only (capturable; used by
        spec_decode/draft_graph.py)."""
        raise NotImplementedError

    def tree_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, state: Any, metadata
    ) -> tuple[torch.Tensor, Any]:
        """One forward over a draft tree's frontier rows (spec_decode/tree/proposer.py; metadata
        carries their ancestor mask): logits [rows, draft_vocab] and the state of each row."""
        return self.chain_step(tokens, positions, metadata, state)

    def select_state_rows(self, state: Any, rows: torch.Tensor) -> Any:
        """The state of the rows `rows` [m] int64 (a tree's parents): a per-row tensor's rows;
        a draft LM carries none."""
        return None if state is None else state.index_select(0, rows)

    # [draft_vocab] int64 target id of each draft id, for a drafter with a smaller vocabulary (EAGLE3's d2t)
    target_id_map: torch.Tensor | None = None

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.target_id_map is None else self.target_id_map[draft_ids]

    def greedy_target_ids(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy drafts: each row's argmax (logits [n, draft_vocab]), mapped to target ids by the
        argmax's own last launch: [n] int64, written into `out` (any stride) when given."""
        return argmax_rows(logits, self.target_id_map, out)

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape[-1] == self.target_vocab_size:
            return probs
        out = probs.new_zeros(probs.shape[0], self.target_vocab_size)
        width = min(probs.shape[-1], self.target_vocab_size)
        out[:, :width] = probs[:, :width]
        return out

    # ---- the loop --------------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> Proposal:
        # Near max_model_len a sequence drafts only the positions below it (the scheduler never
        # verifies more), and none when this step ends it there: then it only catches up, so a
        # draft LM feeds no row at its next token's position (max_model_len itself at the limit).
        useful = [batch.num_useful_drafts(i, self.k) for i in range(batch.num_seqs)]
        sampling = [i for i, n in enumerate(useful) if n]
        if [bool(n) for n in useful] != batch.samples:
            batch = replace(batch, samples=[bool(n) for n in useful])
        params = [batch.sampling_params[i] for i in sampling]
        grammar = None if batch.draft_mask is None else batch.draft_mask.begin(sampling, self.target_id_map)
        greedy_only = self.greedy_without_logits and all(p.greedy for p in params) and grammar is None
        head = {"greedy_only": True} if greedy_only else {}  # the hooks then return tokens, not logits
        logits, state = self.catch_up(batch, sampling, **head)
        if not sampling:
            return Proposal([[] for _ in range(batch.num_seqs)], [None] * batch.num_seqs)
        # Position of the token each draft step predicts; the first is the one after next_token.
        positions = [batch.num_tokens_after_step(i) for i in sampling]
        last_position = batch.max_model_len - 1
        table = batch.block_table[sampling]
        num_steps = max(useful)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(num_steps):
            if grammar is not None:
                logits = grammar.mask(logits)  # [n, draft_vocab]: -inf where the grammar forbids
            if greedy_only:
                tokens, step_probs = logits, None  # the greedy drafts themselves
            else:
                tokens, step_probs = self._sample(logits, params, [p + step for p in positions], batch, sampling)
            if grammar is not None:  # where the grammar forces a token, it is the draft (q one-hot)
                tokens, step_probs = grammar.force(tokens, step_probs)
            drafts.append(tokens)
            if step_probs is not None:
                probs.append(step_probs)
            if step == num_steps - 1:
                break
            if grammar is not None:
                grammar.advance(tokens)
            # The new draft sits at position p + step; its row predicts the token after it. A
            # sequence that needs no more drafts rides along at last_position: its row never
            # reads or writes past the limit, and its drafts from here on are dropped below.
            rows = [min(p + step + self.row_offset, last_position) for p in positions]
            metadata = catch_up_metadata(
                rows, [1] * len(rows), table, batch.block_size, self.draft_block_size
            )
            pos_t = to_device(rows, torch.int64, self.device)
            logits, state = self.chain_step(tokens, pos_t, metadata, state, **head)
        token_lists = torch.stack(drafts, dim=1).tolist()  # [n, num_steps]
        stacked = torch.stack(probs, dim=1) if probs else None  # [n, num_steps, target_vocab]
        out_tokens: list[list[int]] = [[] for _ in range(batch.num_seqs)]
        out_probs: list[torch.Tensor | None] = [None] * batch.num_seqs
        for j, i in enumerate(sampling):
            out_tokens[i] = token_lists[j][: useful[i]]
            if stacked is not None and not params[j].greedy:
                out_probs[i] = stacked[j, : useful[i]]
        return Proposal(out_tokens, out_probs)

    def _sample(self, logits, params, positions, batch, sampling):
        """Draft tokens (target ids) [n] and, unless all greedy, their distributions [n, V]."""
        seeds = [
            None if p.seed is None else row_seed(p.seed ^ DRAFT_SEED_SALT, batch.sample_indices[i], pos)
            for p, i, pos in zip(params, sampling, positions)
        ]
        sb = SamplingBatch.build(params, seeds, logits.shape[-1], self.device)
        if sb.all_greedy:
            return self.greedy_target_ids(logits), None
        q = processed_probs(logits, sb)  # [n, draft_vocab]
        draft_ids = sample_from_probs(q, self.noise.exponential(seeds, q.shape[-1]))
        return self.to_target_ids(draft_ids), self.to_target_probs(q)


def catch_up_rows(
    batch: DraftBatch, row_offset: int, draft_block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A catch-up pass of the step from host inputs: (input tokens [rows] int64, positions [rows]
    int64, attention metadata over the draft cache).

    Which token each row is fed, its position and its KV slot are the padded step's definition
    (ops/step reference.catch_up_rows_torch), run on this batch padded to its longest sequence:
    a sequence's valid rows t_0 .. t_{v-1} and next token x stand as a verify that accepted v - 1
    drafts. Row r sits at p0 + r and is fed the token at p0 + r + shift (shift = -row_offset).
    Each sequence keeps its rows through the one fed x (EAGLE3, MTP: v rows; a draft LM: v + 1),
    except that a draft LM sequence that does not sample (a chunked prefill, or a step that ends
    it at max_model_len) keeps only its v valid rows. The row counts and context lengths stay on
    the host too (the metadata's host copies): nothing is read back from the device.
    """
    shift = -row_offset
    valid = batch.num_valid_rows
    counts = [v + 1 - shift if sampled else v for v, sampled in zip(valid, batch.samples)]
    num_seqs, width, rows_per_seq = batch.num_seqs, max(valid), max(counts)
    # Host ints in one copy: p0, v - 1 and x per sequence, then (only where the sequences differ in
    # length) where the valid rows sit in the padded grid and which padded rows are kept.
    pieces = [torch.tensor([*batch.start_positions, *[v - 1 for v in valid], *batch.next_token_ids])]
    if min(valid) < width:
        pieces.append(_row_index(valid, width))  # [sum v]
    if min(counts) < rows_per_seq:
        pieces.append(_row_index(counts, rows_per_seq))  # [sum counts]
    host_ints = to_device(torch.cat(pieces), torch.int64, batch.token_ids.device)
    first_pos, accepted, next_token = host_ints[: 3 * num_seqs].view(3, num_seqs)  # each [B]
    grid = batch.token_ids  # [B * width]: each sequence's valid rows, then padding
    if min(valid) < width:
        grid_index = host_ints[3 * num_seqs : 3 * num_seqs + len(batch.token_ids)]
        grid = grid.new_zeros(num_seqs * width).index_copy_(0, grid_index, batch.token_ids)
    keep = host_ints[-sum(counts) :] if min(counts) < rows_per_seq else None  # None: every padded row
    # A shorter sequence's padding rows (dropped below) may sit past the blocks the table lists.
    last_padded = min(max(batch.start_positions) + rows_per_seq, batch.max_model_len) - 1
    table = batch.block_table  # [B, W] int32
    if last_padded // batch.block_size >= table.shape[1]:
        table = torch.nn.functional.pad(table, (0, last_padded // batch.block_size + 1 - table.shape[1]))
    tokens, positions, slots = reference.catch_up_rows_torch(
        grid.view(num_seqs, width), first_pos, accepted, next_token,  # as if each accepted v - 1 drafts
        None,  # every sequence is live
        table, batch.block_size, rows_per_seq, shift, batch.max_model_len - 1,
    )  # each [B, rows_per_seq]
    metadata = catch_up_metadata(
        list(batch.start_positions), counts, batch.block_table, batch.block_size, draft_block_size,
        slot_mapping=_kept(slots, keep),
    )
    return _kept(tokens, keep), _kept(positions, keep), metadata


def _kept(padded: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """padded [B, n] -> [rows]: its rows listed in keep (None: all), flattened."""
    return padded.flatten() if keep is None else padded.flatten().index_select(0, keep)


def _row_index(lengths: list[int], stride: int) -> torch.Tensor:
    """[sum lengths] int64 on the host: i * stride + r for each sequence i and each r < lengths[i]
    (stride >= max(lengths)): where each sequence's rows sit in a [B, stride] grid."""
    in_grid = torch.arange(stride)[None, :] < torch.tensor(lengths)[:, None]  # [B, stride]
    return in_grid.flatten().nonzero().squeeze(1)
