"""The CPU fast path through torch.compile (`cpu_compile`, `--cpu-compile`; issue 32's CPU bars).

On a CPU a small model's decode step is mostly per-op dispatch (the default target's decode forward
is over a thousand small aten ops: docs/perf-log.md), not arithmetic. Here a Llama-family decoder's
forward for one sequence's few rows (a decode row, a verify's 1 + k rows) is written as one function
of tensors and compiled by Inductor's C++ CPU backend: the norms, q/k norms, RoPE, residual adds,
softmax and SiLU fuse into a few C++ loops around the matmuls (MKL calls still), and the KV write
and the paged read happen in the same graph.

Shapes: one compiled graph per row count the runner asks for (a decode's 1, a verify's 1 + k; the
input ids are marked static), the context length dynamic (`context_index` is marked dynamic), so
a growing context never recompiles. Anything else (several sequences, a prefill chunk of another
length, a tree mask, a context shorter than 2, another attention backend or an FP8 cache,
autograd) runs the model's eager forward_torch.

Arithmetic: the same operations as DecoderModel.forward_torch (torch.rms_norm, the few-row
`W x^T` form for 2-8 rows, the batched-matmul attention); Inductor's fused reductions (the norms,
the softmax) may order their sums differently, so a compiled forward's logits may differ from the
eager ones in the last bits. What speculation needs, the same tokens with and without drafts,
holds as it does eagerly (tests/runner/test_cpu_compile.py).

An EAGLE3 drafter's head step is compiled the same way, next door (cpu_compile_head.py, installed
from install_cpu_compile), sharing `attend` and `linear`.

It applies to the CPU only: on CUDA the step runs in CUDA graphs and the flag is refused
(CpuCompileConfig's check in config.py names it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from foretell.layers.cpu_few_rows import MAX_ROWS as FEW_ROWS_MAX
from foretell.layers.cpu_few_rows import is_transposed
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.runner.cpu_compile_direct import DirectCompiled

logger = logging.getLogger("foretell")

MAX_COMPILED_ROWS = 8  # a verify of up to 7 drafts (a row count more is one graph more to compile)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, out]
    """Linear.matmul's CPU forms: F.linear for one row, W x^T for 2-8 rows (cpu_few_rows.py: MKL
    streams the weight once that way), F.linear for a weight stored transposed (cpu_weight_layout.py)."""
    if 2 <= x.shape[0] <= FEW_ROWS_MAX and not is_transposed(weight):
        out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
        return out.t()
    return F.linear(x, weight, bias)


def decoder_forward(
    model,  # DecoderModel (models/llama.py): its parameters and attention layers' caches are read
    input_ids: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64: the last T positions of the context
    slot_mapping: torch.Tensor,  # [T] int64: the cache slots the T new tokens' keys and values go to
    block_row: torch.Tensor,  # [W] int32: the sequence's block table row
    context_index: torch.Tensor,  # [S] int64: 0 .. S - 1 over the context's S tokens (dynamic)
    block_size: int,
    aux_layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden [T, hidden] after the final norm, streams [T, aux, hidden])
    """DecoderModel.forward_torch for one sequence's T rows, as one traceable function."""
    dims = model.dims
    context_slots = slots_of(block_row, context_index, block_size)  # [S] int64
    num_tokens = input_ids.shape[0]
    pair = model.rotary_emb.neox_pair_cache[positions]  # [T, 2, 1, 2, D // 2] float32
    cos_pair, sin_pair = pair[:, 0], pair[:, 1]  # [T, 1, 2, D // 2] each
    hidden = F.embedding(input_ids, model.embed_tokens.weight)  # [T, hidden]
    seq_len = context_slots.shape[0]
    hidden_keys = None
    if num_tokens > 1:  # row j (position p_j) sees the keys at positions 0..p_j
        hidden_keys = torch.arange(seq_len, device=positions.device)[None, :] > positions[:, None]  # [T, S]
    residual = None
    streams = {}
    for i, layer in enumerate(model.layers):
        residual = hidden if residual is None else residual + hidden
        if i in aux_layers:
            streams[i] = residual
        attn_block = layer.self_attn
        normed = torch.rms_norm(residual, (dims.hidden_size,), layer.input_layernorm.weight,
                                layer.input_layernorm.eps)
        qkv = linear(normed, attn_block.qkv_proj.weight, attn_block.qkv_proj.bias)
        qk_norm = None if attn_block.q_norm is None else (attn_block.q_norm, attn_block.k_norm)
        out = attend(attn_block.attn, qk_norm, qkv, cos_pair, sin_pair, slot_mapping, context_slots, hidden_keys)
        residual = residual + linear(out, attn_block.o_proj.weight, attn_block.o_proj.bias)
        norm = layer.post_attention_layernorm
        normed = torch.rms_norm(residual, (dims.hidden_size,), norm.weight, norm.eps)
        mlp = layer.mlp
        gate_up = linear(normed, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)  # [T, 2 * I]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    final = torch.rms_norm(residual + hidden, (dims.hidden_size,), model.norm.weight, model.norm.eps)
    if not aux_layers:
        return final, final.new_empty(num_tokens, 0, dims.hidden_size)
    return final, torch.stack([streams[i] for i in aux_layers], dim=1)


