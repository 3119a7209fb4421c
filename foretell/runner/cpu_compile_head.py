"""The EAGLE3 head's draft step compiled on the CPU (`cpu_compile`, `--cpu-compile`; issue 32's CPU bar).

On the CPU a draft step of the default head is dozens of small torch calls, each paying its dispatch
(the head's one decoder layer, its KV write and paged read, the norms, the LM head over the draft
vocabulary; the figures: docs/perf-log.md), and a speculative step at k = 3 runs three of them: the
catch-up over the verify's k + 1 rows (the padded step's, spec_decode/draft_graph.py; fc fusing the
three aux hidden states first) and k - 1 single-row chain steps. Here that step, Eagle3Head.step for
one sequence, is one function of tensors (`eagle3_head_step`) compiled by Inductor's C++ backend,
like the target's forward next door (cpu_compile.py, whose attention it shares).

Shapes: one graph per (row count, first step or chain step); the row counts are the runner's
(1 and the verify's k + 1), the context length dynamic (`context_index`), so a growing context
never recompiles. Anything else (several sequences, another row count such as the catch-up after
a prefill, a tree, an FP8 or other-backend cache, tensor parallelism, greedy_only tokens) runs
Eagle3Head.step eagerly.

Arithmetic: Eagle3Head.step's (Eagle3LayerBase.forward, attend_qkv's one-sequence attention with
its causal mask by context length, the norms with their residual adds, the few-row `W x^T` GEMM
forms); Inductor's fused reductions may order sums differently, so logits, h and the cached keys
and values may differ from the eager ones in the last bits (tests/runner/test_cpu_compile_head.py holds
them within 1e-5). Drafts only steer what the target verifies: the output stays the target's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from foretell.models.eagle3 import Eagle3Head, Eagle3Layer
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.runner.cpu_compile import MAX_COMPILED_ROWS, ContextIndex, attend, fits_one_sequence_step, linear, \
    mark_context_dynamic, slots_of
from foretell.runner.cpu_compile_direct import DirectCompiled

logger = logging.getLogger("foretell")


def eagle3_head_step(
    head,  # Eagle3Head: its parameters and its layer's draft KV cache are read (the cache written)
    input_ids: torch.Tensor,  # [T] int64: the token each row is fed
    positions: torch.Tensor,  # [T] int64: the last T positions of the context
    g: torch.Tensor | None,  # [T, H]: the previous step's h (a chain step), or None: from aux
    aux: list[torch.Tensor] | None,  # 3 x [T, Ht]: the target's aux hidden states (a first step)
    slot_mapping: torch.Tensor,  # [T] int64: the draft cache slots the rows' keys and values go to
    block_row: torch.Tensor,  # [W] int32: the sequence's block table row (in the draft's block size)
    context_index: torch.Tensor,  # [S] int64: 0 .. S - 1 over the context's S tokens (dynamic)
    block_size: int,  # the draft cache's
    keep_rows: torch.Tensor | None,  # [m] int64: the rows to draft from; None: all
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [m, draft_vocab] float32, h [m, H])
    """Eagle3Head.step for one sequence's T rows (fc first when given aux), as one traceable function."""
    layer = head.midlayer
    context_slots = slots_of(block_row, context_index, block_size)  # [S] int64
    num_tokens, hidden_size = input_ids.shape[0], head.hidden_size
    if g is None:
        g = linear(torch.cat(aux, dim=-1), head.fc.weight, head.fc.bias)  # [T, H]
    embedding = head.embed_tokens if head.embed_tokens is not None else head.shared_embed
    embeds = torch.rms_norm(F.embedding(input_ids, embedding.weight), (hidden_size,), layer.input_layernorm.weight,
                            layer.input_layernorm.eps)  # [T, H]
    normed_g = torch.rms_norm(g, (hidden_size,), layer.hidden_norm.weight, layer.hidden_norm.eps)  # [T, H]
    residual = normed_g if layer.norm_before_residual else g
    attn_block = layer.self_attn
    qkv = linear(torch.cat((embeds, normed_g), dim=-1), attn_block.qkv_proj.weight, attn_block.qkv_proj.bias)
    pair = attn_block.rotary_emb.neox_pair_cache[positions]  # [T, 2, 1, 2, D // 2] float32
    hidden_keys = None
    if num_tokens > 1:  # as attend_one_sequence: row j sits at S - T + j and sees keys 0..that position
        seq_len = context_slots.shape[0]
        row_positions = torch.arange(num_tokens, device=input_ids.device) + (seq_len - num_tokens)  # [T]
        hidden_keys = torch.arange(seq_len, device=input_ids.device)[None, :] > row_positions[:, None]  # [T, S]
    out = attend(attn_block.attn, None, qkv, pair[:, 0], pair[:, 1], slot_mapping, context_slots, hidden_keys)
    attn_out = linear(out, attn_block.o_proj.weight, attn_block.o_proj.bias)  # [T, H]
    if keep_rows is not None:  # every row's keys and values are cached: the rest runs on the kept rows
        attn_out, residual = attn_out.index_select(0, keep_rows), residual.index_select(0, keep_rows)
    h_attn = residual + attn_out  # [m, H]
    norm = layer.post_attention_layernorm
    normed = torch.rms_norm(h_attn, (hidden_size,), norm.weight, norm.eps)
    mlp = layer.mlp
    gate_up = linear(normed, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)  # [m, 2 * I]
    gate, up = gate_up.chunk(2, dim=-1)
    h = h_attn + linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)  # [m, H]
    lm_head = head.lm_head if head.lm_head is not None else head.shared_lm_head
    logits = linear(torch.rms_norm(h, (hidden_size,), head.norm.weight, head.norm.eps), lm_head.weight, None)
    return logits, h


