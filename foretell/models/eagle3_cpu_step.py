"""The EAGLE3 head's draft step on the CPU as one function of direct torch calls (issue 32: the
default family's draft loop on a laptop-class CPU).

Eagle3Head.step walks ten module calls a step (the layer, its attention, q|k|v, o, the norms, the
MLP and its two projections, the LM head), each with the checks that pick a CUDA kernel or a
few-row GEMM form; on the CPU at batch 1 that walk costs about as much as the arithmetic of the
small ops it leads to. eagle3_cpu_step runs the same torch ops in the same order on the same
tensors (the layer's input from its table of normed embedding rows, attend_qkv's block, each
projection's packed GEMM from layers/cpu_draft_weights.py, torch.rms_norm as rms_norm_torch runs
it in float32), so its logits, h and draft cache equal Eagle3Head.step's bit for bit
(tests/models/test_eagle3_cpu_step.py).

cpu_step_fits(head) says where it applies: a single-rank Eagle3Head (a Llama layer) whose six
projections (fc, q|k|v, o, gate_up, down, its own LM head) are bound to PackedDraftGemm without
biases, whose layer has its normed-embedding table, and whose attention takes attend_qkv's CPU
block. Anything else (CUDA, a shared LM head, greedy_only tokens, other dtypes) runs
Eagle3Head.step.
"""

from __future__ import annotations

import torch

from foretell.layers.attention.qkv_block import attend_qkv
from foretell.layers.cpu_draft_weights import PackedDraftGemm
from foretell.models.base import side_by_side
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.pointwise.reference import silu_and_mul_torch


def _projections(head) -> list:
    layer = head.midlayer
    return [head.fc, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj, head.lm_head]


def cpu_step_fits(head) -> bool:
    """Whether eagle3_cpu_step serves this head (the module docstring lists what it needs)."""
    from foretell.models.eagle3 import Eagle3Head

    if type(head) is not Eagle3Head or head.tensor_parallel.is_parallel or head.lm_head is None:
        return False
    layer = head.midlayer
    table = layer.normed_embedding
    if table is None or table[0] is not (head.embed_tokens or head.shared_embed):
        return False
    return all(isinstance(p.small_m, PackedDraftGemm) and getattr(p, "bias", None) is None
               for p in _projections(head))


def eagle3_cpu_step(
    head,  # an Eagle3Head that cpu_step_fits
    input_ids: torch.Tensor,  # [n] target token ids
    positions: torch.Tensor,  # [n]
    metadata: AttentionMetadata,
    keep_rows: torch.Tensor | None = None,  # [m] int64: the rows to draft from; None: all
    g: torch.Tensor | None = None,  # [n, H]: the previous step's h (a chain step), or None: from aux
    aux: list[torch.Tensor] | None = None,  # 3 x [n, Ht]: the target's aux hidden states (a first step)
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [m, draft_vocab] float32, h [m, H])
    """Eagle3Head.step(input_ids, positions, g or combine(aux), metadata, keep_rows) in direct calls."""
    layer = head.midlayer
    attention = layer.self_attn
    mlp = layer.mlp
    if g is None:
        fc = head.fc
        g = fc.small_m(side_by_side(aux), fc.weight)  # [n, H]
    hidden_size = g.shape[-1]
    norm = layer.hidden_norm
    normed_g = torch.rms_norm(g, (hidden_size,), norm.weight, norm.eps)  # [n, H]
    x = torch.cat([torch.nn.functional.embedding(input_ids, layer.normed_embedding[1]), normed_g], dim=-1)  # [n, 2H]
    residual = normed_g if layer.norm_before_residual else g
    qkv = attention.qkv_proj.small_m(x, attention.qkv_proj.weight)  # [n, (heads + 2 kv) * D]
    attended = attend_qkv(attention.attn, qkv, positions, attention.rotary_emb, metadata)  # [n, heads * D]
    attn = attention.o_proj.small_m(attended, attention.o_proj.weight)  # [n, H]
    if keep_rows is not None:
        attn, residual = attn.index_select(0, keep_rows), residual.index_select(0, keep_rows)  # [m, H]
    h_attn = residual + attn
    norm = layer.post_attention_layernorm
    normed_h = torch.rms_norm(h_attn, (hidden_size,), norm.weight, norm.eps)
    gate_up = mlp.gate_up_proj.small_m(normed_h, mlp.gate_up_proj.weight)  # [m, 2 * intermediate]
    mlp_out = mlp.down_proj.small_m(silu_and_mul_torch(gate_up), mlp.down_proj.weight)  # [m, H]
    h = h_attn + mlp_out
    norm = head.norm
    normed = torch.rms_norm(h, (hidden_size,), norm.weight, norm.eps)
    return head.lm_head.small_m(normed, head.lm_head.weight), h  # [m, draft_vocab] float32, [m, H]
