"""The entry point of FP8-weight linears: fp8_linear(x, weight, weight_scale, block_size, bias).

`weight` is float8_e4m3fn [N, K] with float32 scales per block (`block_size`, the checkpoints'
128 x 128) or per output channel (`block_size` None); layouts and the twins in fp8_reference.py.

Which path runs (rows M = x's leading dimensions flattened):
  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): fp8_linear_torch,
    the weight dequantized on the fly, float32 sums, x as it is;
  - M <= 16 on CUDA (decode, verify, draft): triton_fp8_few_rows.py, x as it is (one row of fp16 /
    bf16: the half-precision GEMV, triton_fp8_gemv_half.py; a float32 x up to 4 rows: the GEMV; 2 to
    16 rows of fp16 / bf16: the tensor-core MMA, dotting fp16);
  - more rows on CUDA (prefill, large batches), with 128-wide weight blocks or per-channel scales:
    triton_fp8_gemm.py, x quantized per token group of 128 (as the checkpoints were trained) and
    multiplied on FP8 tensor cores; its twin is fp8_linear_quantized_activations_torch, so this
    path differs from the CPU's by the activations' quantization;
  - anything else (odd block widths, a bias of another dtype): the torch twin on the device.
`gated` (an MLP's [gate; up]) returns silu_and_mul of the product: in the few-row kernels'
epilogue (no gate_up tensor, no launch), elsewhere as ops/pointwise's silu_and_mul after it.

Importing this module never imports triton: the kernel modules are imported on the first CUDA call.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.gemm.fp8_reference import ACTIVATION_GROUP, check_fp8_weight, fp8_linear_torch
from foretell.ops.pointwise.dispatch import silu_and_mul

FEW_ROWS_MAX_M = 16  # triton_fp8_few_rows.MAX_M (restated: this module needs no triton)
GEMV_MAX_M = 4  # triton_fp8_gemv.GEMV_MAX_M
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fp8_path(m: int, dtype: torch.dtype, block_size: tuple[int, int] | None) -> str:
    """"few_rows", "gemm" or "torch": the kernel a CUDA call with m rows of x in dtype takes."""
    if m < 1 or dtype not in (*TENSOR_CORE_DTYPES, torch.float32):
        return "torch"
    width = None if block_size is None else block_size[1]
    if m <= FEW_ROWS_MAX_M and (width is None or _power_of_two(width)):
        if m <= GEMV_MAX_M and (m == 1 or dtype == torch.float32):
            return "few_rows"
        if dtype in TENSOR_CORE_DTYPES and (width is None or width >= 16):
            return "few_rows"
    if width is None or width == ACTIVATION_GROUP:
        return "gemm"
    return "torch"


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn ([gate; up] when gated)
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32
    block_size: tuple[int, int] | None,  # (bn, bk), or None: per-channel scales
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # silu_and_mul of the product (an MLP's gate_up): the few-row kernels' epilogue
) -> torch.Tensor:  # [..., N] ([..., N // 2] when gated), x's dtype
    """y = x (q * s)^T + bias, reading the FP8 weight as it is stored."""
    check_fp8_weight(weight, weight_scale, block_size)
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., K={k}] for an FP8 weight {list(weight.shape)}, got {list(x.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated FP8 weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    tensors = (x, weight, weight_scale) + (() if bias is None else (bias,))
    if not use_triton(*tensors):
        return _activated(fp8_linear_torch(x, weight, weight_scale, block_size, bias), gated)
    rows = x.reshape(-1, k)  # [M, K]
    path = fp8_path(rows.shape[0], x.dtype, block_size)
    if bias is not None and bias.dtype != x.dtype:
        path = "torch"
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    if path == "few_rows":
        from foretell.ops.gemm import triton_fp8_few_rows as few_rows  # imports triton

        config = few_rows.default_config(rows.shape[0], *weight.shape, x.dtype, block_size, x.device)
        fused = gated and (isinstance(config, few_rows.Fp8MmaConfig)
                           or few_rows.gemv_rows_fit_blocks(config.block_n, weight.shape[0], block_size, True))
        out = few_rows.fp8_few_rows_linear(rows, weight, weight_scale, block_size, bias, config, gated=fused)
        out = out if fused else _activated(out, gated)
    elif path == "gemm":
        from foretell.ops.gemm.triton_fp8_gemm import fp8_gemm  # imports triton

        out = _activated(fp8_gemm(rows, weight, weight_scale, block_size, bias), gated)
    else:
        return _activated(fp8_linear_torch(x, weight, weight_scale, block_size, bias), gated)
    return out.view(*x.shape[:-1], out.shape[-1])


def _activated(y: torch.Tensor, gated: bool) -> torch.Tensor:  # [..., N] -> [..., N // 2] when gated
    return silu_and_mul(y) if gated else y
