"""Training-time test (EAGLE-3): unroll the head for k steps the way the engine chains it.

Row t of a sequence x_0..x_{T-1} pairs the target's features at t with token x_{t+1}.
  step 0:  g = fc(aux_t), token x_{t+1}, RoPE position t      -> predicts x_{t+2}
  step k:  g = the head's step k-1 output at row t (pre-norm), token x_{t+1+k}, position t+k
           -> predicts x_{t+2+k}; target distribution: the target's at position t+1+k
Attention at step k: query t sees the step-0 keys at rows <= t (the causal prefix the engine's
catch-up wrote into the draft cache) and the step-1..k keys of row t only (its own chain: the
draft tokens the engine wrote at positions t+1..t+k). That is ttt_attention_mask.

Loss at step k: soft cross-entropy of the draft distribution against softmax(target logits
restricted to the draft vocabulary), over positions whose token the target writes (loss mask)
and whose target argmax is in the draft vocabulary; total = sum_k 0.8^k loss_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_WEIGHT = 0.8


def ttt_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """[T, (step + 1) * T] bool, True = may attend. Keys are laid out step by step (step 0's T
    keys, then step 1's, ...); query j sees step-0 keys i <= j and key j of every later step."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros back to x's length along dim 1 (row t gets row t + n)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar: mean soft CE over the step's loss positions
    num_positions: torch.Tensor  # scalar: how many positions the loss averaged over
    correct: torch.Tensor  # scalar: positions where draft argmax == target argmax (in the mask)
    match: torch.Tensor  # [B, T] bool: draft argmax (as a target id) == target's full argmax
    valid: torch.Tensor  # [B, T] bool: the target writes the predicted position's token


@dataclass
class TTTResult:
    loss: torch.Tensor  # sum_k 0.8^k loss_k
    steps: list[StepResult]


def ttt_forward(head, aux, input_ids, loss_mask, target_logits, target_argmax, num_steps: int) -> TTTResult:
    """aux [B, T, 3 Ht]; input_ids [B, T]; loss_mask [B, T] float; target_logits [B, T, Vd]
    float32 (draft vocabulary); target_argmax [B, T] (full vocabulary)."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    target_p = torch.softmax(target_logits, dim=-1)  # [B, T, Vd]
    in_draft = head.t2d[target_argmax].to(loss_mask.dtype)  # [B, T]
    position_mask = loss_mask * in_draft
    draft_to_target = head.target_ids()  # [Vd]
    g = head.combine(aux)  # [B, T, H]
    cache: list = []
    steps, total = [], 0.0
    for k in range(num_steps):
        h = head.step(shift_left(input_ids, 1 + k), positions + k, g, cache)  # [B, T, H]
        logits = head.compute_logits(h)  # [B, T, Vd] float32
        p_k = shift_left(target_p, 1 + k)
        m_k = shift_left(position_mask, 1 + k)
        ce = -(p_k * torch.log_softmax(logits, dim=-1)).sum(-1)  # [B, T]
        n = m_k.sum()
        loss = (ce * m_k).sum() / n.clamp(min=1)
        draft_argmax = logits.argmax(-1)  # [B, T] draft ids
        match = draft_to_target[draft_argmax] == shift_left(target_argmax, 1 + k)
        correct = (match.to(m_k.dtype) * m_k).sum()
        steps.append(StepResult(loss, n, correct, match, shift_left(loss_mask, 1 + k) > 0))
        total = total + STEP_WEIGHT**k * loss
        g = h
    return TTTResult(total, steps)
