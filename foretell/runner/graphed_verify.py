"""The padded verify step: the target's (bucket, k + 1) forward over static buffers, verification
on the device, the draft loop over the same buffers, and a single host read for the whole step.

GraphedVerify is the step kind (runner/step_pipeline.py): it takes a batch where every sequence
feeds one row plus its drafts (0..K of them) and samples, greedy or sampled (temperature, top-k,
top-p, min-p), with or without logprobs and logits controls (penalties, logit_bias, min_tokens,
bad words, allowed tokens: padded_logits_controls.py; grammars: structured/padded_verify.py).
The step verifies q - 1 drafts per sequence, q the shortest verify length of the draft loop that
holds the most drafts (K + 1, or under adaptive speculation 1..K + 1: the chosen k + 1, k = 0
being a padded decode whose draft loop catches the drafter up; for an EAGLE3 or MTP drafter
whose next step drafts nothing, it runs no drafter (DraftGraphRunner.skips), and a batch of plain
decode rows is then taken by plain decoding before it reaches this kind: decode_ahead.py's
zero_drafts_only); a sequence with
fewer drafts (a budget or length cut) is padded to q - 1 with PAD_DRAFT_TOKEN rows and accepts
none of them (caps for greedy and drawn acceptance, lengths for rejection sampling, whose bonus
token comes from the sequence's own row). The padded rows write K/V in the sequence's lookahead
slots, past anything it has computed (overwritten before being read, as rejected drafts' are).
The draft loop drafts m per sequence: q - 1, or K when the scheduler's choice for the next step
asks for more than q - 1 (num_drafts; the scheduler takes the first k). It runs on the
target's padded forward and the draft loop (spec_decode/draft_graph.py) whether they are captured
CUDA graphs or not: off CUDA, under --enforce-eager, after a refused capture, or with an attention
backend that reads host lengths (the CPU's default torch backend: then the bucket is the exact
batch and each forward reads its lengths from the buffers), the same code runs eagerly. A batch
of prompt chunks beside verifies is planned here (plan) and finished here after one forward over
both (launch_planned, on outputs CudaGraphRunner.load puts in the buffers: split_step.py). Every
other batch takes the host step (host_step.py says which and why). A sequence near max_tokens
keeps its k draft rows with its acceptance capped (ScheduledSequence.accept_limit). How many
drafts a sequence accepts is the verifier's (spec_decode/verifier.py: exact greedy, or drawn when
acceptance is simulated), chosen when the runner is built.

A host drafter's step of greedy rows only (no logits controls, logprobs or grammar; an exact
verifier) is verified on the host instead (runner/host_verify.py): the graph's greedy tokens are
read back and counted there; with queueing ahead (fallback_decode, the plain decode kind on the same
buffers) it also verifies on the device, for the plain step it queues after itself.

Sampled rows: the verifier rejection-samples over the target's [n, k + 1, vocab] logits on the
device (verifier.sample_padded), drawing counter-based noise keyed by each sequence's key (its
seed and sample index, or the engine's seed and the sequence for a request without a seed) and
the positions in the buffers, so a step queued ahead draws what the host step would for a seeded
request at those positions. The drafts it verifies come either from the host step's proposer (a
sampled draft with the distribution it was drawn from, taken here from the host step) or from
the padded draft loop, which drafts greedily for every row: a deterministic draft is verified
against a one-hot q, which is exact (it accepts with probability p(d) instead of the
sum(min(p, q)) of a draft sampled from the drafter's distribution).

Logits controls and logprobs (runner/padded_step_extras.py): processed and computed on the device
inside the step for the sequences that ask, verification reading the processed logits, the
logprobs leaving with the step's one read-back.

Everything the next verify step needs is on the device when this one ends (each sequence's
accepted count, its next token and its m new drafts), so with async scheduling the pipeline queues
that step (LaunchedVerify.launch_next) before reading this one's results when it verifies as many
drafts as this one (the scheduler's choice for it, known then: SchedulerOutput.num_next_drafts;
a changed length is launched from host inputs at the next execute), as decode_ahead.py does
for plain decoding: the buffers advance on the device, the forwards run (or replay), and the launch
is used if the scheduler's next decision is that batch, dropped otherwise (why dropping is safe:
there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import NoiseSource, SamplingBatch, sequence_key
from foretell.runner.cuda_graph import CapturedForward, CudaGraphRunner
from foretell.runner.host_drafts import DrafterRows
from foretell.runner.host_verify import FallbackDecode, HostVerifiedStep
from foretell.runner.input_batch import InputBatch, build_input_batch, rows_within
from foretell.runner.launched_verify import LaunchedVerify
from foretell.runner.padded_logits_controls import padded_step_takes
from foretell.runner.padded_step_extras import PackedLogprobBuffer, PaddedStepExtras
from foretell.runner.pinned_ring import PinnedRing
from foretell.runner.step_pipeline import HostCopy
from foretell.runner.verify_warm_up import compile_verification
from foretell.spec_decode.draft_graph import DraftGraphRunner
from foretell.spec_decode.rejection_sampler import PaddedSampling, dense_draft_probs
from foretell.spec_decode.verifier import Verifier
from foretell.structured.padded_verify import GrammarMaskBuffer, padded_verify_grammar
from foretell.structured.runtime import StructuredOutputs


if TYPE_CHECKING:
    from foretell.runner.decode_ahead import DecodeAhead

#: The input id fed at a padded draft row (a sequence with fewer drafts than the step verifies):
#: any token id; the row's outputs are never used (acceptance stops before it).
PAD_DRAFT_TOKEN = 0


@dataclass
class VerifyPlan:
    """A batch the padded step takes, before its target forward: the verify length q, the
    sequences each feeding q rows (drafts padded to q - 1), their batch and its graph key, and
    each sequence's real draft count (short: some are padded)."""

    q: int
    items: list[ScheduledSequence]
    batch: InputBatch
    key: tuple[int, int]
    lengths: list[int]
    short: bool


