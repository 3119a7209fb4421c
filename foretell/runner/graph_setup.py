"""Set-up of a runner's device steps: the target's CUDA graphs, the padded verify step's forward
and draft loop, and the step pipeline with the kinds of device step it may launch.

StepGraphSetup.build() runs once, after the KV caches are allocated and max_model_len is known:
  1. the target's graphs (cuda_graph.CudaGraphRunner): captured on CUDA; on the CPU with a
     graph-safe backend the same buffers, uncaptured; None with --enforce-eager, a backend that
     is not graph-safe, tensor parallelism over gloo (distributed/graph_capture.py) or a refused
     capture. The few-row GEMMs (layers/small_m.py) are bound just before the capture;
  2. the padded verify step's target forward: the graphs, or without them the same static
     buffers run eagerly (None without a drafter, under tensor parallelism, and for tree
     speculation, which verifies on its own step);
  3. the padded step's draft loop (spec_decode/draft_graph.DraftGraphRunner), captured when the
     drafter's backend allows, else run eagerly (the same code); for a drafter that drafts from
     the token lists on the host (n-gram, suffix), host_drafts.HostDraftSlots, which drafts
     nothing on the device (the padded forward then takes host_draft_verify_lens' few verify
     lengths, captured or not).
build_step_pipeline() then makes the step pipeline (step_pipeline.py) from them: plain decoding
queued ahead without a drafter (decode_ahead.py), the padded verify step with one
(graphed_verify.py), and plain decoding again for the k = 0 steps of a drafter that then runs
not at all (skips_catch_up: decode_ahead.py's zero_drafts_only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from foretell.config import EngineConfig
from foretell.distributed.graph_capture import GraphDecision
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.sampler import Sampler
from foretell.layers.small_m import prepare_small_m_linears
from foretell.ops.gemm.dispatch import SmallMGemm
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_drafts import HostDraftSlots, host_draft_verify_lens
from foretell.runner.kv_cache import CachePlan
from foretell.runner.step_pipeline import StepKind, StepPipeline
from foretell.runner.tree_graphs import TreeVerifyGraphs, tree_step_gemm_rows
from foretell.spec_decode.draft_graph import DraftGraphRunner
from foretell.spec_decode.proposer import Proposer
from foretell.spec_decode.verifier import Verifier
from foretell.structured.runtime import StructuredOutputs

logger = logging.getLogger("foretell")


@dataclass
class StepGraphs:
    """What StepGraphSetup.build() made; each None where the runner has no such path."""

    target: CudaGraphRunner | None  # the target's graphs, used by every batch that fits one
    padded_forward: CudaGraphRunner | None  # the padded verify step's target forward
    draft_loop: DraftGraphRunner | HostDraftSlots | None  # the padded verify step's draft loop
    small_m_gemm: SmallMGemm | None  # the few-row GEMMs bound before the capture
    tree_verify: TreeVerifyGraphs | None = None  # the tree step's verify forward (tree_graphs.py)


class StepGraphSetup:
    """Builds the target's graphs, the padded forward and the draft loop of one runner."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        proposer: Proposer | None,
        cache_plan: CachePlan,
        max_model_len: int,
        num_lookahead_tokens: int,  # KV slots past a step's rows (the graphs' block tables hold them)
        device: torch.device,
        tensor_parallel: TensorParallel,
        graph_decision: GraphDecision,  # may this rank capture (graph_capture.py)
        uses_tree: bool,  # tree speculation: verifies on the host, no padded step
    ):
        self.config = config
        self.model = model
        self.proposer = proposer
        self.cache_plan = cache_plan
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.graph_decision = graph_decision
        self.uses_tree = uses_tree
        self.small_m_gemm: SmallMGemm | None = None  # bound with the graphs, before capture

    def build(self) -> StepGraphs:
        target = self.target_graphs()
        padded_forward = self.padded_forward(target)
        draft_loop = self.draft_loop(padded_forward)
        return StepGraphs(target, padded_forward, draft_loop, self.small_m_gemm, self.tree_verify(target))

    def graph_runner(self, capture_graphs: bool, reads_host_lengths: bool) -> CudaGraphRunner:
        """A CudaGraphRunner over this runner's batch buckets and verify lengths (uncaptured)."""
        spec = self.config.speculative
        query_lens = (1,) if spec is None else (1, spec.num_speculative_tokens + 1)
        if spec is not None and spec.adaptive:  # a verify of any length adaptive speculation chooses
            query_lens = tuple(range(1, spec.num_speculative_tokens + 2))
        elif spec is not None and self.drafts_on_host():  # drafts as long as the match: a few lengths
            query_lens = host_draft_verify_lens(self.proposer.k)
        if self.uses_tree:  # trees verify on their own graphs (tree_verify); the rest decodes
            query_lens = (1,)
        return CudaGraphRunner(
            self.model,
            self.config.scheduler.max_num_seqs,
            query_lens,
            max_blocks_per_seq=-(-(self.max_model_len + self.num_lookahead_tokens) // self.cache_plan.block_size) + 1,
            block_size=self.cache_plan.block_size,
            max_model_len=self.max_model_len,
            device=self.device,
            capture_graphs=capture_graphs,
            reads_host_lengths=reads_host_lengths,
        )

    def drafts_on_host(self) -> bool:
        """A drafter that drafts on the host after the step's read, with no device loop: n-gram,
        suffix (from the token lists) and a hybrid (suffix + a model catching up on the host)."""
        return self.proposer is not None and self.proposer.padded_drafter() is None

    def target_graphs(self) -> CudaGraphRunner | None:
        """The target's graphs (captured on CUDA; on the CPU with a graph-safe backend the same
        buffers, uncaptured), used by every batch that fits one; None: eager forwards."""
        layers = self.model.attention_layers()
        mc = self.config.model
        if mc.enforce_eager or not all(layer.backend.graph_safe for layer in layers):
            return None
        if not self.graph_decision.allowed:  # tensor parallel over gloo (graph_capture.py)
            return None
        graphs = self.graph_runner(capture_graphs=True, reads_host_lengths=False)
        if graphs.captures and not mc.batch_invariant:  # (the mode binds its own GEMM)
            # cuBLAS or the batch-1 GEMV, per shape, decided now: nothing is timed in a capture.
            # Rows: a graph's batch bucket x query length, + 1 for a draft LM's catch-up rows.
            drafter = self.proposer.draft_modules() if self.proposer else []
            rows = graphs.buckets[-1] * (max(graphs.query_lens) + 1)
            if self.uses_tree:  # the tree verify's T rows a sequence, not the decode graphs' 1 (issue 28)
                spec = self.config.speculative
                rows = max(rows, tree_step_gemm_rows(graphs.buckets[-1], spec.num_speculative_tokens, spec.topk,
                                                     spec.num_draft_tokens))
            self.small_m_gemm = prepare_small_m_linears([self.model, *drafter], rows, mc.small_m_gemm)
        try:
            graphs.capture()
        except RuntimeError as e:  # e.g. a layer that reads host values: run eagerly instead
            if self.tensor_parallel.is_parallel:  # one rank cannot fall back alone (graph_capture.py)
                raise
            logger.warning("CUDA graph capture failed, running eagerly: %s", e)
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    def tree_verify(self, target: CudaGraphRunner | None) -> TreeVerifyGraphs | None:
        """The tree step's verify graphs per (bucket, num_draft_tokens), captured after the target's
        into its pool (uncaptured on the CPU, as the target's); None without trees or without the
        target's graphs (--enforce-eager, a backend that is not graph-safe, ...): eager tree steps."""
        if not self.uses_tree or target is None:
            return None
        graphs = TreeVerifyGraphs(self.model, self.config.scheduler.max_num_seqs,
                                  self.config.speculative.num_draft_tokens, target.block_table.shape[1],
                                  target.block_size, self.max_model_len, self.device)
        graphs.pool = target.pool
        try:
            graphs.capture()
        except RuntimeError as e:
            logger.warning("tree verify graph capture failed, verifying trees eagerly: %s", e)
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    def padded_forward(self, target: CudaGraphRunner | None) -> CudaGraphRunner | None:
        """The target forward the padded verify step runs on: the graphs, or without them
        (--enforce-eager, a backend that reads host lengths, a refused capture, the CPU) the same
        static buffers run eagerly, for a drafter whose loop runs padded and for one that drafts on
        the host (n-gram, suffix, hybrid: its verifies take host_draft_verify_lens' few lengths, as
        on the graphs), tensor-parallel ranks over gloo included (a greedy step gathers no logits
        there: CapturedForward). None without a drafter."""
        if self.uses_tree:  # tree steps verify on the host (tree_step.py)
            return None
        if target is not None:
            return target
        if self.proposer is None:
            return None
        graph_safe = all(layer.backend.graph_safe for layer in self.model.attention_layers())
        return self.graph_runner(capture_graphs=False, reads_host_lengths=not graph_safe)

    def draft_loop(self, padded_forward: CudaGraphRunner | None) -> DraftGraphRunner | None:
        """The padded step's draft loop, captured after the target's graphs when its drafter's
        backend allows (else run eagerly: the same code)."""
        drafter = self.proposer.padded_drafter() if self.proposer is not None else None
        if padded_forward is not None and self.drafts_on_host():
            # n-gram, suffix, hybrid: verifies on the target's graphs (here padded_forward is them),
            # drafts on the host (a hybrid's model drafter over the step's rows)
            reads_rows = not self.proposer.capabilities.drafts_from_tokens
            return HostDraftSlots(padded_forward, self.proposer.k, reads_rows=reads_rows)
        if padded_forward is None or drafter is None:
            return None
        graph_safe = all(layer.backend.graph_safe for layer in self.proposer.kv_layers())
        spec = self.config.speculative
        loop = DraftGraphRunner(drafter, padded_forward, spec.num_speculative_tokens,
                                reads_host_lengths=not graph_safe,  # adaptive: verifies of 0..K drafts
                                verify_lens=tuple(range(1, spec.num_speculative_tokens + 2)) if spec.adaptive else None,
                                skip_catch_up=skips_catch_up(spec, self.proposer))
        try:
            loop.capture()
        except RuntimeError as e:
            logger.warning("draft-loop graph capture failed, drafting eagerly: %s", e)
            torch.cuda.synchronize(self.device)
        return loop


def skips_catch_up(spec, proposer: Proposer | None) -> bool:
    """Whether a step that drafts nothing for the next one runs no drafter (adaptive speculation
    with adaptive_skip_catch_up, a drafter whose cache tolerates holes: EAGLE3, MTP)."""
    return bool(spec is not None and spec.adaptive and spec.adaptive_skip_catch_up and proposer is not None
                and proposer.capabilities.catch_up_skippable)


def build_step_pipeline(
    step_graphs: StepGraphs,
    *,
    queue_ahead: bool,  # asked for (async scheduling) and allowed (graph_capture.py; trees: a host drafter's)
    has_drafter: bool,
    target_forward: Callable,  # the runner's: a graph replay when one fits, else eager
    sampler: Sampler,
    verifier: Verifier,
    take_draft_probs: Callable,  # HostStep.take_draft_probs
    vocab_size: int,
    block_size: int,
    max_model_len: int,
    structured: StructuredOutputs | None = None,  # grammar masks (HostStep's): padded verify, drafterless decode
    forget_draft_probs: Callable | None = None,  # HostStep.forget_draft_probs, for k = 0 steps decoded plainly
    host_trees: bool = False,  # a host drafter's trees (the tree step verifies them; the rest decodes here)
) -> StepPipeline:
    """The device steps a runner may launch: plain decoding one step ahead (without a drafter, for
    a host drafter's steps that carry no drafts or trees, and for the k = 0 steps of a drafter that
    skips its catch-up there), the padded verify (with a drafter whose loop runs padded, captured or not)."""
    kinds: list[StepKind] = []
    # A host drafter's step without drafts is a plain decode step, queued ahead as plain decoding's;
    # nothing is queued ahead of a drafter that reads each step's rows after its read (a hybrid).
    host_drafter = isinstance(step_graphs.draft_loop, HostDraftSlots) or host_trees
    if isinstance(step_graphs.draft_loop, HostDraftSlots) and step_graphs.draft_loop.reads_rows:
        queue_ahead = False
    plain_decode = None
    if queue_ahead and (not has_drafter or host_drafter):
        # Without a drafter its grammar requests decode here too, masked on the device (decode_ahead.py).
        plain_decode = DecodeAhead(step_graphs.target, target_forward, sampler, vocab_size, block_size, max_model_len,
                                   structured=None if has_drafter else structured)
        kinds.append(plain_decode)
    if step_graphs.draft_loop is not None:
        if queue_ahead and isinstance(step_graphs.draft_loop, DraftGraphRunner) and step_graphs.draft_loop.skips(0):
            # A k = 0 step whose drafter runs not at all is a plain decode step: decoded as one
            # (before the padded verify in the kinds: it declines every batch that drafts next).
            kinds.append(DecodeAhead(step_graphs.target, target_forward, sampler, vocab_size, block_size,
                                     max_model_len, zero_drafts_only=True, forget_draft_probs=forget_draft_probs))
        # Grammars on the padded step (padded_verify.py); a host drafter's verify queues the plain
        # step after it on the plain decode kind's graphs, when they are the padded forward's (host_verify.py).
        fallback = plain_decode if host_drafter and plain_decode is not None \
            and plain_decode.graphs is step_graphs.padded_forward else None
        kinds.append(GraphedVerify(step_graphs.padded_forward, step_graphs.draft_loop, verifier, block_size,
                                   max_model_len, sampler.noise, vocab_size, take_draft_probs,
                                   structured=structured, fallback_decode=fallback))
    # A drafter's general-path loop needs the host's accept counts: nothing is queued past it.
    queue_ahead = queue_ahead and (not has_drafter or step_graphs.draft_loop is not None or host_trees)
    return StepPipeline(queue_ahead, kinds)
