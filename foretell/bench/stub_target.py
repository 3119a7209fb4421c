"""The target's forward stubbed out, for probes of the host's work per step (host_overhead.py's
--stub-forward): _StubTarget's forward and LM head do no arithmetic, and stubbed_target() gives a
runner without graphs (the CPU) the GPU's device-step path over uncaptured graph buffers: plain
decode steps queued ahead, and for a host drafter (n-gram, suffix) the pipeline
graph_setup.build_step_pipeline builds for it on a GPU (the padded verify step with
HostDraftSlots, steps queued ahead). So the host path a GPU step takes runs on the CPU, minus the
CUDA calls themselves (events, streams, kernel launches, replays). Tokens mean nothing.

Everything is set on instances for the block and put back afterwards; no class or module is patched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_ABSENT = object()

STUB_TOKENS = ("constant", "fresh")


class _StubTarget:
    """The target's forward and LM head at no arithmetic: hidden (and aux) states that carry only
    each row's position and input token, logits that pick one token per row (the probe's host
    path runs; the tokens mean nothing). stub_tokens "constant": always `token` (a host drafter
    soon drafts it and every draft is accepted: the repetitive extreme); "fresh": a token hashed
    from the row's position, its input token, the forward's count and `seed` (no text repeats, not
    even across requests or stubs of other seeds: a host drafter finds no match, GSM8K's path at
    its worst)."""

    def __init__(self, hidden_size: int, num_aux: int, vocab_size: int, token: int, stub_tokens: str = "constant",
                 seed: int = 0):
        if stub_tokens not in STUB_TOKENS:
            raise ValueError(f"stub_tokens must be one of {STUB_TOKENS}, got {stub_tokens!r}")
        if hidden_size < 3:
            raise ValueError(f"the stub keeps position, token and salt in the hidden state: hidden_size >= 3, "
                             f"got {hidden_size}")
        self.hidden_size, self.num_aux, self.vocab_size, self.token = hidden_size, num_aux, vocab_size, token
        self.fresh = stub_tokens == "fresh"
        self.seed = seed
        self.num_forwards = 0  # with seed, salts the fresh tokens

    def forward(self, input_ids, positions, attn_metadata):
        rows = input_ids.shape[0]
        hidden = torch.zeros(rows, self.hidden_size, device=input_ids.device)  # [rows, hidden]
        if self.fresh:
            self.num_forwards += 1
            hidden[:, 0] = positions
            hidden[:, 1] = input_ids
            hidden[:, 2] = (self.seed * 7919 + self.num_forwards) % (1 << 20)  # exact in float32
        return hidden, [hidden] * self.num_aux

    def compute_greedy_tokens(self, hidden):
        if not self.fresh:
            return torch.full((hidden.shape[0],), self.token, dtype=torch.int64, device=hidden.device)  # [rows]
        pos, prev, salt = hidden[:, 0].long(), hidden[:, 1].long(), hidden[:, 2].long()  # [rows] each
        return (pos * 2654435761 + prev * 40503 + salt * 97787 + 12345) % 2147483647 % self.vocab_size  # [rows]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab_size, device=hidden.device)  # [rows, vocab]
        logits.scatter_(1, self.compute_greedy_tokens(hidden)[:, None], 1.0)
        return logits


def _host_drafter_pipeline(runner, max_num_seqs: int):
    """For a host drafter (n-gram, suffix) on a runner without graphs (the CPU): the step pipeline
    the GPU builds for it (graph_setup.build_step_pipeline, steps queued ahead) over uncaptured
    graph buffers, and those buffers; None for any other runner."""
    from foretell.runner.cuda_graph import CudaGraphRunner
    from foretell.runner.graph_setup import StepGraphs, build_step_pipeline
    from foretell.runner.host_drafts import HostDraftSlots, host_draft_verify_lens

    proposer = runner.proposer
    if (proposer is None or runner.graphs is not None or proposer.padded_drafter() is not None
            or not proposer.capabilities.drafts_from_tokens):
        return None
    k = runner.config.speculative.num_speculative_tokens
    block_size = runner.cache_plan.block_size
    graphs = CudaGraphRunner(runner.model, max_num_seqs, host_draft_verify_lens(k),
                             -(-(runner.max_model_len + runner.num_lookahead_tokens) // block_size) + 1,
                             block_size, runner.max_model_len, runner.device, capture_graphs=False)
    step_graphs = StepGraphs(graphs, graphs, HostDraftSlots(graphs, k), None)
    pipeline = build_step_pipeline(
        step_graphs, queue_ahead=True, has_drafter=True, target_forward=runner.target_forward,
        sampler=runner.host_step.sampler, verifier=runner.verifier, take_draft_probs=runner.host_step.take_draft_probs,
        vocab_size=runner.vocab_size, block_size=block_size, max_model_len=runner.max_model_len)
    return pipeline, graphs


@contextlib.contextmanager
def stubbed_target(llm, stub_tokens: str = "constant", seed: int = 0) -> Iterator[None]:
    """The target's forward replaced by _StubTarget for the block, and plain decode steps (and a
    host drafter's verify steps) on the graph buffers where the runner has none (the CPU);
    everything is put back afterwards."""
    from foretell.runner.cuda_graph import CudaGraphRunner
    from foretell.runner.decode_ahead import DecodeAhead

    runner = llm.engine.runner
    scheduler = llm.engine.scheduler
    model = runner.model
    config = runner.hf_config.language_model()
    stub = _StubTarget(config.hidden_size, len(getattr(model, "aux_hidden_state_layers", None) or ()),
                       runner.vocab_size, token=min(1000, runner.vocab_size - 1), stub_tokens=stub_tokens,
                       seed=seed)
    names = ("forward", "compute_logits", "compute_greedy_tokens")
    saved = [(name, vars(model).get(name, _ABSENT)) for name in names]
    kinds = [kind for kind in runner.pipeline.kinds if isinstance(kind, DecodeAhead) and kind.graphs is None]
    saved_graphs, saved_pipeline, saved_keep = runner.graphs, runner.pipeline, scheduler.keep_draft_rows
    max_num_seqs = llm.engine.config.scheduler.max_num_seqs
    host_drafter = _host_drafter_pipeline(runner, max_num_seqs)
    for name in names:
        setattr(model, name, getattr(stub, name))
    if kinds:
        block_size = runner.cache_plan.block_size
        # reads_host_lengths off: the stub reads no lengths (a real torch-backend forward would)
        graphs = CudaGraphRunner(model, max_num_seqs, (1,),
                                 -(-(runner.max_model_len + runner.num_lookahead_tokens) // block_size) + 1,
                                 block_size, runner.max_model_len, runner.device, capture_graphs=False)
        for kind in kinds:
            kind.graphs = graphs
        runner.graphs = graphs
    if host_drafter is not None:
        runner.pipeline, runner.graphs = host_drafter
        scheduler.keep_draft_rows = True  # as describe() says for a runner with a padded forward
    try:
        yield
    finally:
        for name, before in saved:
            if before is _ABSENT:
                delattr(model, name)
            else:
                setattr(model, name, before)
        for kind in kinds:
            kind.graphs = None
        runner.graphs, runner.pipeline, scheduler.keep_draft_rows = saved_graphs, saved_pipeline, saved_keep
        runner.pipeline.drop()  # a queued step of the stub's
