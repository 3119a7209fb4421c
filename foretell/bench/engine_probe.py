"""What benchmarks measure inside a running engine, as public functions of an `LLM`: the one place
that knows where the runner keeps its graphs, its step pipeline and its drafter, so that scripts
(scripts/bench_gpu.py) do not reach into runner attributes themselves and a change to the runner
breaks a tested function here rather than a GPU script found broken on the GPU.

  target_graph_replay_ms(llm, num_seqs, query_len)   one bare replay of a captured target forward
  draft_loop_replay_ms(llm, num_seqs)                 one replay of the captured draft loop
  draft_chain_step_ms(llm)                            one eager chain step of the drafter, batch 1
  queue_ahead_off(llm)                                a with-block running the synchronous engine
  engine_step_count(llm), warm_up_seconds(llm), max_model_len(llm), num_speculative_tokens(llm)
  active_weight_bytes(llm, ...)                       weights a batch-1 token reads (MoE: the chosen)
  vocab_size(llm), engine_device(llm)                 the target's logit rows, the engine's device
  grammar_mask_timer(llm)                             host time on grammar masks (counters that grow)
  grammar_forced_drafts(llm, on)                      a with-block with grammar-forced drafts on / off
  tree_graph_use(llm)                                 whether draft-tree steps ran on their graphs
  use_uncaptured_tree_graphs(llm)                     tree steps on their graphs' code path, uncaptured
  target_model(llm)                                   the target and its KV cache's sizes, for hand-built forwards
  propose_nothing(llm)                                a host drafter that drafts for nobody (its cost alone)
  parallel_graph_state(llm)                           graphs captured / steps queued ahead, any rank count

Every function but parallel_graph_state works on a single-process engine (tensor_parallel_size 1); the graph timers need
CUDA graphs (a CUDA device, enforce_eager off) and say so otherwise. Times are medians of CUDA
events (foretell.bench.kernels.timing.time_kernel).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from foretell.bench.kernels.timing import time_kernel


def _runner(llm) -> Any:
    from foretell.runner.model_runner import ModelRunner

    runner = llm.engine.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"engine probes need a single-process engine (tensor_parallel_size 1); this engine "
                         f"runs a {type(runner).__name__}")
    return runner


def _graphs(llm) -> Any:
    graphs = _runner(llm).graphs
    if graphs is None:
        raise ValueError("this engine captured no CUDA graphs: graph timings need device='cuda' and "
                         "enforce_eager=False")
    return graphs


def _event_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    return time_kernel(fn, device, warmup=warmup, iters=iters).median_us / 1e3


def target_graph_replay_ms(llm, num_seqs: int, query_len: int, context_len: int = 256, iters: int = 50,
                           warmup: int = 5) -> float:
    """Device time of one bare replay of the target graph for num_seqs sequences of query_len
    tokens over a context of context_len, its inputs prepared for that query length."""
    graphs = _graphs(llm)
    key = (num_seqs, query_len)
    if key not in graphs.graphs:
        raise ValueError(f"no target graph for (num_seqs, query_len) = {key}; captured: {sorted(graphs.graphs)}")
    graphs.prepare_replay(key, context_len)
    return _event_ms(graphs.graphs[key].graph.replay, _runner(llm).device, iters, warmup)


def draft_loop_replay_ms(llm, num_seqs: int = 1, iters: int = 50, warmup: int = 5) -> float:
    """Device time of one replay of the captured draft loop (catch-up + k - 1 chained steps, what
    a greedy verify step drafts with) for num_seqs sequences."""
    draft_graphs = _runner(llm).draft_graphs
    if draft_graphs is None or not draft_graphs.graphs:
        raise ValueError("this engine has no captured draft loop: it needs a drafter with a graphed loop "
                         "(eagle3, mtp, draft_model) on CUDA with enforce_eager=False")
    key = (num_seqs, draft_graphs.k + 1, draft_graphs.k)  # (bucket, q, m): a step verifying and drafting K
    if key not in draft_graphs.graphs:
        raise ValueError(f"no draft-loop graph for {num_seqs} sequences; captured: {sorted(draft_graphs.graphs)}")
    return _event_ms(draft_graphs.graphs[key].graph.replay, _runner(llm).device, iters, warmup)


def draft_chain_step_ms(llm, context_len: int = 100, iters: int = 50, warmup: int = 5) -> float:
    """Time of one eager chain step of an EAGLE3 head at batch 1 (one token after context_len),
    launch costs included."""
    from foretell.spec_decode.eagle3 import Eagle3Proposer
    from foretell.spec_decode.proposer import catch_up_metadata

    runner = _runner(llm)
    proposer = runner.proposer
    if not isinstance(proposer, Eagle3Proposer):
        raise ValueError("draft_chain_step_ms times an EAGLE3 head; this engine drafts with "
                         f"{type(proposer).__name__ if proposer is not None else 'no drafter'}")
    head = proposer.head
    device = runner.device
    table = torch.arange(8, dtype=torch.int32, device=device)[None]  # [1, 8] blocks
    meta = catch_up_metadata([context_len], [1], table, runner.cache_plan.block_size, proposer.draft_block_size)
    token = torch.tensor([5], device=device)
    position = torch.tensor([context_len], device=device)
    state = torch.randn(1, head.hidden_size, device=device, dtype=runner.dtype)  # [1, hidden]
    with torch.inference_mode():
        return _event_ms(lambda: proposer.chain_step(token, position, meta, state), device, iters, warmup)


@contextlib.contextmanager
def queue_ahead_off(llm) -> Iterator[None]:
    """Inside the block the engine launches nothing ahead: each step waits for its tokens before
    the host schedules the next (the synchronous engine, for before/after figures)."""
    pipeline = _runner(llm).pipeline
    saved = pipeline.queue_ahead, pipeline.kinds
    pipeline.queue_ahead, pipeline.kinds = False, []
    try:
        yield
    finally:
        pipeline.queue_ahead, pipeline.kinds = saved


@contextlib.contextmanager
def split_batches_off(llm) -> Iterator[None]:
    """Inside the block a batch of prompt chunks beside verifies runs whole on the host step (its
    verifies too) instead of split (runner/split_step.py): the before of split batches' figures."""
    runner = _runner(llm)
    saved, runner.padded_verify = runner.padded_verify, None
    try:
        yield
    finally:
        runner.padded_verify = saved


