"""Kernel cases of the weight-streaming ops and the per-row ops: fused MoE (bf16 and int4 experts),
the few-row GEMM, the FP8 linear, and the pointwise ops of a decoder layer (residual add +
RMSNorm, RoPE, SiLU-and-mul). KernelCase, the presets and the shapes: cases.py.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from foretell.bench.kernels import inputs as make
from foretell.bench.kernels.cases import (
    FP8_BLOCK, FP8_GEMM, GEMM, LLAMA3_ROPE, MOE, MOE_INT4, POINTWISE, KernelCase, KernelPath, cycle, num_copies,
    sizes,
)


def token_counts(kernel: str, preset: str) -> tuple[int, ...]:
    if preset == "tiny":
        return (1, 5)
    if preset == "quick":
        return (1, 64)
    return (1, 4, 8, 64) if kernel == "moe_int4" else (1, 4, 16, 64, 512)


def moe_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    """The routed experts' weighted sum (ops/moe/dispatch.py fused_experts) at DeepSeek-V2-Lite's
    sizes; bytes are the weights of the experts the tokens chose."""
    from foretell.ops.moe.dispatch import fused_experts
    from foretell.ops.moe.reference import experts_forward_torch

    dims = MOE[sizes(preset)]
    hidden, inter = dims["hidden"], dims["intermediate"]
    for tokens in token_counts(kernel, preset):
        d = make.expert_inputs(tokens, dtype=dtype, device=device, **dims)
        elem = d.hidden.element_size()
        args = (d.hidden, d.gate_up, d.down, d.weights, d.ids)
        yield KernelCase(kernel, dict(num_tokens=tokens, **dims),
                         {"foretell": KernelPath(lambda args=args: fused_experts(*args), True),
                          "torch": KernelPath(lambda args=args: experts_forward_torch(*args))},
                         "torch", bytes_per_call=d.experts_used * 3 * hidden * inter * elem + 2 * d.hidden.numel() * elem,
                         flops_per_call=2 * d.ids.numel() * 3 * hidden * inter,
                         notes={"experts_used": d.experts_used})


def moe_int4_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    """Int4 experts (ops/moe/int4_dispatch.py fused_int4_experts) at Kimi-K2.5's widths, against
    the same product on the experts dequantized to dtype ("bf16_experts": what 4 bits save)."""
    from foretell.ops.moe.dispatch import fused_experts
    from foretell.ops.moe.int4_dispatch import INT4_GEMV_MAX_TOKENS, fused_int4_experts
    from foretell.ops.moe.int4_reference import dequantize_int4, int4_experts_forward_torch

    dims = MOE_INT4[sizes(preset)]
    hidden, inter = dims["hidden"], dims["intermediate"]
    for tokens in token_counts(kernel, preset):
        d = make.int4_expert_inputs(tokens, dtype=dtype, device=device, **dims)
        args = (d.hidden, d.gate_up_packed, d.gate_up_scale, d.down_packed, d.down_scale, d.weights, d.ids)
        used = int(d.ids.unique().numel())
        gate_up = dequantize_int4(d.gate_up_packed, d.gate_up_scale, hidden)  # [E, 2I, H]
        down = dequantize_int4(d.down_packed, d.down_scale, inter)  # [E, H, I]
        bf16_args = (d.hidden, gate_up, down, d.weights, d.ids)
        per_expert = 3 * hidden * inter // 2 + (d.gate_up_scale[0].numel() + d.down_scale[0].numel()) * d.gate_up_scale.element_size()
        yield KernelCase(kernel, dict(num_tokens=tokens, **dims),
                         {"foretell": KernelPath(lambda args=args: fused_int4_experts(*args), tokens <= INT4_GEMV_MAX_TOKENS),
                          "torch": KernelPath(lambda args=args: int4_experts_forward_torch(*args)),
                          "bf16_experts": KernelPath(lambda a=bf16_args: fused_experts(*a), True)},
                         "torch", bytes_per_call=used * per_expert + 2 * d.hidden.numel() * d.hidden.element_size(),
                         flops_per_call=2 * d.ids.numel() * 3 * hidden * inter, notes={"experts_used": used})


def gemm_rows(preset: str, few_rows_only: bool) -> tuple[int, ...]:
    if preset == "tiny":
        return (1, 4) if few_rows_only else (1, 4, 40)
    if preset == "quick":
        return (1, 4) if few_rows_only else (1, 16, 512)
    return (1, 2, 4, 8, 16) if few_rows_only else (1, 4, 16, 64, 512)


def gemm_small_m_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    """The few-row linear the engine binds on CUDA (ops/gemm/dispatch.py SmallMGemm, mode "on")
    against F.linear (cuBLAS), at Llama-3.1-8B's linear shapes; bytes are W, x and y once."""
    from foretell.ops.gemm.dispatch import SmallMGemm

    gemm = SmallMGemm("on")
    for name, (n, k) in GEMM[sizes(preset)].items():
        weight = make.linear_weight(n, k, dtype, device)
        copies = num_copies(weight.numel() * weight.element_size(), device)
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        for m in gemm_rows(preset, few_rows_only=True):
            x = make.randn((m, k), dtype, device, make.generator(device, m))
            yield KernelCase(kernel, dict(linear=name, m=m, n=n, k=k),
                             {"foretell": KernelPath(cycle(lambda w, x=x: gemm(x, w), weights), True),
                              "torch_linear": KernelPath(cycle(lambda w, x=x: F.linear(x, w), weights), True)},
                             "torch_linear", bytes_per_call=(n * k + m * k + m * n) * weight.element_size(),
                             flops_per_call=2 * m * n * k, calls_per_run=copies)
        del weights


