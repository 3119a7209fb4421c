"""Verification's kernels compiled at start-up, before the first real step needs them.

The warm-up's dummy requests run the steps a drafter takes, but not every kernel a padded verify
step may launch: a host drafter (suffix, n-gram) drafts nothing there, and a verify queued ahead of
one of the same length need not happen in it. compile_verification runs those kernels once, on the
step's own buffers or scratch ones, reading nothing back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from foretell.ops.step.dispatch import accept_drafts, advance_verify_inputs
from foretell.ops.step.verify_to_decode import verify_to_decode_inputs

if TYPE_CHECKING:
    from foretell.runner.graphed_verify import GraphedVerify


def compile_verification(kind: "GraphedVerify") -> None:
    """Greedy verification once per verify length of the captured graphs, on their own buffers
    (one sequence, with and without caps), so that its kernels (one per draft count) compile at
    start-up: a host drafter (suffix, n-gram) drafts nothing in the warm-up's dummy requests and
    compiled them in its first real drafting steps. Nothing is read back; the next step
    overwrites what this writes. A drawn verifier (simulated acceptance) runs other kernels.
    Then, for any verifier, the advance of a verify's inputs to the next one's
    (advance_verify_inputs, one kernel per verify length) on scratch buffers: it runs when a
    verify is queued ahead of the same length's, which the warm-up need not show (under
    adaptive speculation the H200 compiled it for 3 and 4 rows in serving), and for a host drafter
    the turn of a verify's inputs into the plain step's after it (verify_to_decode_inputs)."""
    if not kind.graphs.captures:
        return
    loop, device = kind.draft_graphs, kind.graphs.device
    lengths = sorted({q for _, q in kind.graphs.graphs if q > 1})
    if not kind.verifier.synthetic:
        caps = torch.zeros(1, dtype=torch.int64, device=device)  # [1]
        for q in lengths:
            key = min(k for k in kind.graphs.graphs if k[1] == q)
            greedy = kind.graphs.graphs[key].greedy[:q].view(1, q)
            drafts_in = kind.graphs.input_ids[:q].view(1, q)[:, 1:]
            for step_caps in (None, caps):
                accept_drafts(greedy, drafts_in, step_caps, loop.accepted, loop.next_token, loop.num_live)
    one = torch.zeros(1, dtype=torch.int64, device=device)  # [1]: accepted, next token
    for q in lengths:  # each buffer its own allocation: aligned as the graph's are (Triton specializes on it)
        ids, positions, slots = (torch.zeros(q, dtype=torch.int64, device=device) for _ in range(3))
        # [1, W]: the rows advance to positions 1..q, all inside the table
        table = torch.zeros(1, q // kind.graphs.block_size + 1, dtype=torch.int32, device=device)
        advance_verify_inputs(ids, positions, slots, torch.zeros(1, dtype=torch.int32, device=device), table,
                              one, one, torch.zeros(1, q - 1, dtype=torch.int64, device=device),
                              kind.graphs.block_size)
    if kind.fallback_decode is not None:  # the plain step queued after a host-verified one (host_verify.py)
        ids, positions, slots = (torch.zeros(2, dtype=torch.int64, device=device) for _ in range(3))
        seq_lens, starts = (torch.ones(2, dtype=torch.int32, device=device) for _ in range(2))
        table = torch.zeros(1, 2, dtype=torch.int32, device=device)  # [1, 2]: position 1 inside it
        verify_to_decode_inputs(ids, positions, slots, seq_lens, starts, table, one, one, 1, 1, 1,
                                kind.graphs.block_size)
