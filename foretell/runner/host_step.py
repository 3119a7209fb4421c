"""The speculative step from host inputs: the form every batch takes that the padded device step
(graphed_verify.py, captured or eager) does not cover:
  - prefill chunks; beside verifies (a mixed batch) they take their rows of one forward over
    both, whose verifies the padded step finishes (split_step.py), so this step verifies nothing;
  - requests under a grammar whose step no device step takes (a drafter's verify takes the
    padded step with the grammar's masks: structured/padded_verify.py; plain decoding without a
    drafter, when it decides ahead, runner/decode_ahead.py);
  - draft trees (tree_step.py verifies them, this step drafts them).
Host drafters (n-gram, suffix) and hybrid drafters verify on the padded step, with graphs or
without (runner/host_drafts.py); in the batches this step takes a host drafter gets a DraftBatch
of host lists, no rows gathered, and propose() here serves a hybrid after the padded step too,
over that step's rows. Tensor-parallel ranks verify on the padded step too (over gloo eagerly).
Greedy and sampled rows, requests asking for logprobs (runner/logprobs.py) or using the other
logits controls (penalties, logit_bias, bad words, min_tokens, allowed tokens: device state,
runner/padded_logits_controls.py), and sequences with fewer drafts than the step verifies
(padded, accepting none of the padding), take the padded step; this step still processes the
controls of the batches it gets (logits_processing.py, below).

After the target's forward (ModelRunner.target_forward), sample() turns the logits of the
sampling rows into each sequence's tokens: the sampler when the step verifies no drafts, else the
verifier (spec_decode/verifier.py, the same one the padded step uses: greedy acceptance by the
same op, rejection sampling for sampled rows, or simulated acceptance); propose() hands the
proposer its rows (the accepted prefix of a verify, a prefill chunk) as a DraftBatch and keeps the
draft probabilities of sampled requests for their next verify. With skip_catch_up (adaptive
speculation, an EAGLE3 or MTP drafter: graph_setup.skips_catch_up) a step of verify or decode rows
only whose next step drafts nothing runs no drafter, as the padded step's draft loop does
(spec_decode/draft_graph.py: its KV cache keeps holes there); prefill rows are always caught up.

Under tensor parallelism a step whose sampling rows are all greedy and ask for no logprobs needs
no logits: greedy_without_logits() says so (the one place that decides), the runner then hands
sample_greedy() the model's greedy tokens (compute_greedy_tokens: each rank's row maxima, one
small all-gather) instead of whole vocabulary rows gathered from every rank. With one rank the
step always takes logits, as before. (The padded step's uncaptured forward does the same on its
own: runner/cuda_graph.CapturedForward gathers logits only when a reader asks.)
"""

from __future__ import annotations

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import SchedulerOutput
from foretell.layers.sampler import Sampler, SamplingBatch, row_seed
from foretell.runner.host_drafts import token_draft_batch
from foretell.runner.input_batch import InputBatch
from foretell.runner.logits_processing import apply_sampling_controls
from foretell.runner.logprobs import add_logprobs
from foretell.spec_decode.proposer import DraftBatch, Proposal, Proposer
from foretell.spec_decode.verifier import Verifier
from foretell.structured.runtime import StructuredOutputs


