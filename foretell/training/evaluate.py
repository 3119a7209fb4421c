"""Teacher-forced acceptance: what the engine's greedy acceptance per position should be.

Along each row's TTT chain (ttt.py), draft position i is accepted when the head's argmax, mapped
to a target id, equals the target's greedy token at steps 0..i alike. On data the target wrote
greedily (--regenerate), the tokens fed along the chain are then exactly the draft tokens the
engine would have fed, so the fraction of rows accepted through position i is the engine's
accepted_per_position[i] / num_drafts, measured on every row of the responses instead of the rows
the engine happens to draft from. Rows count for position i when the target wrote the tokens at
positions 0..i (loss mask), so a chain running off the end of a sequence is not counted there.

The engine drafts only from some rows: after a draft from row t accepts a tokens, the next draft
comes from row t + a + 1. `engine_walk` replays exactly that walk over the teacher-forced matches
(first draft from the last prompt row, k drafts each), which is what the engine's online
accepted_per_position should equal on the same prompts, token for token, up to the chains that
run past the end of the data (those last drafts are not counted).

The head runs in `dtype` (the engine's: a copy of the head cast to it, no autocast).
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch

from foretell.training.ttt import ttt_forward


def mean_acceptance_length(acceptance: list[float], k: int) -> float:
    """1 + expected accepted drafts with k drafted tokens (the engine's mean_acceptance_length)."""
    return 1.0 + sum(acceptance[:k])


def engine_walk(match: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[int, list[int]]:
    """match [K, B, T] bool (K >= k), loss_mask [B, T], lengths [B] -> (number of drafts,
    drafts accepted through each position 0..k-1), drafting k tokens as the engine does."""
    match, loss_mask = match[:k].cpu(), loss_mask.cpu()
    drafts, accepted = 0, [0] * k
    for b in range(loss_mask.shape[0]):
        written = torch.nonzero(loss_mask[b] > 0)
        if written.numel() == 0:
            continue
        t, n = max(int(written[0]) - 1, 0), int(lengths[b])
        while t + k < n:  # the target's token at t + k (checked by draft k) is in the data
            run = 0
            while run < k and bool(match[run, b, t]):
                run += 1
            drafts += 1
            for i in range(run):
                accepted[i] += 1
            t += run + 1
    return drafts, accepted


@torch.no_grad()
def teacher_forced_acceptance(head, features, batches: Iterable, num_steps: int, dtype: torch.dtype,
                              walk_k: int = 3) -> dict:
    """Acceptance per position 0..num_steps-1 over all rows, the engine's walk with walk_k drafts
    (walk_k <= num_steps), and per-step loss / accuracy, over `batches`."""
    walk_k = min(walk_k, num_steps)
    walk_drafts, walk_accepted = 0, [0] * walk_k
    model = head if dtype == torch.float32 and head.fc.weight.dtype == torch.float32 else copy.deepcopy(head).to(dtype)
    accepted = torch.zeros(num_steps, dtype=torch.float64)
    rows = torch.zeros(num_steps, dtype=torch.float64)
    loss_sum = torch.zeros(num_steps, dtype=torch.float64)
    loss_n = torch.zeros(num_steps, dtype=torch.float64)
    correct = torch.zeros(num_steps, dtype=torch.float64)
    for batch in batches:
        f = features(batch)
        result = ttt_forward(model, f.aux.to(dtype), batch.input_ids, batch.loss_mask,
                             f.target_logits, f.target_argmax, num_steps)
        chain = torch.ones_like(batch.input_ids, dtype=torch.bool)
        counted = torch.ones_like(chain)
        for k, step in enumerate(result.steps):
            chain &= step.match
            counted &= step.valid
            accepted[k] += float((chain & counted).sum())
            rows[k] += float(counted.sum())
            loss_sum[k] += float(step.loss) * float(step.num_positions)
            loss_n[k] += float(step.num_positions)
            correct[k] += float(step.correct)
        drafts, acc = engine_walk(torch.stack([s.match for s in result.steps]), batch.loss_mask,
                                  batch.attention_mask.sum(-1), walk_k)
        walk_drafts += drafts
        walk_accepted = [a + b for a, b in zip(walk_accepted, acc)]
    acceptance = (accepted / rows.clamp(min=1)).tolist()
    return {
        "acceptance_per_position": acceptance,
        "rows_per_position": [int(r) for r in rows.tolist()],
        "mean_acceptance_length": {f"k={k}": mean_acceptance_length(acceptance, k) for k in range(1, num_steps + 1)},
        "engine_walk": {
            "num_speculative_tokens": walk_k,
            "num_drafts": walk_drafts,
            "accepted_per_position": walk_accepted,
            "acceptance_per_position": [a / max(walk_drafts, 1) for a in walk_accepted],
            "mean_acceptance_length": 1.0 + sum(walk_accepted) / max(walk_drafts, 1),
        },
        "step_loss": (loss_sum / loss_n.clamp(min=1)).tolist(),
        "step_accuracy": (correct / loss_n.clamp(min=1)).tolist(),
    }


def format_acceptance(metrics: dict) -> str:
    acc = metrics["acceptance_per_position"]
    lines = [
        "teacher-forced acceptance per position (greedy; fraction of rows with drafts 1..i all accepted)",
        "position   " + " ".join(f"{i + 1:>6d}" for i in range(len(acc))),
        "accepted   " + " ".join(f"{a:6.3f}" for a in acc),
        "rows       " + " ".join(f"{r:>6d}" for r in metrics["rows_per_position"]),
        "mean acceptance length: " + ", ".join(
            f"{k} {v:.2f}" for k, v in metrics["mean_acceptance_length"].items()),
    ]
    walk = metrics.get("engine_walk")
    if walk:
        lines.append(
            f"engine walk (k={walk['num_speculative_tokens']}, {walk['num_drafts']} drafts): "
            + " ".join(f"{a:.3f}" for a in walk["acceptance_per_position"])
            + f", mean acceptance length {walk['mean_acceptance_length']:.2f}")
    return "\n".join(lines)
