"""A linear layer's matmul for a few float32 rows on the CPU: a verify step's 1 + k rows, a small
batch's decode rows (issue 32: the default family's speculative step on a laptop-class CPU).

MKL's float32 GEMM for y = x W^T with 2 to 8 rows of x (F.linear: SGEMM with the weight's rows as
the long side, M = 4096 x N = 4 for the LM head) costs several times its one-row GEMV at the default
family's shapes on the 2-core EPYC this project is measured on, while the same product asked as
W x^T (the rows of x as the short side: SGEMM M = 4 x N = 4096) streams the weight once and costs
about one GEMV, over a whole verify forward too (8 layers, the 4096 x 256 LM head, the weights read
from memory as a step reads them); at 16 rows the two meet (the figures: docs/perf-log.md,
2026-12-02, "The verify's few-row GEMMs on the CPU"). It writes [N, M]; one copy gives the [M, N]
rows the layer returns.

Both forms are MKL's float32 sums of the same products in its own order, like any GEMM: a row's
result may differ in the last bit from the one-row GEMV's, as F.linear's did already (neither
form's rows are independent of M at every shape). One row, more than 8 rows, other dtypes, CUDA,
autograd and inputs of other ranks keep F.linear. Linear.matmul and LMHead.forward call it when no
SmallMGemm (CUDA's few-row kernels, the batch-invariant GEMM) is bound, so the module path and the
CPU's few-call forward (DecoderModel.forward_torch) compute the same bits. A weight stored
transposed (cpu_weight_layout.py: on Intel CPUs, where MKL's x @ W_kn form streams it once for
few rows and this form does not) keeps F.linear too.
"""

from __future__ import annotations

import torch


def is_transposed(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight is stored as the transpose of a contiguous [K, N] tensor
    (cpu_weight_layout.py stores them so on some CPUs)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride() == (1, weight.shape[0])


MAX_ROWS = 8  # above it MKL's usual form is as fast (16 rows: equal) or faster


def fits_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether few_rows_linear serves x [M, K] against weight [N, K] (else F.linear)."""
    return (x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not (x.requires_grad or weight.requires_grad) and not is_transposed(weight))


def few_rows_linear(
    x: torch.Tensor,  # [M, K] float32, 2 <= M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], contiguous
    """F.linear(x, weight, bias) as weight @ x^T (the bias added by the same GEMM), then transposed."""
    if bias is None:
        out = torch.mm(weight, x.t())  # [N, M]
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, x.t())  # [N, M]
    return out.t().contiguous()
