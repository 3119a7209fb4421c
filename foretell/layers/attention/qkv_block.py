"""A decoder layer's attention block on the torch path, from its fused q|k|v projection, in few torch calls.

What the CPU runs for the Llama family and the EAGLE3 head (issue 32: on a CPU a small model's
decode step is mostly per-call overhead, not arithmetic). The same arithmetic as the modules one
after the other (Attention.forward_rotary: q_norm / k_norm, RoPE, the KV write, attention), bit for
bit, with fewer calls:
  - the projection's output [T, (H + 2 KV) * D] is viewed as heads, and Qwen3's q/k norms and RoPE
    run once over the query and key heads side by side (they sit side by side in it already);
  - the rotated query and key heads are written back into the projection's output (no new
    tensors for q, k and v);
  - a one-sequence step (decode, verify) reads its keys and values as strided views of one gather
    of its blocks (attend_one_sequence);
  - the keys and values go into the cache in one index_copy_ (they sit side by side in the
    projection's output as they do in the cache's [2, ...] layout);
  - what every layer shares (ForwardRows: the RoPE table's rows, the context's blocks, a verify's
    causal mask) can be gathered once per forward by the caller.
Anything else (a CUDA tensor, another attention backend, an FP8 cache, a partial or GPT-J
rotation) takes the module path, Attention.forward_rotary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.layers.attention.layer import Attention
from foretell.layers.norm import RMSNorm, rms_norm_torch
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention import reference as attention_reference
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend

RopeRows = tuple[torch.Tensor, torch.Tensor]  # (cos, cos), (-sin, sin): [T, 1, 2, D // 2] each


def paired_rope_rows(rotary_emb: RotaryEmbedding, positions: torch.Tensor, head_dim: int,
                     dtype: torch.dtype) -> RopeRows | None:
    """The RoPE table rows of `positions` for the block below (one gather), or None when the
    rotation is not NeoX over whole heads (the block then rotates through the module)."""
    if rotary_emb.style != "neox" or rotary_emb.rotary_dim != head_dim:
        return None
    pair = rotary_emb.neox_pair_cache[positions]  # [T, 2, 1, 2, D // 2] float32
    if pair.dtype != dtype:
        pair = pair.to(dtype)  # as apply_rope_neox rounds cos and sin to x's dtype
    return pair.unbind(1)


def causal_hidden(num_tokens: int, seq_len: int, device: torch.device) -> torch.Tensor:  # [T, S] bool
    """The keys each of a sequence's last num_tokens rows must not see: row j sits at position
    seq_len - T + j and sees keys 0..that position (True: hidden)."""
    return torch.ones(num_tokens, seq_len, dtype=torch.bool, device=device).triu_(seq_len - num_tokens + 1)


@dataclass(frozen=True)
class ForwardRows:
    """What the attention blocks of one forward share on the torch path, gathered once for all its
    layers: the RoPE table rows of its positions (None: not NeoX over whole heads) and, for a step
    of one sequence (a decode or a verify), the cache blocks holding that sequence's context and,
    with several rows (a verify), the keys each row must not see."""

    rope: RopeRows | None
    context_blocks: torch.Tensor | None  # [num_blocks] int32, or None: several sequences (or a tree)
    hidden_keys: torch.Tensor | None = None  # [T, seq_len] bool (causal_hidden), or None: one row / no blocks

    @classmethod
    def gather(cls, rotary_emb: RotaryEmbedding, positions: torch.Tensor, metadata: AttentionMetadata,
               head_dim: int, dtype: torch.dtype) -> "ForwardRows":
        blocks = hidden = None
        if len(metadata.query_start_loc_cpu) == 2 and metadata.tree_mask is None:
            seq_len = metadata.seq_lens_cpu[0]
            blocks = metadata.block_table[0, : -(-seq_len // metadata.block_size)]
            if positions.shape[0] > 1:
                hidden = causal_hidden(positions.shape[0], seq_len, positions.device)
        return cls(paired_rope_rows(rotary_emb, positions, head_dim, dtype), blocks, hidden)


def fits_torch_block(attn: Attention, qkv: torch.Tensor) -> bool:
    """Whether attend_qkv runs its few-call form here: a CPU tensor outside autograd (it writes RoPE
    in place), the torch backend, a cache in the projection's dtype."""
    cache = attn.kv_cache
    return (not qkv.is_cuda and not qkv.requires_grad and type(attn.backend) is TorchAttentionBackend
            and cache is not None and cache.dtype == qkv.dtype)


