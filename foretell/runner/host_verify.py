"""A host drafter's greedy verify step, verified on the host from the target's greedy tokens.

The padded verify step (graphed_verify.GraphedVerify) verifies on the device so that the step
after it can be queued before the host reads anything: the draft loop and the next step's inputs
read the accepted counts there. A host drafter (n-gram, suffix: host_drafts.HostDraftSlots) has
neither: its drafts come from the host lists after the read, so the step after a drafting step is
always launched from host inputs, and nothing on the device ever reads the verification's outputs.
For such a step whose rows are all greedy, with no logits controls, logprobs or grammar (the
verification reads the target's greedy tokens as the graph left them) and an exact verifier,
GraphedVerify.launch returns a HostVerifiedStep instead: the graph's greedy tokens of the step's
rows ([n * q], one contiguous view of the graph's output) are copied to the host on the graph's
stream, and acceptance is counted on the host (greedy_accept_on_host), as accept_drafts counts it
on the device: each sequence accepts its drafts up to the first that differs from the target's
token at its row, capped at its real drafts (padded rows are never accepted) and its accept limit;
its next token is the target's at the row after them.

What this leaves out of a drafting step, per step: the caps' upload, the verification kernel's
launch, the views over the graph's outputs and the draft loop's buffers, and the read-back's
concatenation on the side stream (with its stream switch and event waits): one copy of the
greedy tokens and one event instead. The host's count is a loop over at most the accepted drafts
plus one of each sequence.

Never queued ahead itself (its drafts are the host's: matches() is never true). What follows it,
when the pipeline queues ahead and the runner has plain decoding's graphs (`fallback`): the plain
decode step after it, on the guess that the drafter drafts nothing next (most drafting runs end
after a step or two, and a step after a drafting one used to be launched from host inputs and
waited for whole). launch_next() verifies the step on the device too (accept_drafts: the same
counts the host's loop finds, tests/runner/test_host_verify.py) and turns the verify's buffers into
the (bucket, 1) decode graph's inputs on the device (ops/step/verify_to_decode.py), then replays
it; read() tells that decode step the positions and slots it used, known once the host has counted
the accepted drafts. The scheduler's next decision takes it when nobody drafts (a fallback step
then costs what a plain step queued ahead costs), and the pipeline drops it otherwise (safe: the
slot it wrote is the next step's first row's, written again with the same token at the same
position; runner/decode_ahead.py says why a dropped step is harmless). It is not queued when a
sequence could stop at this step (max_tokens or max_model_len within its drafts and one more
token) or when its furthest next position lies past the blocks the buffers' table holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.ops.step.dispatch import accept_drafts
from foretell.runner.launched_decode import LaunchedDecode
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy

if TYPE_CHECKING:
    from foretell.runner.cuda_graph import CudaGraphRunner
    from foretell.runner.decode_ahead import DecodeAhead
    from foretell.runner.host_drafts import DrafterRows


def greedy_accept_on_host(tokens: list[int], q: int, draft_ids: list[list[int]],
                          limits: list[int | None]) -> list[SequenceResult]:
    """Greedy verification of a padded step from the target's greedy token at each row: tokens
    [n * q] (sequence i's rows at i * q .. i * q + q - 1), each sequence's real drafts (at most
    q - 1; the rest of its rows padding) and accept limit (None: none). Returns each sequence's
    result: its accepted drafts and the target's token after them, the count, and the drafts it
    verified (as many as it may accept)."""
    if len(tokens) != q * len(draft_ids) or len(limits) != len(draft_ids):
        raise ValueError(f"{len(tokens)} tokens for {len(draft_ids)} sequences of {q} rows "
                         f"({len(limits)} accept limits)")
    results = []
    row = 0
    for drafts, limit in zip(draft_ids, limits):
        if len(drafts) >= q:
            raise ValueError(f"{len(drafts)} drafts do not fit a step of {q} rows per sequence")
        cap = len(drafts) if limit is None else min(len(drafts), limit)
        accepted = 0
        while accepted < cap and tokens[row + accepted] == drafts[accepted]:
            accepted += 1
        results.append(SequenceResult(new_token_ids=drafts[:accepted] + [tokens[row + accepted]],
                                      num_accepted=accepted, num_drafts=cap))
        row += q
    return results


@dataclass
class FallbackDecode:
    """What a host-verified step needs to queue the plain decode step after it (module docstring)."""

    decode: DecodeAhead  # the plain decode kind whose steps follow (its launch_next, its reads)
    graphs: CudaGraphRunner  # the target's graphs: the verify ran on (bucket, q), the decode on (bucket, 1)
    accepted: torch.Tensor  # [>= n] int64: the device's accepted counts (HostDraftSlots' buffer)
    next_token: torch.Tensor  # [>= n] int64: ... and next tokens
    num_live: torch.Tensor  # 0-d int64
    caps: list[int] | None  # most drafts each sequence may accept (None: all of its q - 1)
    starts: list[int]  # each sequence's first verify position (its computed tokens at launch)
    table_ends: list[int]  # each sequence's first position past the blocks the buffers' table holds
    inputs_version: int  # the graph runner's inputs_version after the verify's inputs were written

    @classmethod
    def after(cls, verify, seqs: list[Sequence], batch, q: int, lengths: list[int],
              limits: list[int | None]) -> "FallbackDecode | None":
        """For a host-verified step of `verify` (a GraphedVerify) just replayed from `batch` (q rows
        per sequence, each with lengths[i] real drafts and an accept limit); None without plain
        decoding's kind (verify.fallback_decode: no queueing ahead)."""
        if verify.fallback_decode is None:
            return None
        caps = None  # (acceptance capped as the host's count caps it: padded rows and accept limits)
        if any(n != q - 1 for n in lengths) or any(limit is not None for limit in limits):
            caps = [n if limit is None else min(n, limit) for n, limit in zip(lengths, limits)]
        slots, graphs = verify.draft_graphs, verify.graphs
        return cls(verify.fallback_decode, graphs, slots.accepted, slots.next_token, slots.num_live, caps,
                   [seq.num_computed_tokens for seq in seqs],
                   [len(blocks) * verify.block_size for blocks in batch.block_ids], graphs.inputs_version)


@dataclass
class HostVerifiedStep:
    """A padded verify step on its way whose verification the host does at read (a QueuedStep of
    runner/step_pipeline.py, followed by a plain decode step when `fallback` is set)."""

    seqs: list[Sequence]
    key: tuple[int, int]  # (batch bucket, q: rows per sequence) of the graph it ran
    copy: HostCopy  # of the target's greedy tokens [len(seqs) * q]
    draft_token_ids: list[list[int]]  # each sequence's real drafts
    accept_limits: list[int | None]
    fallback: FallbackDecode | None = None  # None: nothing is queued after it
    drafter_rows: "DrafterRows | None" = None  # the step's target rows, for a hybrid's model drafter

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        return False  # never queued ahead

    def launch_next(self, num_next_drafts: int | None = None) -> LaunchedDecode | None:
        """The plain decode step after this one, queued on the device (module docstring), or None."""
        fallback = self.fallback
        if fallback is None or num_next_drafts is not None:  # (adaptive speculation chooses drafts: not here)
            return None
        graphs, decode = fallback.graphs, fallback.decode
        bucket, q = self.key
        decode_key = (bucket, 1)
        if graphs.inputs_version != fallback.inputs_version or (graphs.captures and decode_key not in graphs.graphs):
            return None
        caps = fallback.caps or [q - 1] * len(self.seqs)
        for seq, start, cap, end in zip(self.seqs, fallback.starts, caps, fallback.table_ends):
            furthest = start + cap + 1  # the decode's position when every draft it may accept is
            max_tokens = seq.sampling_params.max_tokens
            if furthest >= end or len(seq.token_ids) + cap + 1 >= decode.max_model_len:
                return None
            if max_tokens is not None and seq.num_output_tokens + cap + 1 >= max_tokens:
                return None
        n = len(self.seqs)
        greedy = graphs.graphs[self.key].greedy[: n * q].view(n, q)  # [n, q] int64, the verify's output
        drafts_in = graphs.input_ids[: n * q].view(n, q)[:, 1:]  # [n, q - 1], read before the advance rewrites it
        caps_t = None if fallback.caps is None else to_device(fallback.caps, torch.int64, greedy.device)  # [n]
        accept_drafts(greedy, drafts_in, caps_t, fallback.accepted, fallback.next_token, fallback.num_live)
        tokens = graphs.verify_to_decode(decode_key, n, q, fallback.accepted, fallback.next_token).greedy[:n]  # [n]
        return LaunchedDecode(decode, self.seqs, [], [], tokens, None, True, all_greedy=True, graph_key=decode_key,
                              inputs_version=graphs.inputs_version, table_ends=fallback.table_ends)

    def read(self, following: LaunchedDecode | None) -> list[SequenceResult]:
        results = greedy_accept_on_host(self.copy.read(), self.key[1], self.draft_token_ids, self.accept_limits)
        if following is not None:  # the decode step queued after this one: where it ran, now known
            block_size = following.kind.block_size
            for seq, start, result in zip(self.seqs, self.fallback.starts, results):
                position = start + result.num_accepted + 1
                following.positions.append(position)
                following.slots.append(seq.block_ids[position // block_size] * block_size + position % block_size)
        return results