def attend(
    attn,  # Attention (layers/attention/layer.py): its heads, scale and KV cache
    qk_norm,  # (q_norm, k_norm) RMSNorms (Qwen3: per head, before RoPE), or None
    qkv: torch.Tensor,  # [T, (H + 2 KV) * D]
    cos_pair: torch.Tensor,  # [T, 1, 2, D // 2]
    sin_pair: torch.Tensor,  # [T, 1, 2, D // 2]
    slot_mapping: torch.Tensor,  # [T] int64
    context_slots: torch.Tensor,  # [S] int64
    hidden_keys: torch.Tensor | None,  # [T, S] bool, True: masked; None: one row
) -> torch.Tensor:  # [T, H * D]
    """attend_qkv's few-call form (qkv_block.py): q/k norm, RoPE, the KV write, one sequence's attention."""
    num_tokens = qkv.shape[0]
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]  # [T, H + KV, D]
    if qk_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
        q_norm, k_norm = qk_norm
        normed = torch.rms_norm(qk, (head_dim,), None, q_norm.eps)
        weight = torch.cat((q_norm.weight.expand(num_heads, head_dim),
                            k_norm.weight.expand(num_kv_heads, head_dim)))  # [H + KV, D]
        qk = normed * weight
    halves = qk.reshape(num_tokens, num_heads + num_kv_heads, 2, head_dim // 2)
    rotated = (halves * cos_pair + halves.flip(2) * sin_pair).view(num_tokens, num_heads + num_kv_heads, head_dim)
    query = rotated[:, :num_heads]  # [T, H, D]
    key_value = torch.cat((rotated[:, num_heads:], heads[:, num_heads + num_kv_heads:]), dim=1)  # [T, 2 KV, D]
    cache = attn.kv_cache  # [2, num_blocks, block_size, KV, D]
    flat = cache.view(2, -1, num_kv_heads, head_dim)  # [2, slots, KV, D]
    flat.index_copy_(1, slot_mapping, key_value.view(num_tokens, 2, num_kv_heads, head_dim).transpose(0, 1))
    context = flat[:, context_slots]  # [2, S, KV, D]
    key = context[0].permute(1, 2, 0)  # [KV, D, S]
    value = context[1].transpose(0, 1)  # [KV, S, D]
    group = num_heads // num_kv_heads
    q = query.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        num_kv_heads, group * num_tokens, head_dim)  # [KV, group * T, D]
    scores = torch.bmm(q, key) * attn.scale  # [KV, group * T, S]
    if hidden_keys is not None:
        scores = scores.view(num_kv_heads, group, num_tokens, -1).masked_fill(hidden_keys, float("-inf"))
        scores = scores.view(num_kv_heads, group * num_tokens, -1)
    out = torch.bmm(torch.softmax(scores, dim=-1), value)  # [KV, group * T, D]
    return out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(
        num_tokens, num_heads * head_dim)