def split_step_count(llm) -> int:
    """Batches split so far: verifies on the padded step beside a host step's prompt chunks."""
    return int(_runner(llm).num_split_steps)


def engine_step_count(llm) -> int:
    """Engine steps run so far (prefill chunks, decode and verify steps)."""
    return int(llm.get_stats()["num_steps"])


def warm_up_seconds(llm) -> float:
    """Seconds the engine's start-up warm-up requests took (Triton compilations)."""
    return float(llm.engine.warm_up_seconds)


def max_model_len(llm) -> int:
    """The longest sequence (prompt + output tokens) the engine accepts."""
    return int(llm.engine.max_model_len)


def num_speculative_tokens(llm) -> int | None:
    """k of the engine's drafter, None without one."""
    spec = llm.engine.config.speculative
    return None if spec is None else spec.num_speculative_tokens


def active_weight_bytes(llm, num_routed_experts: int = 0, num_shared_experts: int = 0,
                        experts_per_token: int = 0) -> int:
    """Weight bytes one token reads at batch 1: every parameter but the embedding table (one row
    is read) and, in an MoE model, the routed experts it does not choose. The experts' parameters
    are the ones named `.experts.`, the shared experts packed after the routed ones."""
    if num_routed_experts and not 1 <= experts_per_token <= num_routed_experts:
        raise ValueError(f"experts_per_token must be in [1, num_routed_experts={num_routed_experts}], "
                         f"got {experts_per_token}")
    model = _runner(llm).model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    total -= embed.numel() * embed.element_size()
    if not num_routed_experts:
        return int(total)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    routed = experts * num_routed_experts / (num_routed_experts + num_shared_experts)
    unused = routed * (num_routed_experts - experts_per_token) / num_routed_experts
    return int(total - unused)


def vocab_size(llm) -> int:
    """The target's vocabulary size (the width of its logits)."""
    return int(_runner(llm).vocab_size)


def engine_device(llm) -> torch.device:
    """The device the engine runs its models on."""
    return _runner(llm).device


def grammar_mask_timer(llm) -> Any:
    """The engine's grammar-mask timer (structured/draft_mask.py MaskTimer): host seconds spent on
    grammar masks (seconds, and its parts verify_fill_seconds, verify_apply_seconds, draft_seconds,
    forced_seconds) and forced_drafts counted. Its counters only grow: read them before and after
    a piece of work."""
    return _runner(llm).host_step.structured.timer


