"""The padded verify step: the target's (bucket, k + 1) forward over static buffers, verification
on the device, the draft loop over the same buffers, and a single host read for the whole step.

GraphedVerify is the step kind (runner/step_pipeline.py): it takes a batch where every sequence
verifies exactly k drafts, greedy or sampled (temperature, top-k, top-p, min-p), and asks for no
logprobs and no logits processing (penalties, logit_bias, grammars: those stay on the host step,
logits_processing.py). It runs on the
target's padded forward and the draft loop (spec_decode/draft_graph.py) whether they are captured
CUDA graphs or not: off CUDA, under --enforce-eager, after a refused capture, or with an attention
backend that reads host lengths (the CPU's default torch backend: then the bucket is the exact
batch and each forward reads its lengths from the buffers), the same code runs eagerly. Every
other batch takes the host step (host_step.py says which and why). A sequence near max_tokens
keeps its k draft rows with its acceptance capped (ScheduledSequence.accept_limit). How many
drafts a sequence accepts is the verifier's (spec_decode/verifier.py: exact greedy, or drawn when
acceptance is simulated), chosen when the runner is built.

Sampled rows: the verifier rejection-samples over the target's [n, k + 1, vocab] logits on the
device (verifier.sample_padded), drawing counter-based noise keyed by each sequence's key (its
seed and sample index, or the engine's seed and the sequence for a request without a seed) and
the positions in the buffers, so a step queued ahead draws what the host step would for a seeded
request at those positions. The drafts it verifies come either from the host step's proposer (a
sampled draft with the distribution it was drawn from, taken here from the host step) or from
the padded draft loop, which drafts greedily for every row: a deterministic draft is verified
against a one-hot q, which is exact (it accepts with probability p(d) instead of the
sum(min(p, q)) of a draft sampled from the drafter's distribution).

Everything the next verify step needs is on the device when this one ends (each sequence's
accepted count, its next token and its k new drafts), so with async scheduling the pipeline queues
that step (LaunchedVerify.launch_next) before reading this one's results, as decode_ahead.py does
for plain decoding: the buffers advance on the device, the forwards run (or replay), and the launch
is used if the scheduler's next decision is that batch, dropped otherwise (why dropping is safe:
there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import NoiseSource, SamplingBatch, sequence_key
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.input_batch import InputBatch
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy
from foretell.spec_decode.draft_graph import DraftGraphRunner
from foretell.spec_decode.rejection_sampler import PaddedSampling, dense_draft_probs
from foretell.spec_decode.verifier import Verifier


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
    num_sampled_steps: int = 0  # padded steps launched with sampled rows (queued ahead included)

    def fits(self, sched: SchedulerOutput, batch: InputBatch) -> bool:
        """A batch where every sequence verifies exactly k drafts and wants no logprobs or logits
        processing, on a bucket of the padded forward, and the draft loop's catch-up rows below
        max_model_len (a draft LM one short of the limit takes the host step: nothing it drafts
        there is used)."""
        k = self.draft_graphs.k
        key = self.graphs.bucket_for(batch)
        return (
            key is not None
            and key[1] == k + 1
            and all(
                item.samples
                and len(item.draft_token_ids) == k
                and item.seq.sampling_params.logprobs is None
                and not item.seq.sampling_params.needs_logits_processing
                and self.draft_graphs.catch_up_fits(item.seq.num_computed_tokens)
                for item in sched.scheduled
            )
        )

    def launch(self, sched: SchedulerOutput, batch: InputBatch) -> "LaunchedVerify | None":
        """The step the scheduler decided, its inputs from `batch`, when the batch fits."""
        if not self.fits(sched, batch):
            return None
        key = self.graphs.bucket_for(batch)
        self.graphs.run(batch, key)
        items = sched.scheduled
        seqs = [item.seq for item in items]
        limits = [item.accept_limit for item in items]
        draft_ids = [item.draft_token_ids for item in items]
        kept = [self.take_draft_probs(item) for item in items]  # forgotten there: this step verifies them
        sampled = self._sampling(seqs, key[1])
        draft_probs = None
        if sampled is not None and any(probs is not None for probs in kept):  # drafts the host step sampled
            drafts = self.graphs.input_ids[: len(items) * key[1]].view(len(items), key[1])[:, 1:]
            draft_probs = dense_draft_probs(drafts, [len(d) for d in draft_ids], kept, self.vocab_size)
        accepted, next_token, drafts = self._verify_on_device(key, len(items), limits, sampled, draft_probs)
        return self._launched(seqs, key, accepted, next_token, drafts,
                              [seq.num_computed_tokens for seq in seqs], draft_ids, limits, sampled)

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

    def can_follow(self, launched: "LaunchedVerify") -> bool:
        """Whether the step after `launched` can be queued before its results are known: whatever
        `launched` accepts, no sequence may reach max_tokens or max_model_len within the next step
        (the scheduler would cap or cut it), and every slot the next step writes (its k + 1 target
        rows, then the draft loop's rows up to k positions further) must sit in allocated blocks,
        and the block tables fit the graphs' (max_blocks per sequence)."""
        q = launched.key[1]
        k = q - 1
        max_blocks = self.graphs.block_table.shape[1]
        for seq, start in zip(launched.seqs, launched.start_positions):
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None and seq.num_output_tokens + 2 * q > max_tokens:
                return False
            if seq.num_tokens + 2 * q > self.max_model_len:
                return False
            last_slot = start + q + k + k  # next start <= start + q; its rows and drafts follow
            if not last_slot // self.block_size < len(seq.block_ids) <= max_blocks:
                return False
        return True

    def launch_after(self, launched: "LaunchedVerify") -> "LaunchedVerify":
        """Queue the verify step after `launched` (can_follow() said it may be): its inputs are
        computed on the device from `launched`'s outputs; its host-side expectations are filled
        in by expect() once `launched` is read."""
        n = len(launched.seqs)
        block_ids = [seq.block_ids for seq in launched.seqs]
        self.graphs.advance_verify(n, launched.accepted, launched.next_token, launched.drafts, block_ids)
        self.graphs.replay(launched.key)
        limits = [None] * n
        # The same sequences: the same parameters and keys; their positions advanced in the buffers.
        accepted, next_token, drafts = self._verify_on_device(launched.key, n, limits, launched.sampled, None)
        return self._launched(launched.seqs, launched.key, accepted, next_token, drafts, [], [], limits,
                              launched.sampled)

    def _verify_on_device(self, key: tuple[int, int], n: int, limits: list[int | None],
                          sampled: PaddedSampling | None, draft_probs: "torch.Tensor | None"):
        """After the target graph `key` ran: verification (rejection sampling when `sampled`; the
        drafts' distributions draft_probs [n, k, vocab], None: deterministic drafts), the next token
        and the draft-loop graph, all on the device. Returns (accepted [n], next_token [n], drafts
        [n, k]), views of static buffers that the next step overwrites (in stream order, after this
        step used them)."""
        bucket, q = key
        k = q - 1
        outputs = self.graphs.graphs[key]
        greedy = outputs.greedy[: n * q].view(n, q)  # the target's greedy token per row
        drafts_in = self.graphs.input_ids[: n * q].view(n, q)[:, 1:]
        caps = None
        if any(limit is not None for limit in limits):  # near max_tokens: the rows stay, acceptance is capped
            caps = torch.tensor([k if limit is None else limit for limit in limits], device=greedy.device)
        self.graphs.side.before_output_write()  # the last step's results have left for the host
        loop = self.draft_graphs
        if sampled is None:
            self.verifier.accept_padded(greedy, drafts_in, caps, loop.accepted, loop.next_token, loop.num_live)
        else:
            self.num_sampled_steps += 1
            logits = outputs.logits[: n * q].view(n, q, -1)  # [n, k + 1, vocab] float32
            first_positions = self.graphs.positions[: n * q].view(n, q)[:, 0]  # [n], as the buffers hold them
            self.verifier.sample_padded(logits, greedy, drafts_in, draft_probs, sampled, first_positions, caps,
                                        loop.accepted, loop.next_token, loop.num_live)
        drafts = loop.run(bucket, n)  # [n, k]
        return loop.accepted[:n], loop.next_token[:n], drafts

    def _launched(self, seqs, key, accepted, next_token, drafts, starts, draft_ids, limits,
                  sampled) -> "LaunchedVerify":
        copy = HostCopy(*self.graphs.side.download_outputs([accepted, next_token, drafts]))
        return LaunchedVerify(self, seqs, key, accepted, next_token, drafts, copy, starts, draft_ids, limits,
                              sampled)


@dataclass
class LaunchedVerify:
    """A padded verify step queued on the device whose results the host has not read yet."""

    kind: GraphedVerify  # what launched it, and launches the step after it
    seqs: list[Sequence]
    key: tuple[int, int]  # (batch bucket, k + 1)
    accepted: torch.Tensor  # [num_seqs] int64 on the device
    next_token: torch.Tensor  # [num_seqs] int64
    drafts: torch.Tensor  # [num_seqs, k] int64: the drafts for the step after this one
    copy: HostCopy  # of [accepted, next_token, drafts]
    # What the step verifies, on the host: its first position per sequence and its drafts. A
    # step launched ahead learns them when the step before it is read (expect()).
    start_positions: list[int]
    draft_token_ids: list[list[int]]
    accept_limits: list[int | None]
    sampled: PaddedSampling | None  # the sampled rows' parameters and keys (None: greedy only)

    def launch_next(self) -> "LaunchedVerify | None":
        if not self.kind.can_follow(self):
            return None
        return self.kind.launch_after(self)

    def read(self, following: "LaunchedVerify | None") -> list[SequenceResult]:
        """This step's results; the step queued after it learns what it verifies from them."""
        results = self.results()
        if following is not None:
            following.expect(self, results)
        return results

    def results(self) -> list[SequenceResult]:
        n, k = len(self.seqs), self.key[1] - 1
        host = self.copy.read()
        return [
            SequenceResult(
                new_token_ids=drafts[: host[i]] + [host[n + i]],
                num_accepted=host[i],
                num_drafts=len(drafts) if limit is None else min(len(drafts), limit),
                next_drafts=host[2 * n + i * k : 2 * n + (i + 1) * k],
            )
            for i, (drafts, limit) in enumerate(zip(self.draft_token_ids, self.accept_limits))
        ]

    def expect(self, previous: "LaunchedVerify", previous_results: list) -> None:
        """Fill in what this step (launched after `previous`) verifies, from previous's results."""
        self.start_positions = [
            p + r.num_accepted + 1 for p, r in zip(previous.start_positions, previous_results)
        ]
        self.draft_token_ids = [r.next_drafts for r in previous_results]

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        """Whether the scheduler's decision is this step: its sequences in order, each verifying
        the expected drafts from the expected position, with no cap on acceptance."""
        if len(scheduled) != len(self.seqs):
            return False
        q = self.key[1]
        for item, seq, start, drafts in zip(scheduled, self.seqs, self.start_positions, self.draft_token_ids):
            if (
                item.seq is not seq
                or seq.num_computed_tokens != start
                or item.num_new_tokens != q
                or not item.samples
                or item.accept_limit is not None
                or item.draft_token_ids != drafts
            ):
                return False
        return True
