"""An EAGLE3 draft layer's input in one launch: x = [input_layernorm(embed[ids]) ; hidden_norm(g)].

Every draft step starts by gathering the tokens' embedding rows, normalising them and the carried
hidden state g with two RMSNorms, and concatenating the two: four short launches before the
step's first projection, a noticeable share of a draft step on an H200 (docs/perf-log.md). Here one
program per row does all of it and writes both halves of x [n, 2H].

Rounding follows the torch path (models/eagle3.py, Eagle3LayerBase.layer_input): each half as
RMSNorm rounds it (float32 mean of squares, the normalised row rounded to the dtype, then its
product with the weight rounded), so the halves match that path bit for bit in Triton's
interpreter and within a rounding on a GPU (the mean's summation order). Twin: that torch path;
tests/ops/test_pointwise_eagle3_input.py holds them together.

The layer calls this only where ops/common/kernel_choice.use_triton says so (CUDA tensors, no autograd), so
a CPU process never imports triton. The grid depends only on the row count and nothing syncs with
the host: a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.pointwise.triton_kernels import _next_pow2, _num_warps
from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled


@triton.jit
def _rms_normed(x, weight_ptr, cols, col_ok, hidden, eps, dtype: tl.constexpr):
    """RMSNorm of one float32 row x [BLOCK_H] (padding lanes 0) with RMSNorm's roundings, in dtype."""
    variance = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (weight * normed).to(dtype)


@triton.jit
def _eagle3_input_kernel(
    ids_ptr,  # [n] int
    embed_ptr,  # [vocab, H], unit column stride
    g_ptr,  # [n, H], unit column stride
    embed_norm_ptr,  # [H]: input_layernorm's weight
    hidden_norm_ptr,  # [H]: hidden_norm's weight
    x_ptr,  # [n, 2H] contiguous
    hidden,
    stride_embed,
    stride_g,
    embed_eps,
    hidden_eps,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # the next kernel (the qkv projection) streams weights meanwhile
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    dtype = x_ptr.dtype.element_ty
    token = tl.load(ids_ptr + row).to(tl.int64)
    embed = tl.load(embed_ptr + token * stride_embed + cols, mask=col_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = x_ptr + row * 2 * hidden + cols
    tl.store(out, _rms_normed(embed, embed_norm_ptr, cols, col_ok, hidden, embed_eps, dtype), mask=col_ok)
    tl.store(out + hidden, _rms_normed(g, hidden_norm_ptr, cols, col_ok, hidden, hidden_eps, dtype), mask=col_ok)


def eagle3_input_triton(
    input_ids: torch.Tensor,  # [n] int
    embedding: torch.Tensor,  # [vocab, H], g's dtype
    g: torch.Tensor,  # [n, H]
    embed_norm: torch.Tensor,  # [H] input_layernorm's weight, g's dtype
    embed_eps: float,
    hidden_norm: torch.Tensor,  # [H] hidden_norm's weight, g's dtype
    hidden_eps: float,
) -> torch.Tensor:  # [n, 2H] contiguous, g's dtype: [normed embedding ; normed g]
    """torch.cat([input_layernorm(embedding[input_ids]), hidden_norm(g)], -1) in one launch."""
    n, hidden = g.shape
    if input_ids.shape != (n,) or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be [{n}] int32 or int64 (one per row of g), got "
                         f"{list(input_ids.shape)} {input_ids.dtype}")
    expected = (("embedding", embedding, (embedding.shape[0], hidden)), ("embed_norm", embed_norm, (hidden,)),
                ("hidden_norm", hidden_norm, (hidden,)))
    for name, t, shape in expected:
        if t.shape != shape or t.dtype != g.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {list(shape)} {g.dtype} with unit last stride, got "
                             f"{list(t.shape)} {t.dtype}")
    x = torch.empty((n, 2 * hidden), dtype=g.dtype, device=g.device)
    if n == 0:
        return x
    g = g if g.stride(1) == 1 else g.contiguous()
    input_ids = input_ids.contiguous()  # the kernel reads ids_ptr + row (a no-op for the loop's rows)
    block_h = _next_pow2(hidden)
    pdl = pdl_enabled(g)
    _eagle3_input_kernel[(n,)](
        input_ids, embedding, g, embed_norm, hidden_norm, x,
        hidden, embedding.stride(0), g.stride(0), embed_eps, hidden_eps,
        BLOCK_H=block_h,
        PDL=pdl,
        num_warps=_num_warps(block_h),
        **launch_options(pdl),
    )
    return x
