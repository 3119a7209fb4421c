"""The linear of the batch-invariant mode (ModelConfig.batch_invariant, issue 23): y = x W^T (+ b)
where each row's reduction order is a function of K alone, never of how many rows came with it.

Why a mode of its own: a BLAS picks its kernel by the whole product's shape, so one row's sums run
in another order at M = 1 (a GEMV) than at M = 4 (a small GEMM) or M = 512, and the rounded result
differs (on this project's CPU, float32 F.linear differs between M = 1 and M = 2 on every row).
A token decoded alone and the same token verified among k + 1 then get different logits.

  torch (CPU, and what CUDA runs without triton): every row is its own one-row product. On the CPU
    that is one torch.bmm of [M, 1, K] against the weight broadcast to [M, K, N] (each batch item a
    one-row product of the same shape: the same kernel, whatever M; tests/ops/
    test_batch_invariant_gemm.py holds row r at M = 1 against M = 2..64). On CUDA, where cuBLAS
    may choose a batched kernel by the batch count, the Triton kernel below (one launch: the MoE
    experts and router of the mode call linear_rows_torch directly, and a loop of one-row
    F.linear calls per expert made the DeepSeek-layout target crawl), or without triton a loop of
    one-row F.linear calls.
  Triton (CUDA): ops/gemm/triton_batch_invariant.py, one tensor-core kernel for every M whose
    rows of W per program, K step and split-K count are fixed by the weight's shape (N, K), never
    by M: decode runs as fast as the default few-row MMA, and the same per-row order serves verify
    and prefill.

`float32_out` (the LM head): the products summed in float32 and kept in float32, not rounded to
the model dtype first (fewer ties between logits; in torch the operands are taken to float32,
where bf16 and fp16 products are exact). `gated` ([gate; up] weights): silu(gate) * up of the
rounded product, as layers/linear.py's MergedLinear.forward_gated computes it (the sigmoid in float64:
ops/pointwise/batch_invariant.py says why).

`BatchInvariantGemm` is called like ops/gemm/dispatch.SmallMGemm, and is bound in its place to
every Linear and LMHead by layers/batch_invariant.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foretell.ops.common import kernel_choice
from foretell.ops.pointwise.batch_invariant import silu_and_mul_batch_invariant


def linear_rows_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
) -> torch.Tensor:  # [M, N], x's dtype
    """x W^T with each row computed as a one-row product (the module docstring says why)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with the same K, got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    # A fresh copy: every row starts where it would start alone (same alignment, same strides).
    rows = x.clone(memory_format=torch.contiguous_format)
    if x.device.type == "cpu":
        return torch.bmm(rows.unsqueeze(1), weight.t().unsqueeze(0).expand(m, k, n)).squeeze(1)
    if BatchInvariantGemm._use_kernel(rows, weight, None):
        from foretell.ops.gemm import triton_batch_invariant  # imports triton: CUDA only

        return triton_batch_invariant.linear_batch_invariant_triton(rows, weight)  # [M, N]
    return torch.cat([F.linear(rows[i : i + 1].clone(), weight) for i in range(m)])


def linear_batch_invariant_torch(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,
    float32_out: bool = False,
) -> torch.Tensor:  # [..., N] (gated: [..., N // 2]; float32_out: float32)
    """The torch twin of the Triton kernel's contract (not its bits: the two sum in other orders)."""
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if float32_out:
        y = linear_rows_torch(rows.float(), weight.float())  # [M, N] float32
        if bias is not None:
            y = y + bias.float()
    else:
        y = linear_rows_torch(rows, weight)  # [M, N]
        if bias is not None:
            y = y + bias
    if gated:
        y = silu_and_mul_batch_invariant(y)
    return y.view(*x.shape[:-1], y.shape[-1])


class BatchInvariantGemm:
    """Callable like F.linear(x, weight, bias) (and SmallMGemm's gated / float32_out): the Triton
    kernel where ops.common.kernel_choice allows it and it takes the dtype, else the torch rows.
    Holds nothing per shape (a call's bits depend only on its arguments), only the split-K
    counters, allocated at the first eager call so that CUDA graphs can hold their address.

    fixed_block_m: None lets the kernel's row tile grow with M (16, 64, 128 rows; the same sums);
    16 runs one row tile for every M (the fallback should a device's tensor cores ever reduce a
    K step differently by the tile's row count: tests/gpu/test_batch_invariant_gpu.py checks)."""

    mode = "batch_invariant"  # (SmallMGemm's attribute: logs and benchmarks read it)

    def __init__(self, fixed_block_m: int | None = None):
        from foretell.ops.common.split_counters import SplitCounters

        self.fixed_block_m = fixed_block_m
        self._counters = SplitCounters(min_count=1 << 16)

    def __call__(
        self,
        x: torch.Tensor,  # [..., K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None = None,  # [N]
        gated: bool = False,
        float32_out: bool = False,
    ) -> torch.Tensor:  # [..., N] (gated: [..., N // 2])
        if self._use_kernel(x, weight, bias):
            from foretell.ops.gemm import triton_batch_invariant  # imports triton: CUDA only

            rows = x.reshape(-1, x.shape[-1])  # [M, K]
            out = triton_batch_invariant.linear_batch_invariant_triton(
                rows, weight, bias, gated=gated, float32_out=float32_out, counters=self._counters,
                fixed_block_m=self.fixed_block_m)  # [M, N]
            return out.view(*x.shape[:-1], out.shape[-1])
        return linear_batch_invariant_torch(x, weight, bias, gated, float32_out)

    @staticmethod
    def _use_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
            return False
        if x.shape[-1] != weight.shape[-1] or not weight.is_contiguous():
            return False
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return False
        tensors = (x, weight) if bias is None else (x, weight, bias)
        return kernel_choice.use_triton(*tensors)