class HostStep:
    def __init__(
        self,
        sampler: Sampler,
        verifier: Verifier,
        proposer: Proposer | None,
        vocab_size: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        tensor_parallel: bool = False,  # the vocabulary is split over ranks
        structured: StructuredOutputs | None = None,  # grammar masks (None: no tokenizer, none allowed)
        skip_catch_up: bool = False,  # a step drafting nothing next may run no drafter (module docstring)
    ):
        self.sampler = sampler
        self.verifier = verifier
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq_id -> [k, vocab] for sampled drafts
        self.structured = structured or StructuredOutputs(None, vocab_size)
        self.skip_catch_up = skip_catch_up
        self.num_verify_steps = 0  # steps whose drafts this step verified (the rare batch no padded step fits)

    def _sampling_rows(self, sched: SchedulerOutput, batch: InputBatch):
        params, seeds = [], []
        row = 0
        for i in batch.sampling_seq_index:
            item = sched.scheduled[i]
            p = item.seq.sampling_params
            for _ in range(len(item.draft_token_ids) + 1):
                params.append(p)
                pos = batch.row_positions[row]
                seeds.append(None if p.seed is None else row_seed(p.seed, item.seq.index, pos))
                row += 1
        return SamplingBatch.build(params, seeds, self.vocab_size, self.device)

    def greedy_without_logits(self, sched: SchedulerOutput, batch: InputBatch) -> bool:
        """Whether this step's tokens come from greedy tokens rather than logits: under tensor
        parallelism, when every sampling row is greedy and none asks for logprobs."""
        if not self.tensor_parallel or not batch.sampling_seq_index:
            return False
        params = [sched.scheduled[i].seq.sampling_params for i in batch.sampling_seq_index]
        return all(p.greedy and p.logprobs is None and not p.needs_logits_processing for p in params)

    def sample_greedy(self, sched: SchedulerOutput, batch: InputBatch, greedy: torch.Tensor, results: list) -> None:
        """sample() for a step greedy_without_logits() chose: greedy [sampling rows] int64, the
        target's greedy token at each sampling row."""
        items = [sched.scheduled[i] for i in batch.sampling_seq_index]
        if any(item.draft_token_ids for item in items):
            self.num_verify_steps += 1
            for item in items:  # greedy sequences keep no draft probabilities; drop any left
                self._pop_draft_probs(item)
            verify = self.verifier.verify_greedy(greedy, [item.draft_token_ids for item in items],
                                                 [item.accept_limit for item in items])
            outputs, accepted = verify.output_token_ids, verify.num_accepted
        else:
            self.forget_draft_probs(items)  # drafts proposed for this step and then cut: never verified
            outputs, accepted = [[t] for t in greedy.tolist()], [0] * len(items)
        self._set_results(sched, batch, outputs, accepted, results)

    def sample(self, sched: SchedulerOutput, batch: InputBatch, logits: torch.Tensor, results: list) -> None:
        """Each sampling sequence's new tokens (and logprobs) from logits [sampling rows, vocab]."""
        if not batch.sampling_seq_index:
            return
        sampling = self._sampling_rows(sched, batch)
        items = [sched.scheduled[i] for i in batch.sampling_seq_index]
        keep_raw = sampling.max_num_logprobs >= 0 or self.structured.any_structured(items)  # the grammar's fallback
        raw_logits, logits = logits, apply_sampling_controls(logits, items, keep_raw=keep_raw)
        logits = self.structured.mask_logits(logits, items, copy=logits is raw_logits and sampling.max_num_logprobs >= 0,
                                             fallback=raw_logits)
        if any(item.draft_token_ids for item in items):
            self.num_verify_steps += 1
            drafts = [item.draft_token_ids for item in items]
            probs = [self._pop_draft_probs(item) for item in items]
            verify = self.verifier.verify(logits, drafts, probs, sampling, [item.accept_limit for item in items])
            outputs, accepted = verify.output_token_ids, verify.num_accepted
            rows = [r for rs in verify.emitted_rows for r in rs]  # uploaded only for logprobs: one copy less a step
            chosen_rows = to_device(rows, torch.int64, self.device) if sampling.max_num_logprobs >= 0 else None
            chosen_tokens = verify.emitted_tokens
        else:
            # Drafts proposed for this step and then cut to none (a budget, a length cap, a k = 0 choice):
            # their probabilities must not meet the next drafts of the same sequences.
            self.forget_draft_probs(items)
            sampled = self.sampler(logits, sampling)
            tokens = sampled.token_ids.tolist()
            outputs, accepted = [[t] for t in tokens], [0] * len(tokens)
            chosen_rows, chosen_tokens = None, sampled.token_ids
        self._set_results(sched, batch, outputs, accepted, results)
        if self.proposer is None:  # the next step's grammar masks, filled while this one finishes
            self.structured.fill_ahead(sched.scheduled, results)
        if sampling.max_num_logprobs >= 0:
            add_logprobs(raw_logits, chosen_rows, chosen_tokens, sampling, batch, sched, results)

    @staticmethod
    def _set_results(sched: SchedulerOutput, batch: InputBatch, outputs: list[list[int]], accepted: list[int],
                     results: list) -> None:
        for i, out, a in zip(batch.sampling_seq_index, outputs, accepted):
            results[i].new_token_ids = out
            results[i].num_accepted = a
            results[i].num_drafts = sched.scheduled[i].num_usable_drafts

    def take_draft_probs(self, item) -> torch.Tensor | None:
        """The draft probabilities kept for item's drafts (None: deterministic drafts), forgotten
        here: the padded step (graphed_verify.py) verifies those drafts."""
        return self._pop_draft_probs(item)

    def forget_draft_probs(self, items) -> None:
        """Drop the draft probabilities kept for these scheduled sequences: a step that verifies
        none of their drafts (a k = 0 step decoded plainly, decode_ahead.py) ends them."""
        if self.draft_probs:  # none kept: the common case, nothing per sequence
            for item in items:
                self.draft_probs.pop(item.seq.seq_id, None)

    def _pop_draft_probs(self, item) -> torch.Tensor | None:
        probs = self.draft_probs.pop(item.seq.seq_id, None)
        if probs is None or item.seq.sampling_params.greedy:
            return None
        return probs[: len(item.draft_token_ids)]

    def propose(self, sched: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor, aux: list[torch.Tensor],
                results: list) -> None:
        """The proposer's catch-up over each sequence's final rows (hidden [rows, hidden]) and its
        next drafts, into results."""
        if self.runs_no_drafter(sched):
            proposal = Proposal([[] for _ in sched.scheduled], [None] * len(sched.scheduled))
        elif self.proposer.capabilities.drafts_from_tokens:  # n-gram, suffix: host lists only, no rows gathered
            proposal = self.proposer.propose(token_draft_batch(sched, results, self.block_size, self.max_model_len))
        else:
            proposal = self.proposer.propose(self.draft_batch(sched, batch, hidden, aux, results))
        for i, drafts in enumerate(proposal.token_ids):
            results[i].next_drafts = drafts
        # Under a grammar: drafts it rejects cut, the tokens it forces drafted, past k (this step
        # verifies any count; simulated acceptance draws k rates, so it keeps k).
        all_probs = self.structured.grammar_drafts(sched.scheduled, results, proposal.probs,
                                                   max_drafts=self.proposer.k if self.verifier.synthetic else None)
        for item, probs in zip(sched.scheduled, all_probs):
            if probs is not None and not item.seq.sampling_params.greedy:
                self.draft_probs[item.seq.seq_id] = probs
        self.structured.fill_ahead(sched.scheduled, results)  # the next step's grammar masks, on a worker

    def runs_no_drafter(self, sched: SchedulerOutput) -> bool:
        """Whether this step skips the drafter (skip_catch_up): the next step drafts nothing, and
        every sequence samples from verify or decode rows alone (no prefill rows to catch up)."""
        return self.skip_catch_up and sched.num_next_drafts == 0 and all(
            item.samples and item.num_new_tokens == 1 + len(item.draft_token_ids) for item in sched.scheduled)

    def draft_batch(self, sched: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor, aux: list[torch.Tensor],
                    results: list, path_rows: dict[int, list[int]] | None = None) -> DraftBatch:
        """What the proposer is handed: each sequence's rows whose target outputs are final. After a
        tree verify (tree_step.py) path_rows names them (scheduled index -> the accepted path's rows,
        as offsets from the sequence's first row; their K/V now sit at consecutive positions)."""
        rows, starts, valid, nexts, histories = [], [], [], [], []
        for i, item in enumerate(sched.scheduled):
            seq = item.seq
            n_real = item.num_new_tokens - len(item.draft_token_ids)
            v = n_real + results[i].num_accepted if item.samples else item.num_new_tokens
            row0 = batch.query_start[i]
            path = path_rows.get(i) if path_rows else None
            rows.extend(range(row0, row0 + v) if path is None else [row0 + r for r in path])
            p0 = seq.num_computed_tokens
            starts.append(p0)
            valid.append(v)
            if item.samples:
                nexts.append(results[i].new_token_ids[-1])
                histories.append(seq.token_ids + results[i].new_token_ids)
            else:
                nexts.append(seq.token_ids[p0 + v])
                histories.append(seq.token_ids[: p0 + v + 1])
        index = to_device(rows, torch.int64, self.device)
        return DraftBatch(
            start_positions=starts,
            num_valid_rows=valid,
            next_token_ids=nexts,
            samples=[item.samples for item in sched.scheduled],
            token_ids=batch.input_ids[index],
            hidden_states=hidden[index],
            aux_hidden_states=[a[index] for a in aux],
            block_table=batch.attn_metadata.block_table,
            block_size=self.block_size,
            sampling_params=[item.seq.sampling_params for item in sched.scheduled],
            sample_indices=[item.seq.index for item in sched.scheduled],
            max_model_len=self.max_model_len,
            histories=histories,
            seq_ids=[item.seq.seq_id for item in sched.scheduled],
            draft_mask=self.structured.draft_mask(sched.scheduled, results, self.device),
            max_drafts=sched.num_next_drafts,
        )

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's draft probabilities (finished, preempted, or its step failed) and
        tell the proposer (a host drafter's per-sequence state)."""
        self.draft_probs.pop(seq_id, None)
        self.structured.forget(seq_id)
        if self.proposer is not None:
            self.proposer.forget(seq_id)