def install_cpu_compile_head(drafter, row_counts: tuple[int, ...], tensor_parallel_size: int = 1,
                             batch_invariant: bool = False) -> bool:
    """Give an EAGLE3 drafter (spec_decode/eagle3.py) its compiled CPU head step, where the head is
    covered (a warning, and the eager step, where not). True when installed. The caller has
    checked the device (install_cpu_compile)."""
    from foretell.spec_decode.eagle3 import Eagle3Proposer

    if not isinstance(drafter, Eagle3Proposer):
        return False  # another drafter: nothing of it is compiled
    head = drafter.head
    reason = None
    if type(head) is not Eagle3Head or type(head.midlayer) is not Eagle3Layer:
        reason = f"the {type(head).__name__} head's layer is not covered (the Llama-layer EAGLE3 head is)"
    elif tensor_parallel_size > 1:
        reason = "tensor parallelism is not covered"
    elif batch_invariant:
        reason = "batch_invariant mode is not covered (its GEMMs are its own)"
    else:
        rotary = head.midlayer.self_attn.rotary_emb
        embedding = head.embed_tokens if head.embed_tokens is not None else head.shared_embed
        lm_head = head.lm_head if head.lm_head is not None else head.shared_lm_head
        if (rotary.style != "neox" or rotary.rotary_dim != head.midlayer.self_attn.head_dim
                or any(p.dtype != torch.float32 for p in head.parameters() if p.is_floating_point())
                or embedding.weight.dtype != torch.float32 or lm_head.weight.dtype != torch.float32):
            reason = "only float32 heads with NeoX RoPE over whole heads are covered"
        elif any(getattr(p, "weight_scale_inv", None) is not None for p in head.modules()):
            reason = "FP8 weights are not covered"
    if reason is not None:
        logger.warning("cpu_compile: the EAGLE3 head's step stays eager: %s", reason)
        return False
    drafter.cpu_head_step = CompiledHeadStep(head, tuple(n for n in row_counts if n <= MAX_COMPILED_ROWS))
    return True


class CompiledHeadStep:
    """An Eagle3Head's step on the CPU: the compiled eagle3_head_step where the step fits
    (one sequence, a row count of row_counts, at most one kept row), Eagle3Head.step otherwise.
    Counts its compiled and eager calls."""

    def __init__(self, head: Eagle3Head, row_counts: tuple[int, ...]):
        bad = [n for n in row_counts if not 1 <= n <= MAX_COMPILED_ROWS]
        if bad:
            raise ValueError(f"cpu_compile row counts must be in 1..{MAX_COMPILED_ROWS}, got {bad}")
        self.head = head
        self.row_counts = tuple(sorted(set(row_counts)))
        self.compiled = DirectCompiled(eagle3_head_step)
        self.context_index = ContextIndex()
        self.num_compiled_calls = 0
        self.num_eager_calls = 0

    def fits(self, input_ids: torch.Tensor, metadata: AttentionMetadata, keep_rows: torch.Tensor | None) -> bool:
        attn = self.head.midlayer.self_attn.attn
        return (fits_one_sequence_step(attn, input_ids, metadata, self.row_counts) and attn.kv_cache.is_contiguous()
                and (keep_rows is None or keep_rows.shape == (1,)))

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,  # over the draft cache
        keep_rows: torch.Tensor | None = None,  # [m]: the rows to draft from; None: all
        *,
        g: torch.Tensor | None = None,  # [T, H]: the previous h; None: fc over aux
        aux: list[torch.Tensor] | None = None,  # 3 x [T, Ht]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [m, draft_vocab] float32, h [m, H])
        if not self.fits(input_ids, metadata, keep_rows):
            self.num_eager_calls += 1
            return self.head.step(input_ids, positions, self.head.combine(aux) if g is None else g, metadata,
                                  keep_rows)
        self.num_compiled_calls += 1
        if keep_rows is not None and keep_rows.dtype != torch.int64:
            keep_rows = keep_rows.long()  # one graph for either index dtype
        key = (input_ids.shape[0], g is None, keep_rows is None, 0 if aux is None else len(aux), metadata.block_size)
        block_row, context_index = metadata.block_table[0], self.context_index(metadata.seq_lens_cpu[0])
        if not self.compiled.knows(key):
            for t in (input_ids, positions, metadata.slot_mapping, g, *(aux or ())):
                if t is not None:
                    torch._dynamo.mark_static(t, 0)
            mark_context_dynamic(block_row, context_index)
        return self.compiled(key, head=self.head, input_ids=input_ids, positions=positions, g=g,
                             aux=None if aux is None else list(aux), slot_mapping=metadata.slot_mapping,
                             block_row=block_row, context_index=context_index, block_size=metadata.block_size,
                             keep_rows=keep_rows)