@dataclass
class GraphedVerify:
    """What a padded verify step runs on: the target's padded forward (graphs, or the same buffers
    run eagerly), the draft loop, the verifier, and for sampled rows the noise source (keys of
    requests without a seed) and the host step's kept draft probabilities."""

    graphs: CudaGraphRunner
    draft_graphs: DraftGraphRunner
    verifier: Verifier
    block_size: int
    max_model_len: int
    noise: NoiseSource
    vocab_size: int
    # The draft probabilities the host step kept for a sequence's drafts (None: deterministic
    # drafts), handed over and forgotten there: HostStep.take_draft_probs.
    take_draft_probs: Callable[[ScheduledSequence], "torch.Tensor | None"]
    num_steps: int = 0  # padded steps launched (queued ahead included)
    num_sampled_steps: int = 0  # ... with sampled rows
    num_mixed_steps: int = 0  # ... with a sequence verifying fewer drafts than the step (padded rows)
    num_logprob_steps: int = 0  # ... with a sequence asking for logprobs
    num_controlled_steps: int = 0  # ... with a sequence whose logits are processed (penalties, bias, ...)
    enabled: bool = True  # False: every batch takes the host step (tests and A/B runs set it; the runner never)
    structured: StructuredOutputs | None = None  # grammar masks here (padded_verify.py); None: the host step's
    num_grammar_steps: int = 0  # padded steps with a sequence under a grammar
    num_host_verified_steps: int = 0  # ... verified on the host (a host drafter's greedy steps: host_verify.py)
    # A host drafter's plain decode kind: a host-verified step queues its plain step after it
    # (host_verify.py); None: nothing queued after one (no queueing ahead, or a model drafter).
    fallback_decode: "DecodeAhead | None" = None

    def __post_init__(self):
        # rows: the padded forward's most (largest bucket x q)
        self.logprob_out = PackedLogprobBuffer(self.graphs.input_ids.numel(), self.graphs.device)
        self.grammar_masks = GrammarMaskBuffer(self.graphs.input_ids.numel(), self.graphs.device)
        self.greedy_copies = PinnedRing(torch.int64, self.graphs.device)  # a host-verified step's tokens
        if self.structured is not None:  # a grammar request's drafts, forced ones included, fit this step
            self.structured.limit_drafts(self.draft_graphs.k)
        self.compile_verification()

    def compile_verification(self) -> None:
        """Compile verification's kernels at start-up (verify_warm_up.py says which and why)."""
        compile_verification(self)

    def verify_length(self, sched: SchedulerOutput) -> int | None:
        """q, the rows per sequence of this batch's padded step: the shortest verify length the
        draft loop takes (K + 1; any of 1..K + 1 under adaptive speculation) that holds 1 + the
        most drafts a sequence verifies, when every sequence feeds one row plus its drafts and
        samples (logprobs, logits controls or a grammar with `structured`, or none), its real rows
        below max_model_len (the scheduler's cap; padded rows past it are placed at its last
        position: plan). None: the host step."""
        items = sched.scheduled
        if not items:
            return None
        loop = self.draft_graphs
        most = 1 + max(len(item.draft_token_ids) for item in items)
        q = next((q for q in loop.verify_lens if q >= most), None)  # without adaptive speculation: K + 1
        if q is None:
            return None
        fits = all(
            item.samples
            and item.num_new_tokens == 1 + len(item.draft_token_ids)  # a verify (or decode), no prefill rows
            and (padded_step_takes(item.seq.sampling_params) or self.structured is not None)  # a grammar
            and item.seq.num_computed_tokens + len(item.draft_token_ids) < self.max_model_len
            for item in items
        )
        return q if fits else None

    def fits(self, sched: SchedulerOutput, batch: InputBatch) -> bool:
        """Whether the batch takes the padded step (verify_length); a batch of equal draft counts
        also needs a bucket of the padded forward (a batch of mixed counts: checked at launch, on
        the padded batch)."""
        return self._length_that_fits(sched, batch) is not None

    def _length_that_fits(self, sched: SchedulerOutput, batch: InputBatch) -> int | None:
        """fits()'s decision as the step's q (None: the host step), computed once a launch."""
        if not self.enabled:
            return None
        q = self.verify_length(sched)
        if q is None:
            return None
        if any(len(item.draft_token_ids) != q - 1 for item in sched.scheduled):
            return q
        key = self.graphs.bucket_for(batch)
        return q if key is not None and key[1] == q else None

    def num_drafts(self, q: int, num_next_drafts: int | None) -> int:
        """m, the drafts a step of q rows makes: q - 1 (what it verified: adaptive speculation's
        steady state) unless the scheduler's choice for the next step (None: K, not adaptive)
        asks for more, then K (the scheduler takes the first num_next_drafts); 0 when the next
        step drafts nothing and the draft loop then runs no drafter (skips)."""
        k = self.draft_graphs.k
        wanted = k if num_next_drafts is None else num_next_drafts
        return 0 if wanted == 0 and self.draft_graphs.skips(0) else q - 1 if wanted <= q - 1 else k

    def plan(self, sched: SchedulerOutput, batch: InputBatch) -> VerifyPlan | None:
        """The padded step for the scheduler's decision (its inputs from `batch`, sequences with
        fewer drafts padded to the step's q - 1), when the batch fits; None: the host step."""
        q = self._length_that_fits(sched, batch)
        if q is None:
            return None
        items = sched.scheduled
        lengths = [len(item.draft_token_ids) for item in items]
        short = any(n != q - 1 for n in lengths)
        if short:
            items = self._padded_items(items, q)
            if items is None:
                return None
            batch = rows_within(build_input_batch(items, self.block_size, batch.device), self.max_model_len)
        key = self.graphs.bucket_for(batch)
        if key is None or key[1] != q:
            return None
        return VerifyPlan(q, items, batch, key, lengths, short)

    def launch(self, sched: SchedulerOutput, batch: InputBatch) -> "LaunchedVerify | HostVerifiedStep | None":
        """The step the scheduler decided, when the batch fits (plan), its target forward a replay."""
        plan = self.plan(sched, batch)
        return None if plan is None else self.launch_planned(sched, plan, self.graphs.run(plan.batch, plan.key))

    def launch_planned(self, sched: SchedulerOutput, plan: VerifyPlan,
                       forward: CapturedForward) -> "LaunchedVerify | HostVerifiedStep":
        """The planned step after its target forward (a replay, or outputs loaded into the
        buffers: CudaGraphRunner.load): verification and drafting on the device."""
        q, key, batch, lengths, short = plan.q, plan.key, plan.batch, plan.lengths, plan.short
        items = sched.scheduled
        rows = len(items) * q
        drafter_rows = DrafterRows(batch, forward.hidden[:rows], [a[:rows] for a in forward.aux]) \
            if self.draft_graphs.reads_rows else None  # a hybrid's model drafter reads them after the read
        seqs = [item.seq for item in items]
        limits = [item.accept_limit for item in items]
        draft_ids = [item.draft_token_ids for item in items]
        kept = [self.take_draft_probs(item) for item in items]  # forgotten there: this step verifies them
        sampled = self._sampling(seqs, q)
        extras = PaddedStepExtras.for_sequences(seqs, self.vocab_size, self.graphs.device)
        if self.structured is not None:  # filled while the forward runs; never queued ahead
            extras.grammar = padded_verify_grammar(self.structured, self.grammar_masks, items, q, self.draft_graphs.k,
                                                   shapes_drafts=not self.draft_graphs.drafts_on_host)
            self.num_grammar_steps += extras.grammar is not None
        if q > 1 and self._verifies_on_host(sampled, extras):  # a host drafter's greedy step (host_verify.py)
            self.num_steps += 1
            self.num_mixed_steps += short
            self.num_host_verified_steps += 1
            greedy = self.graphs.graphs[key].greedy[:rows]  # [n * q] int64, the graph's output
            copy = HostCopy.queue(greedy, self.greedy_copies)
            fallback = FallbackDecode.after(self, seqs, batch, q, lengths, limits)  # the plain step after it
            return HostVerifiedStep(seqs, key, copy, draft_ids, limits, fallback, drafter_rows)
        draft_probs = None
        if sampled is not None and any(probs is not None for probs in kept):  # drafts the host step sampled
            drafts = self.graphs.input_ids[:rows].view(len(items), q)[:, 1:]
            draft_probs = dense_draft_probs(drafts, lengths, kept, self.vocab_size)
        caps = None
        if short or any(limit is not None for limit in limits):  # acceptance stops at each one's cap
            caps = [n if limit is None else min(n, limit) for n, limit in zip(lengths, limits)]
        self.num_mixed_steps += short
        m = self.num_drafts(q, sched.num_next_drafts)
        outputs = self._verify_on_device(key, len(items), caps, sampled, draft_probs, lengths if short else None, m,
                                         extras)
        return self._launched(seqs, key, outputs, [seq.num_computed_tokens for seq in seqs], draft_ids, limits,
                              sampled, extras, drafter_rows)

    def _verifies_on_host(self, sampled: PaddedSampling | None, extras: PaddedStepExtras) -> bool:
        """Whether a step of drafts is verified on the host (host_verify.py): a host drafter's
        (nothing on the device reads the verification), greedy rows only, no logits controls,
        logprobs or grammar (verification reads the graph's greedy tokens), an exact verifier."""
        return (self.draft_graphs.drafts_on_host and sampled is None and not self.verifier.synthetic
                and extras.controls is None and extras.logprobs is None and extras.grammar is None)

    def _padded_items(self, items: list[ScheduledSequence], q: int) -> list[ScheduledSequence] | None:
        """Every sequence with its drafts padded to q - 1 (PAD_DRAFT_TOKEN), None when a padded row
        would lie past the sequence's blocks (the scheduler reserves the drafter's lookahead slots
        past a sampling step, so it does not: a guard)."""
        padded = []
        for item in items:
            seq, drafts = item.seq, item.draft_token_ids
            if (seq.num_computed_tokens + q - 1) // self.block_size >= len(seq.block_ids):
                return None
            padded.append(ScheduledSequence(seq, q, drafts + [PAD_DRAFT_TOKEN] * (q - 1 - len(drafts)), True))
        return padded

    def _sampling(self, seqs: list[Sequence], q: int) -> PaddedSampling | None:
        """The sampled rows' parameters and noise keys; None for a batch of greedy sequences."""
        params = [seq.sampling_params for seq in seqs]
        if all(p.greedy for p in params):
            return None
        keys = [self.noise.unseeded_key(seq.seq_id) if p.seed is None else sequence_key(p.seed, seq.index)
                for seq, p in zip(seqs, params)]
        device = self.graphs.device
        rows = [p for p in params for _ in range(q)]
        sampling = SamplingBatch.build(rows, [None] * len(rows), self.vocab_size, device)
        return PaddedSampling(sampling, to_device(keys, torch.int64, device))

    def next_verify_length(self, launched: "LaunchedVerify", num_next_drafts: int | None) -> int:
        """The rows per sequence of the step after `launched`: 1 + the drafts the scheduler will
        take of those `launched` makes (its choice num_next_drafts; None: all)."""
        taken = launched.num_drafts if num_next_drafts is None else min(num_next_drafts, launched.num_drafts)
        return taken + 1

    def can_follow(self, launched: "LaunchedVerify", num_next_drafts: int | None = None) -> bool:
        """Whether the step after `launched` can be queued before its results are known: it
        verifies as many drafts as `launched` did (the same buffers' layout: a changed draft length
        launches from host inputs); whatever `launched` accepts, no sequence may reach max_tokens
        or max_model_len within the next step (the scheduler would cap or cut it), and every slot
        the next step writes (its q target rows, then the draft loop's rows up to m positions
        further) must sit in allocated blocks, and the block tables fit the graphs' (max_blocks
        per sequence)."""
        q = launched.key[1]
        if self.next_verify_length(launched, num_next_drafts) != q or launched.extras.grammar is not None:
            return False  # a grammar's next masks need this step's tokens on the host
        m = self.num_drafts(q, num_next_drafts)
        max_blocks = self.graphs.block_table.shape[1]
        for seq, start in zip(launched.seqs, launched.start_positions):
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None and seq.num_output_tokens + 2 * q > max_tokens:
                return False
            if seq.num_tokens + 2 * q > self.max_model_len:
                return False
            last_slot = start + 2 * q + m - 1  # next start <= start + q; its rows and drafts follow
            if not last_slot // self.block_size < len(seq.block_ids) <= max_blocks:
                return False
        return True

    def launch_after(self, launched: "LaunchedVerify", num_next_drafts: int | None = None) -> "LaunchedVerify":
        """Queue the verify step after `launched` (can_follow() said it may be): its inputs are
        computed on the device from `launched`'s outputs; its host-side expectations are filled
        in by expect() once `launched` is read."""
        n, q = len(launched.seqs), launched.key[1]
        block_ids = [seq.block_ids for seq in launched.seqs]
        self.graphs.advance_verify(n, launched.accepted, launched.next_token, launched.drafts[:, : q - 1], block_ids)
        self.graphs.replay(launched.key)
        limits = [None] * n
        # The same sequences: the same parameters, keys, logprobs and controls (their state advanced
        # by `launched`'s verification); their positions advanced in the buffers.
        outputs = self._verify_on_device(launched.key, n, None, launched.sampled, None, None,
                                         self.num_drafts(q, num_next_drafts), launched.extras)
        return self._launched(launched.seqs, launched.key, outputs, [], [], limits, launched.sampled,
                              launched.extras)

    def _verify_on_device(self, key: tuple[int, int], n: int, caps: list[int] | None,
                          sampled: PaddedSampling | None, draft_probs: "torch.Tensor | None",
                          lengths: list[int] | None, m: int, extras: PaddedStepExtras):
        """After the target graph `key` ran: the logits controls of the sequences that have some
        (padded_step_extras.py), verification (rejection sampling when `sampled`; the drafts'
        distributions draft_probs [n, q - 1, vocab], None: deterministic drafts; caps: the most
        drafts each may accept, its real drafts included; lengths: each sequence's real drafts
        when some are padded), the next token, the controls' state advanced and the logprobs of
        the sequences that ask, and the draft loop drafting m, all on the device. Returns
        (accepted [n], next_token [n], drafts [n, m], packed logprobs [num_wanting, q, width] or
        None), views of static buffers that the next step overwrites (in stream order, after this
        step used them)."""
        bucket, q = key
        outputs = self.graphs.graphs[key]
        greedy = outputs.greedy[: n * q].view(n, q)  # the target's greedy token per row
        drafts_in = self.graphs.input_ids[: n * q].view(n, q)[:, 1:]
        device = greedy.device
        caps_t = None if caps is None else to_device(caps, torch.int64, device)  # [n]
        self.graphs.side.before_output_write()  # the last step's results have left for the host
        loop = self.draft_graphs
        self.num_steps += 1
        self.num_controlled_steps += extras.controls is not None
        self.num_logprob_steps += extras.logprobs is not None
        # [n, q, vocab] float32; none for greedy rows without controls, logprobs or grammars (under
        # tensor parallelism an uncaptured forward then gathers no logits: CapturedForward)
        raw_logits = outputs.logits[: n * q].view(n, q, -1) if sampled is not None or extras.reads_logits else None
        # What verification reads: the processed logits [n, q, vocab] and what greedy rows pick [n, q].
        logits, greedy = extras.process(raw_logits, drafts_in, greedy)
        if sampled is None:
            self.verifier.accept_padded(greedy, drafts_in, caps_t, loop.accepted, loop.next_token, loop.num_live)
        else:
            self.num_sampled_steps += 1
            first_positions = self.graphs.positions[: n * q].view(n, q)[:, 0]  # [n], as the buffers hold them
            lengths_t = None if lengths is None else to_device(lengths, torch.int64, device)  # [n]
            self.verifier.sample_padded(logits, greedy, drafts_in, draft_probs, sampled, first_positions, caps_t,
                                        loop.accepted, loop.next_token, loop.num_live, lengths_t)
        packed = extras.after_verification(raw_logits, drafts_in, loop.accepted[:n], loop.next_token[:n],
                                           self.logprob_out)
        drafts = loop.run(bucket, n, q, m)  # [n, m]
        return loop.accepted[:n], loop.next_token[:n], drafts, packed

    def _launched(self, seqs, key, outputs, starts, draft_ids, limits, sampled, extras: PaddedStepExtras,
                  drafter_rows: DrafterRows | None = None) -> "LaunchedVerify":
        accepted, next_token, drafts, packed = outputs
        read_back = [accepted, next_token, drafts] + ([] if packed is None else [packed])
        copy = HostCopy(*self.graphs.side.download_outputs(read_back))
        return LaunchedVerify(self, seqs, key, accepted, next_token, drafts, copy, starts, draft_ids, limits,
                              sampled, extras, drafter_rows)
