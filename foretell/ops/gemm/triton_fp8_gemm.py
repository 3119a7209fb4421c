"""FP8 linears for many rows (prefill, large batches) on Hopper's FP8 tensor cores, and the
activation quantizer they need. Twins in fp8_reference.py: quantize_fp8_per_token_group and
fp8_linear_quantized_activations_torch.

As DeepSeek-V3 and Kimi-K2 were trained: x is quantized to e4m3 per token and group of 128 columns
(scale = the group's amax / 448), the weight is the checkpoint's FP8 with one scale per 128x128
block (or one per output channel, `quantization="fp8"`), and

  y[m, n] = sum over k-blocks b of (xq[m, b] . q[n, b]) * sx[m, b] * s[n // 128, b]    (block)
  y[m, n] = s[n] * sum over b of (xq[m, b] . q[n, b]) * sx[m, b]                       (per channel)

each block's dot an FP8 MMA into float32, scaled and added in float32, rounded to x's dtype once.

  quantize_per_token_group   grid (M, cdiv(groups, GROUPS_PER_PROGRAM)): each program reads its
      row's groups, takes their amax, divides correctly rounded (div_rn, as torch does), rounds to
      the e4m3 grid in float32 (round_to_e4m3: nearest, ties to even) and stores e4m3 values and
      float32 scales: the twin's bits, on the GPU and in the interpreter.
  fp8_gemm                   [BLOCK_M, BLOCK_N] output tiles (grouped along M for L2 reuse of the
      weight), BLOCK_K = 128 = the activation group and the weight block's width, pipelined loads.

Tiles are first guesses, to be tuned on the H200 against cuBLAS in bf16 (scripts to come). The
output is one torch.empty, grids depend only on shapes: calls can be captured in CUDA graphs. This
module imports triton: only ops/gemm/fp8_dispatch.py imports it, on CUDA (and the interpreter
tests, tests/ops/test_gemm_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.gemm.fp8_reference import ACTIVATION_GROUP, FP8_DTYPE, blocks, check_fp8_weight

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-10)  # fp8_reference.MIN_AMAX
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 128
    block_n: int = 128
    group_m: int = 8  # row tiles that walk the same weight tiles together (L2 reuse)
    num_stages: int = 4
    num_warps: int = 8

    def __str__(self) -> str:
        return f"fp8 gemm BM{self.block_m} BN{self.block_n} G{self.group_m} s{self.num_stages} w{self.num_warps}"


def default_gemm_config(m: int) -> Fp8GemmConfig:
    """128 x 128 tiles; 64 rows for fewer than 128 rows (less padding)."""
    return Fp8GemmConfig(block_m=64 if m <= 64 else 128)


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: the
    conversion after it is exact, whatever rounding the hardware's (or the interpreter's, which
    does not carry a rounded-up mantissa into the exponent) would apply."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-9 apart
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inverse = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    # Adding and removing 1.5 * 2^23 rounds |v / spacing| <= 16 to an integer, ties to even.
    return ((v * inverse + 12582912.0) - 12582912.0) * spacing


@triton.jit
def _quantize_per_token_group_kernel(
    x_ptr,  # [M, K], unit column stride
    q_ptr,  # [M, K] float8e4nv, contiguous
    scale_ptr,  # [M, ceil(K / GROUP)] float32, contiguous
    K,
    num_groups,
    stride_xm,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [G]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scales = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), FP8_MAX)  # [G]
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scales[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * K + cols, round_to_e4m3(q).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * num_groups + groups, scales, mask=groups < num_groups)


def quantize_per_token_group(
    x: torch.Tensor,  # [M, K] float, unit column stride
    group: int = ACTIVATION_GROUP,
    groups_per_program: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32
    """quantize_fp8_per_token_group (fp8_reference.py) in one launch."""
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be a float [M, K] tensor of {[str(d) for d in X_DTYPES]}, got {x.dtype} "
                         f"{list(x.shape)}")
    if group < 1 or group & (group - 1):
        raise ValueError(f"the activation group must be a power of two, got {group}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    num_groups = blocks(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    groups_per_program = min(groups_per_program, triton.next_power_of_2(num_groups))
    _quantize_per_token_group_kernel[(m, triton.cdiv(num_groups, groups_per_program))](
        x, q, scales, k, num_groups, x.stride(0), GROUP=group, GROUPS_PER_PROGRAM=groups_per_program,
        num_warps=4,
    )
    return q, scales


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] float8e4nv, contiguous: the quantized activations
    a_scale_ptr,  # [M, cdiv(K, BLOCK_K)] float32, contiguous
    b_ptr,  # [N, K] float8e4nv, contiguous: the weight
    b_scale_ptr,  # [cdiv(N, QBLOCK_N), cdiv(K, BLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_b_scale,
    QBLOCK_N: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the activation group and the weight block's width
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W
    row_ok = rows < M
    col_ok = cols < N
    lanes = tl.arange(0, BLOCK_K)
    k_blocks = tl.cdiv(K, BLOCK_K)
    a_tile = a_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_M, BLOCK_K]
    b_tile = b_ptr + cols[None, :].to(tl.int64) * K + lanes[:, None]  # [BLOCK_K, BLOCK_N]: W^T
    a_scales = a_scale_ptr + rows.to(tl.int64) * k_blocks  # [BLOCK_M]
    b_scales = b_scale_ptr + (cols // QBLOCK_N) * stride_b_scale  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, k_blocks):
        k_ok = kb * BLOCK_K + lanes < K
        a = tl.load(a_tile + kb * BLOCK_K, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_tile + kb * BLOCK_K, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(a_scales + kb, mask=row_ok, other=0.0)  # [BLOCK_M]
        product = tl.dot(a, b)  # [BLOCK_M, BLOCK_N] float32
        if PER_CHANNEL:
            acc += product * a_scale[:, None]
        else:
            b_scale = tl.load(b_scales + kb, mask=col_ok, other=0.0)  # [BLOCK_N]
            acc += product * (a_scale[:, None] * b_scale[None, :])
    if PER_CHANNEL:
        acc *= tl.load(b_scales, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / 128)] or [N, 1] float32, contiguous
    block_size: tuple[int, int] | None,  # (bn, 128), or None: per-channel scales
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """fp8_linear_quantized_activations_torch: x quantized per token group of 128, then the FP8
    tensor-core product, in two launches."""
    check_fp8_weight(weight, weight_scale, block_size)
    n, k = weight.shape
    if block_size is not None and block_size[1] != ACTIVATION_GROUP:
        raise ValueError(f"the FP8 GEMM takes weight blocks {ACTIVATION_GROUP} columns wide (the activation "
                         f"group), got block_size {block_size}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be a float [M, K={k}] tensor of {[str(d) for d in X_DTYPES]} for an FP8 weight "
                         f"{list(weight.shape)}, got {x.dtype} {list(x.shape)}")
    if not weight.is_contiguous() or not weight_scale.is_contiguous():
        raise ValueError("an FP8 weight and its scale must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] {x.dtype} tensor, got {list(bias.shape)} {bias.dtype}")
    m = x.shape[0]
    config = config or default_gemm_config(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    q, scales = quantize_per_token_group(x, ACTIVATION_GROUP)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](
        q, scales, weight, weight_scale, bias if bias is not None else out, out, m, n, k, weight_scale.stride(0),
        QBLOCK_N=block_size[0] if block_size is not None else 1, PER_CHANNEL=block_size is None,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=ACTIVATION_GROUP,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