def attend_qkv(
    attn: Attention,
    qkv: torch.Tensor,  # [T, (H + 2 KV) * D]: the fused projection's output (overwritten: RoPE in place)
    positions: torch.Tensor,  # [T]
    rotary_emb: RotaryEmbedding,
    metadata: AttentionMetadata,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,  # Qwen3's (q_norm, k_norm), per head, before RoPE
    shared: ForwardRows | None = None,  # gathered once for every layer of the forward, when the caller did
) -> torch.Tensor:  # [T, H * D]
    """The attention block's output before o_proj: (q/k norm,) RoPE, the KV write and attention."""
    num_tokens = qkv.shape[0]
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    few_calls = fits_torch_block(attn, qkv) and (qk_norm is None or (
        qk_norm[0].eps == qk_norm[1].eps and all(n.weight.dtype == qkv.dtype for n in qk_norm)))
    rope = shared.rope if shared is not None else None
    if few_calls and shared is None:
        rope = paired_rope_rows(rotary_emb, positions, head_dim, qkv.dtype)
    if not few_calls or rope is None:
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        out = attn.forward_rotary(
            positions, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim), rotary_emb, metadata, qk_norm,
        )
        return out.reshape(num_tokens, num_heads * head_dim)
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]  # [T, H + KV, D], the query heads then the key heads
    if qk_norm is None:
        normed = qk
    elif qk.dtype == torch.float32:  # rms_norm_torch's float32 form: weight * torch.rms_norm(x), per head
        q_norm, k_norm = qk_norm
        normed = torch.rms_norm(qk, (head_dim,), None, q_norm.eps)  # [T, H + KV, D]
        normed[:, :num_heads].mul_(q_norm.weight)
        normed[:, num_heads:].mul_(k_norm.weight)
    else:  # half types: normalise in float32, cast, then scale (rms_norm_torch)
        q_norm, k_norm = qk_norm
        weight = torch.cat((q_norm.weight.expand(num_heads, -1), k_norm.weight.expand(num_kv_heads, -1)))
        normed = rms_norm_torch(qk, weight, q_norm.eps)
    # RoPE (apply_rope_neox_paired) written back over the query and key heads of qkv
    cos_pair, sin_pair = rope
    halves = normed.reshape(num_tokens, num_heads + num_kv_heads, 2, head_dim // 2)  # (x1, x2)
    rotated = qk.view(num_tokens, num_heads + num_kv_heads, 2, head_dim // 2)
    torch.add(halves * cos_pair, halves.flip(2) * sin_pair, out=rotated)
    cache = attn.kv_cache
    if cache.is_contiguous():  # write_kv_torch's two copies in one
        key_value = heads[:, num_heads:].view(num_tokens, 2, num_kv_heads, head_dim)  # [T, 2, KV, D]
        attention_reference.write_kv_pair_torch(key_value, cache, metadata.slot_mapping)
    else:
        key, value = heads[:, num_heads : num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads :]
        attn.backend.write_kv(key, value, cache, metadata.slot_mapping)
    query = heads[:, :num_heads]  # [T, H, D]
    if metadata.tree_mask is not None:
        out = attn.backend.attend(query, cache, metadata, attn.scale, tree_mask=metadata.tree_mask)
    elif len(metadata.query_start_loc_cpu) == 2 and query.dtype == torch.float32:
        seq_len = metadata.seq_lens_cpu[0]
        blocks = hidden = None
        if shared is not None:
            blocks, hidden = shared.context_blocks, shared.hidden_keys
        if blocks is None:
            blocks = metadata.block_table[0, : -(-seq_len // metadata.block_size)]
        return attend_one_sequence(query, cache, blocks, seq_len, attn.scale, hidden)
    else:
        out = attn.backend.attend(query, cache, metadata, attn.scale)
    return out.reshape(num_tokens, num_heads * head_dim)


def attend_one_sequence(
    query: torch.Tensor,  # [T, H, D] float32: the last T positions of the context
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D] float32
    context_blocks: torch.Tensor,  # [num_blocks] int32: the blocks holding the context, in order
    seq_len: int,
    scale: float,
    hidden_keys: torch.Tensor | None = None,  # [T, seq_len] bool: causal_hidden(T, seq_len), when the caller has it
) -> torch.Tensor:  # [T, H * D]
    """TorchAttentionBackend.attend for one sequence (reference.py's gather_kv and causal_attention),
    bit for bit, in fewer calls: the keys and values are read as strided views of the one gather,
    already in the layouts the two batched matmuls take, and no float32 casts are asked of
    float32 tensors."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    num_blocks = context_blocks.shape[0]
    if num_blocks * block_size < seq_len:
        raise ValueError(f"{num_blocks} blocks of {block_size} cannot hold a context of {seq_len} tokens")
    blocks = kv_cache.index_select(1, context_blocks)  # [2, num_blocks, block_size, KV, D]
    row = num_kv_heads * head_dim  # one position's keys (or values)
    key = blocks.as_strided((num_kv_heads, head_dim, seq_len), (head_dim, 1, row))  # [KV, D, S]
    value = blocks.as_strided((num_kv_heads, seq_len, head_dim), (head_dim, row, 1),
                              num_blocks * block_size * row)  # [KV, S, D]
    if num_tokens == 1:  # [H, D] is already [KV, group, D]
        q = query.reshape(num_kv_heads, group, head_dim)
    else:  # [KV, group * T, D]
        q = query.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
            num_kv_heads, group * num_tokens, head_dim)
    scores = torch.bmm(q, key).mul_(scale)  # [KV, group * T, S]
    if num_tokens > 1:  # row j sits at position seq_len - T + j and sees keys 0..that position
        hidden = causal_hidden(num_tokens, seq_len, query.device) if hidden_keys is None else hidden_keys
        scores = scores.view(num_kv_heads, group, num_tokens, seq_len).masked_fill_(hidden, float("-inf"))
        scores = scores.view(num_kv_heads, group * num_tokens, seq_len)
    out = torch.bmm(torch.softmax(scores, dim=-1), value)  # [KV, group * T, D]
    if num_tokens == 1:
        return out.view(1, num_heads * head_dim)
    return out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(
        num_tokens, num_heads * head_dim)