def slots_of(
    block_row: torch.Tensor,  # [W] int32: a sequence's block table row
    context_index: torch.Tensor,  # [S] int64: 0 .. S - 1
    block_size: int,
) -> torch.Tensor:  # [S] int64: the cache slots of the context's S tokens, in order
    """Inside the compiled graphs: where the context's keys and values sit (the gather that reads
    them comes next), so that a call costs the host two views, not the slots' arithmetic."""
    return block_row.long()[context_index // block_size] * block_size + context_index % block_size


class ContextIndex:
    """0 .. S - 1 for a context of S tokens, as a view of one arange grown as contexts grow (a
    compiled graph's dynamic input: its length carries S)."""

    def __init__(self):
        self.index = torch.arange(256)  # [capacity] int64

    def __call__(self, seq_len: int) -> torch.Tensor:  # [seq_len] int64
        if seq_len > self.index.shape[0]:
            self.index = torch.arange(2 * seq_len)
        return self.index[:seq_len]


def mark_context_dynamic(block_row: torch.Tensor, context_index: torch.Tensor) -> None:
    """Before a key's first call: the context length dynamic (a graph for any S >= 2), the block
    table's width too where it can be (a width of 1 stays specialised)."""
    torch._dynamo.mark_dynamic(context_index, 0)
    torch._dynamo.maybe_mark_dynamic(block_row, 0)


def fits_compiled_step(model, input_ids: torch.Tensor, metadata: AttentionMetadata,
                       row_counts: tuple[int, ...]) -> bool:
    """Whether CompiledDecoderForward runs this forward compiled (else forward_torch): one
    sequence's step of one of the row counts it compiles for, on the CPU, outside autograd."""
    return fits_one_sequence_step(model.layers[0].self_attn.attn, input_ids, metadata, row_counts)


def fits_one_sequence_step(attn, input_ids: torch.Tensor, metadata: AttentionMetadata,
                           row_counts: tuple[int, ...]) -> bool:
    """Whether a step through this attention layer (Attention: its backend and cache) is what the
    compiled forwards cover: one sequence's rows, of one of row_counts, a context of at least 2
    (a dynamic length of 1 would be specialised), a float32 cache, the torch backend, the CPU,
    outside autograd."""
    if input_ids.is_cuda or torch.is_grad_enabled():
        return False
    if type(attn.backend) is not TorchAttentionBackend or attn.kv_cache is None or attn.kv_cache.dtype != torch.float32:
        return False  # another attention backend, an FP8 cache
    if len(metadata.query_start_loc_cpu) != 2 or metadata.tree_mask is not None:
        return False  # several sequences, or a tree
    return input_ids.shape[0] in row_counts and metadata.seq_lens_cpu[0] >= 2


def install_cpu_compile(model, device: torch.device, row_counts: tuple[int, ...] = (1,),
                        tensor_parallel_size: int = 1, batch_invariant: bool = False) -> bool:
    """Give a target model its compiled CPU forward (ModelConfig.cpu_compile; an EAGLE3 drafter's
    head step is cpu_compile_head.install_cpu_compile_head's, which the runner calls after this).
    ValueError on a CUDA device (its steps run in CUDA graphs); a warning, and the eager forward, for
    a model or a set-up the compiled forward does not cover. True when the target's is installed."""
    if device.type != "cpu":
        raise ValueError(f"cpu_compile applies to the CPU only, but the device is {device}: CUDA runs its "
                         "steps in CUDA graphs; drop --cpu-compile (cpu_compile=True) or use --device cpu")
    decoder = getattr(model, "model", None)
    reason = None
    if not hasattr(decoder, "cpu_forward"):
        reason = f"{type(model).__name__} has no compiled CPU forward (the Llama family has)"
    elif tensor_parallel_size > 1:
        reason = "tensor parallelism is not covered"
    elif batch_invariant:
        reason = "batch_invariant mode is not covered (its GEMMs are its own)"
    elif (decoder.rotary_emb.style != "neox" or decoder.rotary_emb.rotary_dim != decoder.dims.head_dim
          or decoder.embed_tokens.weight.dtype != torch.float32):
        reason = "only float32 models with NeoX RoPE over whole heads are covered"
    elif any(getattr(p, "weight_scale_inv", None) is not None for p in model.modules()):
        reason = "FP8 weights are not covered"
    if reason is not None:
        logger.warning("cpu_compile: %s; the CPU forward stays eager", reason)
        return False
    if any(n > MAX_COMPILED_ROWS for n in row_counts):
        logger.warning("cpu_compile: steps of more than %d rows (%s) stay eager", MAX_COMPILED_ROWS,
                       sorted(n for n in row_counts if n > MAX_COMPILED_ROWS))
        row_counts = tuple(n for n in row_counts if n <= MAX_COMPILED_ROWS)
    decoder.cpu_forward = CompiledDecoderForward(decoder, row_counts)
    return True


class CompiledDecoderForward:
    """A DecoderModel's forward on the CPU: the compiled decoder_forward where the step fits
    (fits_compiled_step), forward_torch otherwise. Counts its compiled and eager calls."""

    def __init__(self, model, row_counts: tuple[int, ...]):
        bad = [n for n in row_counts if not 1 <= n <= MAX_COMPILED_ROWS]
        if bad:
            raise ValueError(f"cpu_compile row counts must be in 1..{MAX_COMPILED_ROWS}, got {bad}")
        self.model = model
        self.row_counts = tuple(sorted(set(row_counts)))
        self.compiled = DirectCompiled(decoder_forward)
        self.context_index = ContextIndex()
        self.num_compiled_calls = 0
        self.num_eager_calls = 0

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not fits_compiled_step(self.model, input_ids, metadata, self.row_counts):
            self.num_eager_calls += 1
            return self.model.forward_torch(input_ids, positions, metadata, aux_layers)
        self.num_compiled_calls += 1
        aux_layers = tuple(aux_layers)
        key = (input_ids.shape[0], aux_layers, metadata.block_size)
        block_row, context_index = metadata.block_table[0], self.context_index(metadata.seq_lens_cpu[0])
        if not self.compiled.knows(key):
            torch._dynamo.mark_static(input_ids, 0)
            torch._dynamo.mark_static(positions, 0)
            mark_context_dynamic(block_row, context_index)
        hidden, streams = self.compiled(key, model=self.model, input_ids=input_ids, positions=positions,
                                        slot_mapping=metadata.slot_mapping, block_row=block_row,
                                        context_index=context_index, block_size=metadata.block_size,
                                        aux_layers=aux_layers)
        return hidden, list(streams.unbind(1))
