"""Host drafters (n-gram, suffix: ProposerCapabilities.drafts_from_tokens) in a step: their drafts
come from the token lists the host already holds, so a step with one does no device work for the
drafter at all.

Two pieces:
  - token_draft_batch(): the DraftBatch such a drafter reads (each sequence's tokens through its
    newest one, what it may draft), built from host lists only: no rows gathered from the
    forward's input ids or hidden states, no device tensor at all (the host step and the padded
    step both use it);
  - HostDraftSlots: what the padded verify step (graphed_verify.GraphedVerify) takes as its
    draft loop for such a drafter. It drafts nothing on the device (m = 0 drafts per sequence),
    it only holds the buffers the verifier writes (accepted count, next token, live sequences).
    So a host drafter's verify is the target's (bucket, q) graph replay (q: 1 when no sequence
    drafts, else the smallest verify length of host_draft_verify_lens() that holds 1 + the step's
    longest draft, shorter drafts padded), verification on the device and one read back of the whole
    step, and after it the drafter proposes from the host lists (propose_from_tokens). Before this
    every verify with sequences of unequal draft counts (the common case: a suffix draft's length is
    the match's) ran the target eagerly from host inputs, then gathered the valid rows' ids and
    hidden states the drafter never reads. Without graphs (the CPU's torch backend, --enforce-eager)
    the same step runs on the same buffers eagerly (graph_setup.py's padded_forward): one path for
    every drafter (on the CPU the default family ran as fast on it as on the host step's unpadded
    rows: docs/perf-log.md, 2026-12-03); tensor parallelism keeps the host step. A hybrid drafter
    (suffix + a model) takes the padded step the same way, its model drafter catching up on the host
    over the step's rows (DrafterRows, HostStep.propose) after the read: nothing is queued ahead of
    it, since its catch-up reads the forward's outputs of every step.

The verify lengths (host_draft_verify_lens): a host drafter's draft is as long as its match
allows, so most steps verify far fewer than K drafts (a suffix match of 3 tokens drafts at most 3
under max_spec_factor 1). The target's graphs are captured for q = 1 and 1 + ceil(K / 4),
1 + ceil(K / 2), 1 + K (K = 16: 1, 5, 9, 17 rows per sequence), and a step pads every sequence to
the smallest that holds its longest draft: past K / 4 drafts that longest one computes fewer
than twice its useful rows, where one length of K + 1 padded a step of 4 drafts to 17 rows. Three
lengths and not every one of 1..K + 1: each length is a graph per batch bucket (capture time,
memory).

A step of the padded kind whose sequences carry no drafts at all (q = 1: nobody matched last step)
can queue the step after it on the device, as plain decoding does (step_pipeline.py): the launch
is used when the drafter again drafts nothing for any of them, and dropped (safely: decode_ahead.py
says why) when it drafts for one. A greedy step that verifies drafts queues the plain step after it
the same way, on the device's own verification of it (runner/host_verify.py): used when the drafter
drafts nothing next (a match that ended), dropped when it drafts again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.engine.scheduler import SchedulerOutput
from foretell.runner.input_batch import InputBatch
from foretell.runner.sequence_result import SequenceResult
from foretell.spec_decode.proposer import DraftBatch, Proposer
from foretell.spec_decode.token_history import TokenHistory
from foretell.structured.runtime import StructuredOutputs

_NO_TENSOR = torch.empty(0)  # the DraftBatch fields a host drafter never reads


def host_draft_verify_lens(k: int) -> tuple[int, ...]:
    """The verify lengths (rows per sequence) the target's graphs take for a host drafter of K = k
    drafts: 1 (no sequence drafts) and 1 + ceil(k / 4), 1 + ceil(k / 2), 1 + k."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1 for a host drafter, got {k!r}")
    return tuple(sorted({1} | {1 + -(-k // part) for part in (4, 2, 1)}))


def token_draft_batch(sched: SchedulerOutput, results: list[SequenceResult], block_size: int,
                      max_model_len: int) -> DraftBatch:
    """The DraftBatch of a step for a drafter that reads only token lists: per sequence its tokens
    through the one after its final rows (the step's emitted tokens appended for one that
    sampled), where its first draft would sit, and whether it drafts. No device tensors; a
    sampling sequence's history is a TokenHistory (its token list and the step's tokens, read in
    place: spec_decode/token_history.py), valid until the step's postprocess."""
    starts, valid, nexts, histories, samples, seq_ids, params, indices = [], [], [], [], [], [], [], []
    for item, result in zip(sched.scheduled, results):
        seq = item.seq
        p0 = seq.num_computed_tokens
        if item.samples:
            v = item.num_new_tokens - len(item.draft_token_ids) + result.num_accepted
            history = TokenHistory(seq.token_ids, result.new_token_ids)  # no copy of the whole history
        else:  # a prefill chunk: the prompt through the token after the chunk
            v = item.num_new_tokens
            history = seq.token_ids[: p0 + v + 1]
        starts.append(p0)
        valid.append(v)
        nexts.append(history[-1])
        histories.append(history)
        samples.append(item.samples)
        seq_ids.append(seq.seq_id)
        params.append(seq.sampling_params)
        indices.append(seq.index)
    return DraftBatch(
        start_positions=starts, num_valid_rows=valid, next_token_ids=nexts, samples=samples,
        token_ids=_NO_TENSOR, hidden_states=_NO_TENSOR, aux_hidden_states=[], block_table=_NO_TENSOR,
        block_size=block_size, sampling_params=params, sample_indices=indices, max_model_len=max_model_len,
        histories=histories, seq_ids=seq_ids, max_drafts=sched.num_next_drafts,
    )


def propose_from_tokens(proposer: Proposer, sched: SchedulerOutput, results: list[SequenceResult],
                        block_size: int, max_model_len: int, structured: StructuredOutputs | None = None) -> None:
    """A host drafter's next drafts into results, after a padded step (which drafted none). Under a
    grammar (structured: the runner's, when a sequence of the step has one) they are shaped as the
    host step shapes them (cut where the grammar rejects one, its forced tokens drafted, at most K:
    StructuredOutputs.limit_drafts) and the next step's verify rows start filling on the worker;
    the padded step's own shaping (PaddedVerifyGrammar.after_read) leaves a host drafter's alone.
    A drafter with propose_step (suffix) builds the DraftBatch only when some sequence may draft
    (SuffixProposer.propose_step: a step where nobody drafts costs near a plain engine's)."""
    propose_step = getattr(proposer, "propose_step", None)  # the suffix drafter's: no DraftBatch when nobody drafts
    if propose_step is None:
        proposed = proposer.propose(token_draft_batch(sched, results, block_size, max_model_len)).token_ids
    else:
        proposed = propose_step(sched.scheduled, results,
                                lambda: token_draft_batch(sched, results, block_size, max_model_len))
    if proposed is not None:  # (None: no drafts, the results' next_drafts stay empty)
        for result, drafts in zip(results, proposed):
            result.next_drafts = drafts
    if structured is not None:
        for item in sched.scheduled:  # (a loop: a generator costs more at batch 1, every step)
            if item.seq.sampling_params.structured_outputs is not None:
                structured.grammar_drafts(sched.scheduled, results, [None] * len(results), max_drafts=proposer.k)
                structured.fill_ahead(sched.scheduled, results)
                break


@dataclass
class DrafterRows:
    """A padded step's rows as a drafter that drafts after the read from the target's rows (a
    hybrid's model drafter) takes them: the step's (padded) batch, every sequence's q rows in
    order, and the target's outputs at those rows, views of the padded forward's static outputs
    that stay valid until its next run (nothing is queued ahead of such a drafter)."""

    batch: InputBatch  # [n * q] rows: query_start, input_ids and the block table the drafter reads
    hidden: torch.Tensor  # [n * q, hidden]
    aux: list[torch.Tensor]  # each [n * q, hidden]: the target's aux hidden states (EAGLE3)


class HostDraftSlots:
    """The padded verify step's draft loop for a drafter that drafts on the host after the step's
    read: the verifier's output buffers and the verify lengths the target's padded forward takes;
    drafts nothing on the device. reads_rows: the drafter reads the step's target rows (a hybrid,
    whose model drafter catches up over them: the step hands them over as DrafterRows)."""

    drafts_on_host = True  # proposed after the step's read (propose_from_tokens), not by a device loop

    def __init__(self, target, k: int, reads_rows: bool = False):  # target: the padded forward (a CudaGraphRunner)
        self.target = target
        self.k = k  # K: the most drafts a step verifies
        self.reads_rows = reads_rows
        # Every verify length the padded forward has (host_draft_verify_lens(K), or 1..K + 1 under
        # adaptive speculation), so a step pads to the fewest rows.
        self.verify_lens = tuple(q for q in target.query_lens if 1 <= q <= k + 1)
        max_bucket = target.buckets[-1]
        device = target.device
        self.accepted = torch.zeros(max_bucket, dtype=torch.int64, device=device)  # [max_bucket]
        self.next_token = torch.zeros(max_bucket, dtype=torch.int64, device=device)  # [max_bucket]
        self.num_live = torch.zeros((), dtype=torch.int64, device=device)  # live sequences of the bucket
        self.no_drafts = torch.zeros((max_bucket, 0), dtype=torch.int64, device=device)  # [max_bucket, 0]
        self.graphs: dict = {}  # no draft-loop graphs (benchmarks that time one find none)

    @property
    def captures(self) -> bool:
        return False

    def capture(self) -> None:
        pass

    def skips(self, m: int) -> bool:
        """DraftGraphRunner.skips' answer: no (this loop never runs a drafter, whatever m)."""
        return False

    def run(self, bucket: int, num_seqs: int, q: int | None = None, m: int | None = None) -> torch.Tensor:
        """No drafts on the device: [num_seqs, 0] (the host drafter proposes after the read)."""
        return self.no_drafts[:num_seqs]  # a static buffer's view, as the read-back wants