@contextlib.contextmanager
def grammar_forced_drafts(llm, on: bool) -> Iterator[None]:
    """Inside the block the drafter's drafts for grammar requests take the grammar's forced tokens
    (on) or are only cut where the grammar rejects them (off), whatever speculative_config
    structured_forced_drafts said; the engine's setting comes back after the block."""
    structured = _runner(llm).host_step.structured
    saved = structured.forced_drafts
    structured.forced_drafts = bool(on)
    try:
        yield
    finally:
        structured.forced_drafts = saved


def tree_graph_use(llm) -> dict:
    """Whether draft-tree steps ran on their graphs: verify graphs captured and verifies run on
    them, draft graphs captured and expansions run on them, catch-up graphs (the catch-up and the
    expansion in one replay after a graphed verify) captured and catch-ups run on them."""
    step = _runner(llm).tree_step
    if step is None:
        raise ValueError("tree_graph_use needs an engine that drafts trees (speculative_config topk > 1)")
    verify, drafts = step.verify_graphs, step.drafter.graphs
    return {"verify_graphs_captured": 0 if verify is None or not verify.captures else len(verify.graphs),
            "graphed_verifies": step.num_graphed_verifies,
            "draft_graphs_captured": 0 if drafts is None else len(drafts.graphs),
            "graphed_drafts": 0 if drafts is None else drafts.num_runs,
            "catch_up_graphs_captured": 0 if drafts is None else len(drafts.after_verify_graphs),
            "graphed_catch_ups": 0 if drafts is None else drafts.num_caught_up}


def use_uncaptured_tree_graphs(llm) -> None:
    """From now on the engine's draft-tree steps run the code path of their CUDA graphs (fixed
    buffers, the draft graphs' expansion and catch-up) without capturing anything: what a GPU
    replays, timed or checked where graphs are not captured (the CPU, enforce_eager)."""
    from foretell.runner.tree_graphs import TreeVerifyGraphs

    runner = _runner(llm)
    step = runner.tree_step
    if step is None:
        raise ValueError("use_uncaptured_tree_graphs needs an engine that drafts trees (speculative_config topk > 1)")
    block_size = runner.cache_plan.block_size
    blocks = -(-(runner.max_model_len + runner.num_lookahead_tokens) // block_size) + 1
    step.use_graphs(TreeVerifyGraphs(runner.model, llm.engine.config.scheduler.max_num_seqs,
                                     step.shape.num_draft_tokens, blocks, block_size, runner.max_model_len,
                                     runner.device, capture_graphs=False, reads_host_lengths=True))


@dataclass(frozen=True)
class TargetModel:
    """An idle engine's target model with what a hand-built forward over its KV cache needs."""

    model: torch.nn.Module  # called as model(input_ids, positions, attn_metadata) -> (hidden, aux)
    device: torch.device
    dtype: torch.dtype
    block_size: int  # tokens a KV block holds
    num_blocks: int  # KV blocks in the cache
    vocab_size: int
    small_m_gemm_mode: str | None  # the few-row GEMMs' mode the engine bound (None: none bound)


def target_model(llm) -> TargetModel:
    """The engine's target for forwards a script builds itself (diagnoses, kernel-level timings):
    nothing of the engine may be running meanwhile, and the blocks it uses are the script's to hand
    out (the engine's prefix cache is overwritten)."""
    runner = _runner(llm)
    plan = runner.cache_plan
    gemm = runner.small_m_gemm
    return TargetModel(runner.model, runner.device, runner.dtype, plan.block_size, plan.num_blocks,
                       int(runner.vocab_size), None if gemm is None else gemm.mode)


def propose_nothing(llm) -> None:
    """From now on the engine's host drafter (n-gram, suffix) drafts for nobody at each step while
    the engine runs as a speculative one: a side-by-side's third engine, whose gap to plain decoding
    is the host-drafter engine's own cost and whose gap to the drafter is the drafter's."""
    proposer = _runner(llm).proposer
    if proposer is None or not proposer.capabilities.drafts_from_tokens:
        raise ValueError("propose_nothing needs a host drafter (method ngram or suffix); this engine drafts with "
                         f"{type(proposer).__name__ if proposer is not None else 'no drafter'}")
    proposer.propose_step = lambda items, results, make_batch: None  # this instance only


def parallel_graph_state(llm) -> dict:
    """Whether the engine captured CUDA graphs and queues steps ahead, and why not when not: a
    tensor-parallel engine's rank 0 answers (every rank decides alike), a single process its own."""
    return dict(llm.engine.runner.graph_state())  # ModelRunner's, or ParallelRunner's from rank 0
