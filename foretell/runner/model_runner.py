"""ModelRunner: one step of the target (and the drafter) on a device.

Set-up, in order: the model, the proposer (spec_decode/registry.py), the KV caches and
max_model_len (here), the CUDA graphs of the target and of the draft loop (graph_setup.py), the
sampler and the verifier (spec_decode/verifier.py: exact, or simulated acceptance, chosen here
once), and the step pipeline with the kinds of device step it may launch (graph_setup.py's
build_step_pipeline; step_pipeline.py). The runner never asks which model or which drafter it
runs: capabilities come from the proposer's typed ProposerCapabilities.

Under tensor parallelism one runner runs in each rank's worker process (worker_entry.py), built
with the rank's TensorParallel and device: the target (and MTP layers) hold the rank's slices,
EAGLE3 heads and draft models are whole on every rank, every rank gets the same KV block count
(the fewest any rank can hold), and every rank computes the same tokens (whole logits, one
noise seed; a step of greedy rows only takes greedy tokens without gathering the logits: the
padded step's uncaptured forward, CapturedForward, and HostStep.greedy_without_logits). Over NCCL
it captures its graphs, collectives included, and queues steps ahead; over gloo it runs the padded
step eagerly and queues nothing ahead (distributed/graph_capture.py says why).

execute(): the step the pipeline queued ahead when the scheduler's batch is that step; else a
device step the pipeline launches for the batch (a plain decode step, decode_ahead.py; a padded
verify step, graphed_verify.py, on the target's graphs or, without them, on the same static
buffers run eagerly: padded_forward); else, for prompt chunks beside verifies, one forward over
both whose verify rows the padded step finishes and whose prompt rows the host step samples
(split_step.py); else the step from host inputs: target forward -> logits of the sampling rows ->
Sampler (no drafts in the step) or the verifier -> Proposer (catch-up + k drafts) ->
per-sequence results for the scheduler (host_step.py). With a padded step, the host step verifies
drafts only in the rare batch no padded step fits. Before any of it, each sequence is checked on
its own (step_checks.py), so a bad one fails alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from foretell.config import EngineConfig
from foretell.distributed.graph_capture import graph_capture_decision
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.engine.scheduler import SchedulerOutput
from foretell.runner.sequence_result import SequenceResult
from foretell.ops.attention.dispatch import build_attention_backend
from foretell.layers.sampler import NoiseSource, Sampler
from foretell.layers.batch_invariant import prepare_batch_invariant
from foretell.layers.vocab_parallel import ParallelLMHead
from foretell.ops.gemm.dispatch import SmallMGemm
from foretell.models.base import HFConfig, ModelOptions
from foretell.runner.context_limit import resolve_max_model_len
from foretell.runner.cpu_setup import prepare_cpu_models
from foretell.runner.graph_setup import StepGraphSetup, build_step_pipeline, skips_catch_up
from foretell.runner.input_batch import DeferredInputBatch, InputBatch
from foretell.runner.graphed_verify import GraphedVerify, VerifyPlan
from foretell.runner.host_step import HostStep
from foretell.runner.host_tree_steps import plain_step_of_host_trees
from foretell.runner.host_drafts import propose_from_tokens
from foretell.runner.split_step import ForwardRows, SplitBatch, forward_split
from foretell.runner.step_checks import check_step
from foretell.runner.tree_step import TreeStep
from foretell.runner.logprobs import add_prompt_logprobs
from foretell.runner.startup_costs import measure_step_priors
from foretell.runner.kv_cache import CachePlan, DraftKVCache, KVCache, kv_cache_budget, kv_cache_dtypes, plan_cache
from foretell.models.loading import build_model, checkpoint_dtype
from foretell.models.quantization import resolve_quantization
from foretell.spec_decode.proposer import Proposer
from foretell.spec_decode.registry import build_proposer
from foretell.spec_decode.verifier import build_verifier
from foretell.structured.runtime import StructuredOutputs

logger = logging.getLogger("foretell")


@dataclass
class StepTimes:
    target_s: float = 0.0
    draft_s: float = 0.0


@dataclass(frozen=True)
class RunnerFacts:
    """What the engine reads of a runner once, at start-up (the same on every rank; pickles)."""

    max_model_len: int
    vocab_size: int
    cache_plan: CachePlan
    num_lookahead_tokens: int
    keep_draft_rows: bool  # verifies keep k + 1 rows (the graphs' shape): the scheduler caps instead
    draft_kv_reads_next_token: bool  # the drafter's cache reads one slot past the target's
    synthetic_acceptance: bool
    skips_catch_up: bool  # a step drafting nothing next runs no drafter (graph_setup.skips_catch_up)
    device: str
    dtype: str


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        tensor_parallel: TensorParallel | None = None,  # this rank's place; None: one rank
        device: torch.device | None = None,  # None: the config's device (resolved here)
    ):
        self.config = config
        mc = config.model
        self.tensor_parallel = tensor_parallel or TensorParallel()
        self.device = device if device is not None else mc.resolve_device()
        if mc.num_cpu_threads is not None:
            torch.set_num_threads(mc.num_cpu_threads)  # the process-wide knob, set once, asked for
        self.hf_config = HFConfig.from_folder(mc.model)
        self.dtype = mc.resolve_dtype(checkpoint_dtype(self.hf_config), self.device)
        self.backend = build_attention_backend(mc.attention_backend, self.device, mc.batch_invariant)
        parallel = dict(tensor_parallel=self.tensor_parallel, expert_parallel=config.parallel.enable_expert_parallel,
                        quantization=resolve_quantization(self.hf_config, mc.quantization))
        options = ModelOptions(self.dtype, self.device, self.backend, **parallel)
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            self.proposer = build_proposer(config.speculative, self.hf_config, options)
            options = ModelOptions(
                self.dtype, self.device, self.backend, self.proposer.capabilities.aux_hidden_state_layers, **parallel
            )
        self.model = build_model(mc.model, self.hf_config, options, mc.load_format, mc.seed)
        if self.proposer is not None:
            self.proposer.load(self.model, mc.load_format)
        # the CPU's weight layouts, packed draft heads and compiled forwards (cpu_setup.py)
        prepare_cpu_models(self.model, self.proposer, config, self.device, self.tensor_parallel.world_size)
        if mc.batch_invariant:  # every float Linear, LMHead and MoE of target and drafter
            prepare_batch_invariant([self.model, *(self.proposer.draft_modules() if self.proposer else [])])
        self.vocab_size = self.hf_config.language_model().vocab_size
        mode = config.scheduler.async_scheduling
        # Queue the next step before reading this one (step_pipeline.py): plain decoding, and the
        # padded greedy verify (which needs the graphs; checked once they are captured).
        queue_ahead = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self.graph_decision = graph_capture_decision(self.tensor_parallel, self.device)
        queue_ahead = queue_ahead and self.graph_decision.allowed  # not over gloo (graph_capture.py)
        self.uses_tree = bool(config.speculative and config.speculative.uses_tree)  # tree_step.py: host steps only
        # A host drafter's trees (suffix): its steps without trees decode plainly, queued ahead (execute)
        self.host_trees = self.uses_tree and self.proposer.capabilities.drafts_from_tokens
        queue_ahead = queue_ahead and (not self.uses_tree or self.host_trees)
        k = config.speculative.num_draft_kv_slots if config.speculative else 0
        # KV slots reserved past a sampling step's rows: the drafter's k, plus, when steps are
        # queued ahead, the k + 1 rows of the step after it (it is launched before the scheduler
        # can allocate for it).
        self.num_lookahead_tokens = k + (k + 1 if queue_ahead else 0)
        self.cache_plan = self._allocate_cache()
        self.max_model_len = resolve_max_model_len(self.hf_config, self.proposer, config, self.cache_plan,
                                                   self.num_lookahead_tokens)
        step_graphs = StepGraphSetup(config, self.model, self.proposer, self.cache_plan, self.max_model_len,
                                     self.num_lookahead_tokens, self.device, self.tensor_parallel,
                                     self.graph_decision, self.uses_tree).build()
        self.small_m_gemm: SmallMGemm | None = step_graphs.small_m_gemm
        self.graphs = step_graphs.target
        self.padded_forward = step_graphs.padded_forward
        self.draft_graphs = step_graphs.draft_loop
        noise = NoiseSource(self.device, mc.seed)  # the sampler's and the verifier's: one stream of draws
        sampler = Sampler(noise)
        self.verifier = build_verifier(config.speculative, noise, mc.seed)
        self.host_step = HostStep(sampler, self.verifier, self.proposer, self.vocab_size,
                                  self.cache_plan.block_size, self.max_model_len, self.device,
                                  tensor_parallel=self.tensor_parallel.is_parallel,
                                  structured=StructuredOutputs(mc.tokenizer or mc.model, self.vocab_size,
                                                               forced_drafts=config.speculative is None
                                                               or config.speculative.structured_forced_drafts),
                                  skip_catch_up=skips_catch_up(config.speculative, self.proposer))
        self.pipeline = build_step_pipeline(
            step_graphs, queue_ahead=queue_ahead, has_drafter=self.proposer is not None,
            target_forward=self.target_forward, sampler=sampler, verifier=self.verifier,
            take_draft_probs=self.host_step.take_draft_probs, vocab_size=self.vocab_size,
            block_size=self.cache_plan.block_size, max_model_len=self.max_model_len,
            structured=self.host_step.structured, forget_draft_probs=self.host_step.forget_draft_probs,
            host_trees=self.host_trees)
        self.tree_step = None if not self.uses_tree else TreeStep(
            self.model, self.proposer, self.host_step, self.target_forward, config, self.cache_plan.block_size,
            self.device, self.tensor_parallel.is_parallel, step_graphs.tree_verify)
        self.last_times = StepTimes()
        self.drafts_from_tokens = self.proposer is not None and self.proposer.capabilities.drafts_from_tokens
        # Drafts are verified on the padded step (graphed_verify.py), a mixed batch's too (split_step.py)
        self.padded_verify = next((kind for kind in self.pipeline.kinds if isinstance(kind, GraphedVerify)), None)
        self.num_split_steps = 0  # batches of prompt chunks beside verifies, split (split_step.py)

    def describe(self) -> RunnerFacts:
        capabilities = self.proposer.capabilities if self.proposer is not None else None
        return RunnerFacts(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            cache_plan=self.cache_plan,
            num_lookahead_tokens=self.num_lookahead_tokens,
            keep_draft_rows=self.padded_forward is not None or self.uses_tree,  # (trees cap their path)
            draft_kv_reads_next_token=bool(capabilities and capabilities.draft_kv_reads_next_token),
            synthetic_acceptance=self.verifier.synthetic,
            skips_catch_up=skips_catch_up(self.config.speculative, self.proposer),
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
        )

    # ---- set-up --------------------------------------------------------------------------
    def _allocate_cache(self) -> CachePlan:
        cc = self.config.cache
        draft_layers = self.proposer.kv_layers() if self.proposer else []
        spec = self.config.speculative
        cache_dtype, draft_cache_dtype = kv_cache_dtypes(
            cc.kv_cache_dtype, self.dtype, self.proposer.draft_dtype if self.proposer else None)

        def plan_for(budget: int | None, num_blocks: int | None) -> CachePlan:
            return plan_cache(
                budget, num_blocks, self.model.attention_layers(), cache_dtype, cc.block_size, draft_layers,
                draft_cache_dtype, spec.draft_block_size if spec else None,
            )

        plan = plan_for(kv_cache_budget(cc, self.device), cc.num_kv_blocks)
        fewest = self._fewest_over_ranks(plan.num_blocks)
        if fewest != plan.num_blocks:  # another rank has less memory free: every rank holds as few
            plan = plan_for(None, fewest)
        self.kv_cache = KVCache(
            self.model.attention_layers(), plan.num_blocks, plan.block_size, cache_dtype, self.device
        )
        self.draft_kv_cache = None
        if draft_layers:
            self.draft_kv_cache = DraftKVCache(
                draft_layers,
                plan.draft_num_blocks,
                plan.draft_block_size,
                draft_cache_dtype,
                self.device,
            )
            self.proposer.bind_draft_cache(plan.draft_block_size)
        return plan

    def _fewest_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (the value itself with one rank)."""
        if not self.tensor_parallel.is_parallel:
            return value
        every = self.tensor_parallel.all_gather(torch.tensor([value], dtype=torch.int64, device=self.device), dim=0)
        return int(every.min())

    def target_forward(self, batch: InputBatch, greedy_tokens: bool = False):
        """(hidden, aux, logits of the sampling rows [rows, vocab] float32): a graph replay when
        one fits. With greedy_tokens (a tensor-parallel step HostStep.greedy_without_logits chose),
        the rows' greedy tokens [rows] int64 instead of their logits: eager, gathering none; on a
        replay (NCCL), the graph's own picks over the logits it gathered."""
        key = self.graphs.bucket_for(batch) if self.graphs is not None else None
        every_row = batch.every_row_samples  # no gather (a decode step)
        if key is not None:
            captured, rows = self.graphs.run(batch, key), batch.num_tokens
            picked = captured.greedy if greedy_tokens else captured.logits  # [B * q] int64 | [B * q, vocab]
            picked = picked[:rows] if every_row else picked[:rows][batch.logits_rows]
            return captured.hidden[:rows], [a[:rows] for a in captured.aux], picked
        hidden, aux = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        sampling_rows = hidden if every_row else hidden[batch.logits_rows]
        if greedy_tokens:
            return hidden, aux, self.model.compute_greedy_tokens(sampling_rows)
        return hidden, aux, self.model.compute_logits(sampling_rows)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SequenceResult]:
        t0 = time.perf_counter()
        check_step(sched, self.max_model_len, self.vocab_size)
        if self.tree_step is not None:
            results = plain_step_of_host_trees(self.pipeline, self.tree_step, sched, self.cache_plan.block_size,
                                               self.device) if self.host_trees else None
            draft_s = 0.0
            if results is None:
                results = self.tree_step.execute(sched)
                draft_s = self.tree_step.draft_s
            self.last_times = StepTimes(target_s=time.perf_counter() - t0 - draft_s, draft_s=draft_s)
            return results
        block_size = self.cache_plan.block_size
        step = self.pipeline.take(sched.scheduled, block_size)  # the step queued ahead, when it is this one
        if step is None:
            # built at first use: a padded verify of unequal draft counts builds only its padded batch
            batch = DeferredInputBatch(sched.scheduled, block_size, self.device)
            step = self.pipeline.launch(sched, batch)
        if step is not None:  # queues the step after it when it can, then reads its results
            return self._finish_device_step(sched, step, t0, queue_next=True)
        split = SplitBatch.of(sched) if self.padded_verify is not None else None
        if split is not None:  # prompt chunks beside verifies: the verifies finish on the padded step
            plan = self.padded_verify.plan(split.verify, DeferredInputBatch(split.verify.scheduled, block_size,
                                                                            self.device))
            if plan is not None:
                return self._split_step(split, plan, t0)
        return self._host_step(sched, batch, t0)

    def _split_step(self, split: SplitBatch, plan: VerifyPlan, t0: float) -> list[SequenceResult]:
        """One forward over a split batch (split_step.py): its verifies verified and drafted for by
        the padded step, its prompt chunks sampled and caught up over by the host step."""
        self.num_split_steps += 1
        verify_rows, prefill_rows = forward_split(self.model, plan, split.prefill, self.cache_plan.block_size,
                                                  self.max_model_len, self.device)
        kind = self.padded_verify
        forward = kind.graphs.load(plan.batch, plan.key, verify_rows)
        verified = self._finish_device_step(split.verify, kind.launch_planned(split.verify, plan, forward), t0,
                                            queue_next=False)
        draft_s = self.last_times.draft_s
        prefill_batch = DeferredInputBatch(split.prefill.scheduled, self.cache_plan.block_size, self.device)
        results = split.merge(verified, self._host_step(split.prefill, prefill_batch, t0, prefill_rows))
        self.last_times.draft_s += draft_s
        return results

    def _finish_device_step(self, sched: SchedulerOutput, step, t0: float, queue_next: bool) -> list[SequenceResult]:
        """A launched device step's results, with a host drafter's drafts (queue_next: queue the
        step after it first, when the pipeline may)."""
        results = self.pipeline.finish(step, sched.num_next_drafts, queue_next=queue_next)
        t1 = time.perf_counter()
        if self.drafts_from_tokens:  # a host drafter's drafts, from the host lists (host_drafts.py)
            propose_from_tokens(self.proposer, sched, results, self.cache_plan.block_size, self.max_model_len,
                                self.host_step.structured)
        elif step.drafter_rows is not None:  # a hybrid: its model drafter over the step's rows
            rows = step.drafter_rows
            self.host_step.propose(sched, rows.batch, rows.hidden, rows.aux, results)
        self.last_times = StepTimes(target_s=t1 - t0, draft_s=time.perf_counter() - t1)
        return results

    def _host_step(self, sched: SchedulerOutput, batch: InputBatch, t0: float,
                   computed: ForwardRows | None = None) -> list[SequenceResult]:
        """The step from host inputs (the module docstring's last case); computed: the batch's
        rows of a forward that already ran (a split batch's)."""
        results = [SequenceResult() for _ in sched.scheduled]
        greedy = None  # [rows] int64: a tensor-parallel step of greedy rows only takes no logits
        greedy_only = self.host_step.greedy_without_logits(sched, batch)
        if computed is not None:
            hidden, aux = computed.hidden, computed.aux
            greedy, logits = (computed.greedy, None) if greedy_only else (None, computed.logits)
        elif greedy_only:
            hidden, aux, greedy = self.target_forward(batch, greedy_tokens=True)
        else:
            hidden, aux, logits = self.target_forward(batch)  # logits [rows, vocab] float32
        add_prompt_logprobs(self.model, sched, batch, hidden, results)
        if greedy is not None:
            self.host_step.sample_greedy(sched, batch, greedy, results)
        else:
            self.host_step.sample(sched, batch, logits, results)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        if self.proposer is not None:
            self.host_step.propose(sched, batch, hidden, aux, results)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.last_times = StepTimes(target_s=t1 - t0, draft_s=time.perf_counter() - t1)
        return results

    def num_logit_gathers(self) -> int:
        """How many times the vocabulary-parallel heads (the target's, MTP's) have gathered whole
        logits rows on this rank (0 with one rank)."""
        modules = [self.model, *(self.proposer.draft_modules() if self.proposer is not None else [])]
        return sum(m.num_gathers for module in modules for m in module.modules() if isinstance(m, ParallelLMHead))

    def reset_pipeline(self) -> None:
        """Drop the step queued ahead (after the warm-up)."""
        self.pipeline.reset()

    def replay_step_costs(self, max_k: int) -> dict[int, list[float]] | None:
        """Adaptive speculation's start-up priors, {batch: [K + 1] seconds}, from replays of the
        captured graphs (runner/startup_costs.py); None without them."""
        priors = measure_step_priors(self.padded_forward, self.draft_graphs, max_k, min(
            self.max_model_len, self.cache_plan.num_blocks * self.cache_plan.block_size))
        self.reset_pipeline()  # the replays rewrote the graphs' input buffers
        return priors

    def abandon_step(self, seq_ids: list[int]) -> None:
        """After a failed step: drop the step queued ahead (it assumed this one's results) and the
        sequences' draft probabilities (the engine drops their drafts too)."""
        self.pipeline.drop()
        for seq_id in seq_ids:
            self.forget(seq_id)

    def forget(self, seq_id: int) -> None:
        """Drop per-sequence state (draft probabilities) of a finished or preempted sequence."""
        self.host_step.forget(seq_id)
        if self.tree_step is not None:
            self.tree_step.forget(seq_id)

    def drop_cached_responses(self) -> None:
        """After synthetic requests (the warm-up): the drafter keeps none of their responses."""
        if self.proposer is not None:
            self.proposer.drop_cached_responses()

    def graph_state(self) -> dict:
        """Whether this runner captured its graphs and queues steps ahead, why not when not
        (graph_capture.py decides under tensor parallelism), and its verifies padded / on the host step."""
        return {"allowed": self.graph_decision.allowed, "reason": self.graph_decision.reason,
                "captured": self.graphs is not None and self.graphs.captures,
                "queue_ahead": self.pipeline.queue_ahead,
                "padded_verify_steps": self.padded_verify.num_steps if self.padded_verify is not None else 0,
                "host_verify_steps": self.host_step.num_verify_steps}

    def runner_stats(self) -> dict:
        """What the runner adds to get_stats(): the drafter's (Proposer.stats) and the step
        pipeline's steps queued ahead of their results, and how many of those the scheduler's
        next decision matched (the others were dropped and launched again from host inputs)."""
        stats = self.proposer.stats() if self.proposer is not None else {}
        stats.update(steps_queued_ahead=self.pipeline.num_launched, steps_queued_ahead_used=self.pipeline.num_used)
        return stats

    def shutdown(self) -> None:
        """Wait for the grammar masks being filled ahead and end their thread (RunnerHandle's; a
        ParallelRunner stops its workers)."""
        self.host_step.structured.close()