def gemm_fp8_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    """FP8 block-quantized linears (ops/gemm/fp8_dispatch.py fp8_linear) at DeepSeek-V3's shapes,
    against the torch twin and F.linear on the weight dequantized to dtype."""
    from foretell.ops.gemm.fp8_dispatch import fp8_linear, fp8_path
    from foretell.ops.gemm.fp8_reference import dequantize_fp8, fp8_linear_torch

    for name, (n, k) in FP8_GEMM[sizes(preset)].items():
        weight, scale = make.fp8_block_weight(n, k, FP8_BLOCK, device)
        dense = dequantize_fp8(weight, scale, FP8_BLOCK).to(dtype)
        copies = num_copies(weight.numel(), device)
        stored = [(weight, scale)] + [(weight.clone(), scale.clone()) for _ in range(copies - 1)]
        for m in gemm_rows(preset, few_rows_only=False):
            x = make.randn((m, k), dtype, device, make.generator(device, m))
            elem = x.element_size()
            yield KernelCase(kernel, dict(linear=name, m=m, n=n, k=k, block_size=list(FP8_BLOCK)),
                             {"foretell": KernelPath(cycle(lambda ws, x=x: fp8_linear(x, ws[0], ws[1], FP8_BLOCK), stored), True),
                              "torch": KernelPath(cycle(lambda ws, x=x: fp8_linear_torch(x, ws[0], ws[1], FP8_BLOCK), stored)),
                              "dense_linear": KernelPath(lambda x=x, w=dense: F.linear(x, w), True)},
                             "torch", bytes_per_call=n * k + scale.numel() * 4 + (m * k + m * n) * elem,
                             flops_per_call=2 * m * n * k, calls_per_run=copies,
                             notes={"cuda_path": fp8_path(m, dtype, FP8_BLOCK)})
        del stored


def pointwise_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    """One per-row op of a Llama decoder layer: the module or dispatch entry the layers call
    against its torch twin; bytes are the tensors read and written once."""
    from foretell.layers.norm import RMSNorm, rms_norm_torch
    from foretell.layers.rotary import RotaryEmbedding
    from foretell.ops.pointwise.dispatch import silu_and_mul
    from foretell.ops.pointwise.reference import apply_rope_neox, silu_and_mul_torch

    dims = POINTWISE[sizes(preset)]
    hidden, heads, kv_heads, head_dim = dims["hidden"], dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
    for tokens in (1, 5) if preset == "tiny" else (1, 64):
        gen = make.generator(device, tokens)
        shape = dict(num_tokens=tokens, **dims)
        if kernel == "rms_norm":
            norm = RMSNorm(hidden, 1e-5, dtype=dtype, device=device)
            x, residual = make.randn((tokens, hidden), dtype, device, gen), make.randn((tokens, hidden), dtype, device, gen)
            paths = {"foretell": KernelPath(lambda n=norm, x=x, r=residual: n(x, r), True),
                     "torch": KernelPath(lambda n=norm, x=x, r=residual: (rms_norm_torch(r + x, n.weight, n.eps), r + x),
                                         True)}
            num_bytes, flops = 4 * x.numel() * x.element_size(), 5 * x.numel()
        elif kernel == "rope":
            rotary = RotaryEmbedding(head_dim, 131072, 500000.0, LLAMA3_ROPE, device=device)
            qkv = make.randn((tokens, (heads + 2 * kv_heads) * head_dim), dtype, device, gen)
            q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views, as the model's
            k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
            positions = torch.randint(0, 131072, (tokens,), device=device, generator=gen)

            def rope_torch(rotary=rotary, positions=positions, q=q, k=k):
                cos, sin = rotary.cos_sin(positions)
                return apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)

            paths = {"foretell": KernelPath(lambda r=rotary, p=positions, q=q, k=k: r(p, q, k), True),
                     "torch": KernelPath(rope_torch, True)}
            num_bytes, flops = 2 * (q.numel() + k.numel()) * q.element_size(), 3 * (q.numel() + k.numel())
        else:
            gate_up = make.randn((tokens, 2 * dims["intermediate"]), dtype, device, gen)
            paths = {"foretell": KernelPath(lambda g=gate_up: silu_and_mul(g), True),
                     "torch": KernelPath(lambda g=gate_up: silu_and_mul_torch(g), True)}
            num_bytes, flops = 3 * gate_up.numel() // 2 * gate_up.element_size(), 3 * gate_up.numel()
        yield KernelCase(kernel, shape, paths, "torch", bytes_per_call=num_bytes, flops_per_call=flops)
