"""Decoding one step ahead (asynchronous scheduling): step N + 1's forward is queued on the GPU
before the host reads step N's tokens, so the host's work between two steps (the engine's
postprocess and schedule, the next batch's tensors) runs while the GPU computes, not between.

A plain decode step (every sequence feeds one row and samples; no drafts; logprobs and logits
controls allowed; grammars without a drafter, below) samples on the device and queues the copy of its tokens (and the
logprobs of the sequences that ask, runner/logprobs.py's padded form with one row per sequence) to
pinned host memory. Logits controls (penalties, logit_bias, min_tokens, bad words, allowed tokens)
run on device state built from the host's lists at a launch from host inputs and advanced by each
step's own sampled tokens (runner/padded_logits_controls.py), so a step queued before the host
has the previous token processes its logits as the host step would. Before waiting for that copy,
the step pipeline (runner/step_pipeline.py) launches the next step for the same sequences: the
sampled tokens, still on the device, are its inputs and every position moves one on. When the
scheduler's next decision is exactly that batch (the same sequences in the same order, one row
each at the expected position), the pipeline hands back the launched step instead of running the
step; otherwise it drops the launch.

Dropping is safe. The dropped step wrote each sequence's K/V at the slot of its next position, in
a block the sequence held at launch and past its computed tokens: nothing reads a slot there before
the sequence writes it again (the same token at the same position when it continues). If the block
was freed meanwhile (the sequence finished, was aborted or preempted), the stale write precedes in
stream order every write of the block's next owner. Blocks in the prefix cache are never written:
the slot lies in the sequence's last, not yet full, block (a launch needs that block allocated).

A greedy step on a CUDA graph whose next step goes to the same graph (the same sequences: the same
bucket) skips the host's inputs altogether while the graph's buffers still hold its own inputs
(CudaGraphRunner.inputs_version) and every next position lies in a block of the table they hold:
the buffers move one position on, on the device, in one launch (CudaGraphRunner.advance_decode),
and the host only keeps its positions and slots for matches(). Crossing into a block the table
lacks, or anything else (sampling, logits controls, logprobs, another bucket), packs and uploads
the inputs as before.

A speculative engine whose drafter runs not at all on a step that drafts nothing (adaptive
speculation's k = 0 with adaptive_skip_catch_up: graph_setup.skips_catch_up) decodes its k = 0
steps here too (`zero_drafts_only`): a step of plain decode rows whose next step drafts nothing
(SchedulerOutput.num_next_drafts == 0) is exactly a plain decode step, so it takes this path
rather than the padded verify's (no verification, no accepted counts, no draft buffers read back,
no block tables compared: the same host and device work as an engine without a drafter), and a
step queued after it is queued only while the scheduler's choice stays 0 (a choice to draft goes
back to the padded verify step, launched from host inputs).

Grammars (issues 27 and 31), in an engine without a drafter (`structured` set): a plain decode
batch whose sequences follow grammars takes this step too. After the forward is launched (a graph
replay when one fits: the graph itself is the plain one), each grammar row's mask is filled on the
host from its sequence's matcher, as the host step fills a one-row step's
(structured/padded_verify.py's padded_verify_grammar with q = 1: a row allowing every token for a
sequence without a grammar), copied to the device in one upload (GrammarMaskBuffer) and applied to
the logits after the other controls (PaddedVerifyGrammar.apply: the host step's fallback for a row
the controls leave with nothing allowed); greedy rows take the masked logits' argmax, sampled rows
sample them, and the logprobs stay the raw logits'. Once its tokens are read, the next step's rows
start filling on the worker thread (StructuredOutputs.fill_ahead, the host step's call), which
advances the matchers through them (an EOS ends a sequence's walk there, as on the host step).
The step after a grammar step is queued ahead as its forward alone (LaunchedDecode.launch_next:
its masks need this step's tokens on the host): when the scheduler takes it, complete() masks
and samples its logits with the rows the worker filled meanwhile, so the forward runs on the
device while the host reads, processes and schedules, as plain decoding's does. Dropped, it is a
plain queued step dropped (above): the matchers never saw it.

DecodeAhead is the step kind (what launches such a step, with the target's graphs, forward and
sampler it needs); LaunchedDecode (runner/launched_decode.py) is one step on its way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import Sampler, SamplingBatch, argmax_rows, row_seed
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.input_batch import InputBatch
from foretell.runner.launched_decode import LaunchedDecode, plain_decode
from foretell.runner.logprobs import PaddedLogprobs, padded_step_logprobs
from foretell.runner.padded_logits_controls import PaddedLogitsControls
from foretell.runner.pinned_ring import PinnedRing
from foretell.runner.step_pipeline import HostCopy
from foretell.structured.padded_verify import GrammarMaskBuffer, PaddedVerifyGrammar, padded_verify_grammar
from foretell.structured.runtime import StructuredOutputs


@dataclass
class DecodeAhead:
    """The plain decode step as a device step (a StepKind of runner/step_pipeline.py): the forward
    (a graph replay when one fits) and sampling, launched without waiting for anything."""

    graphs: CudaGraphRunner | None
    forward: Callable[[InputBatch], tuple]  # ModelRunner.target_forward: (hidden, aux, logits)
    sampler: Sampler
    vocab_size: int
    block_size: int
    max_model_len: int
    # Pinned buffers and events for the tokens' copies to the host, reused (runner/pinned_ring.py);
    # made at the first copy, on the device of the tokens.
    token_copies: PinnedRing | None = None
    # A speculative engine's k = 0 steps (module docstring): only steps whose next step drafts
    # nothing are taken, and the draft probabilities the host step kept for a taken step's
    # sequences are dropped (HostStep.forget_draft_probs: none of them is verified now).
    zero_drafts_only: bool = False
    forget_draft_probs: Callable[[list[ScheduledSequence]], None] | None = None
    # Grammar masks on this step (module docstring): the host step's StructuredOutputs, in an
    # engine without a drafter; None: batches with a grammar take the host step.
    structured: StructuredOutputs | None = None
    grammar_masks: GrammarMaskBuffer | None = None  # made at the first grammar step, grown with the batch
    num_grammar_steps: int = 0  # steps launched with a sequence under a grammar

    def takes(self, sched: SchedulerOutput) -> bool:
        """Whether this kind launches sched's batch: plain decode rows (with grammars when
        `structured` is set) and, with zero_drafts_only, a next step that drafts nothing."""
        if self.zero_drafts_only and sched.num_next_drafts != 0:
            return False
        return plain_decode(sched.scheduled, grammars=self.structured is not None)

    def copy_tokens(self, token_ids: torch.Tensor) -> HostCopy:
        """token_ids [num_seqs] int64 on the device (then, with logprobs, their packed values): their
        copy to the host, queued."""
        if self.token_copies is None:
            self.token_copies = PinnedRing(torch.int64, token_ids.device)
        return HostCopy.queue(token_ids, self.token_copies)

    def launch(self, sched: SchedulerOutput, batch: InputBatch) -> "LaunchedDecode | None":
        if not self.takes(sched):
            return None
        if self.forget_draft_probs is not None:
            self.forget_draft_probs(sched.scheduled)
        seqs = [item.seq for item in sched.scheduled]
        # Rebuilt from the host's lists at every launch from host inputs (padded_logits_controls.py).
        controls = PaddedLogitsControls.for_sequences(seqs, self.vocab_size, batch.device)
        logprobs = PaddedLogprobs.for_params([seq.sampling_params for seq in seqs], batch.device)
        grammar_items = None
        if self.structured is not None and StructuredOutputs.any_structured(sched.scheduled):
            grammar_items = sched.scheduled
        return self.launch_for(seqs, batch, controls, logprobs, grammar_items=grammar_items)

    def grammar_for(self, items: list[ScheduledSequence], device: torch.device) -> PaddedVerifyGrammar:
        """The grammar rows of a decode step (one row a sequence, q = 1), filled on the host and
        uploaded in one copy (padded_verify_grammar)."""
        n = len(items)
        if self.grammar_masks is None or self.grammar_masks.max_rows < n:  # (a new buffer: rarely, as batches grow)
            self.grammar_masks = GrammarMaskBuffer(max(n, 2 * self.grammar_masks.max_rows if self.grammar_masks else 8),
                                                   device)
        self.num_grammar_steps += 1
        return padded_verify_grammar(self.structured, self.grammar_masks, items, 1, 0, shapes_drafts=False)

    def launch_for(self, seqs: list[Sequence], batch: InputBatch, controls: PaddedLogitsControls | None = None,
                   logprobs: PaddedLogprobs | None = None, all_greedy: bool | None = None,
                   grammar_items: list[ScheduledSequence] | None = None) -> "LaunchedDecode":
        """Forward and sampling of a plain decode batch (its logits processed by `controls`, then
        masked by the grammars of `grammar_items`, the scheduled sequences when one of them has a
        grammar; its logprobs taken from the raw logits for `logprobs`); the copy of its tokens to
        the host is queued, nothing is waited for. A greedy batch without any of them on a CUDA
        graph takes the graph's own argmax. all_greedy: whether every sequence samples greedily
        (None: looked up; a step queued after another passes the one it launched with: the same
        sequences).

        An all-greedy batch builds no SamplingBatch (no seeds, no per-row parameter lists): every
        step of plain greedy decoding comes through here, and argmax reads nothing else."""
        if all_greedy is None:
            all_greedy = all(seq.sampling_params.greedy for seq in seqs)
        key = self.graphs.bucket_for(batch) if self.graphs is not None else None
        if key is not None and all_greedy and controls is None and logprobs is None and grammar_items is None:
            token_ids = self.graphs.run(batch, key).greedy[: len(seqs)]  # [num_seqs] int64, until the next replay
            block_size = self.block_size
            table_ends = [len(blocks) * block_size for blocks in batch.block_ids]  # what the buffers' table covers
            return LaunchedDecode(self, seqs, batch.position_list, batch.slot_list, token_ids, None, True,
                                  all_greedy=True, graph_key=key, inputs_version=self.graphs.inputs_version,
                                  table_ends=table_ends)
        _, _, raw_logits = self.forward(batch)  # [num_seqs, vocab] float32 (a graph's: until its next replay)
        token_ids, grammar, packed = self.sample(seqs, batch.row_positions, raw_logits, controls, logprobs,
                                                 all_greedy, grammar_items)
        launched = LaunchedDecode.queue(self, seqs, batch, token_ids, controls=controls, logprobs=logprobs,
                                        packed_logprobs=packed, all_greedy=all_greedy, grammar=grammar)
        if grammar is not None:  # (a plain step's graph inputs advance only on its greedy path, above)
            launched.note_graph_inputs(batch)
        return launched

    def sample(self, seqs: list[Sequence], row_positions: list[int], raw_logits: torch.Tensor,
               controls: PaddedLogitsControls | None, logprobs: PaddedLogprobs | None, all_greedy: bool,
               grammar_items: list[ScheduledSequence] | None,
               ) -> tuple[torch.Tensor, PaddedVerifyGrammar | None, torch.Tensor | None]:
        """The tokens of a decode step whose forward is launched: raw_logits [num_seqs, vocab]
        float32 processed by `controls` (their device state then advanced by the tokens), masked by
        the grammars of `grammar_items` (filled on the host now), sampled (greedy: argmax;
        row_positions give the seeded rows' seeds). Returns the tokens [num_seqs] int64, the step's
        grammar (None without one) and the packed logprobs of the raw logits (None unless asked)."""
        n = len(seqs)
        no_drafts = torch.zeros(n, 0, dtype=torch.int64, device=raw_logits.device)  # [n, 0]
        grammar = None
        if grammar_items is None:
            logits = raw_logits if controls is None else controls.apply(raw_logits[:, None, :], no_drafts)[:, 0]
        else:  # the masks filled while the forward runs, applied after the controls
            grammar = self.grammar_for(grammar_items, raw_logits.device)
            raw_rows = raw_logits[:, None, :]  # [n, 1, vocab]: the padded step's layout, q = 1
            processed = raw_rows if controls is None else controls.apply(raw_rows, no_drafts)  # [n, 1, vocab]
            logits = grammar.apply(processed, raw_rows)[:, 0]  # [n, vocab]
        if all_greedy:
            token_ids = argmax_rows(logits)  # [num_seqs] int64: what the sampler picks for greedy rows
        else:
            seeds = [
                None if seq.sampling_params.seed is None else row_seed(seq.sampling_params.seed, seq.index, pos)
                for seq, pos in zip(seqs, row_positions)
            ]
            sampling = SamplingBatch.build([seq.sampling_params for seq in seqs], seeds, self.vocab_size,
                                           raw_logits.device)
            token_ids = self.sampler(logits, sampling).token_ids  # [num_seqs] int64
        if controls is not None:  # what the step queued after this one processes with
            controls.advance(no_drafts, torch.zeros_like(token_ids), token_ids)
        packed = None
        if logprobs is not None:
            out = torch.empty(logprobs.size(1), dtype=torch.int64, device=raw_logits.device)
            packed = padded_step_logprobs(logprobs, raw_logits[:, None, :], no_drafts, torch.zeros_like(token_ids),
                                          token_ids, out)
        return token_ids, grammar, packed
