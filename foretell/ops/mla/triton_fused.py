"""Fused Triton kernels around MLA's latent attention: the small per-layer ops before and after
`mla_attention_triton`, a launch each instead of a chain of tiny ones.

  latent_write_triton   kv side, one program per token (triton_latent_write.py): RMSNorm of the
                        latent c (kv_a_layernorm), RoPE of the shared k_pe, and the write of
                        [c | k_pe] into the latent cache at slot_mapping (slot -1, a CUDA-graph
                        padding row, writes nothing). It reads the kv_a slice of fused_qkv_a_proj's
                        output in place (a strided view).
  absorb_query_triton   q side: q_lat = q_nope . W_UK per head and RoPE of q_pe, both written into
                        one buffer q_abs [T, heads, rank + rope] whose two slices are the
                        attention kernel's q_lat and q_pe.
  project_values_triton out = o_lat . W_UV^T per head (the absorbed form's value projection).

This module holds the q and value sides: the per-head matmul kernel they share and the two
launchers. The RoPE pieces all three use are in triton_rope.py.

At DeepSeek-V2-Lite's batch 1 the ops these replace were launch-bound: RMSNorm, RoPE, the cache
write and two batched cuBLAS matmuls, each a few microseconds of mostly launch latency, 27 layers
a step. The two matmuls run as tl.dot tiles over tokens (BLOCK_T x K x BLOCK_N per head) with a
float32 accumulator, so the same kernels serve decode and prefill chunks (the Triton MLA backend
sends every query length through the absorbed form). Past FUSED_ROPE_MAX_TOKENS tokens the q_pe
RoPE takes a second launch of its own (faster there than a branch of the matmul kernel).

On the H200 at V2-Lite sizes the three launches take well under the time of the five they
replace at T = 1; short prefill chunks are on par with the torch ops and long ones slower than
cuBLAS (the figures: docs/perf-log.md, "Figures moved from docstrings").

Twins in reference.py (the reference semantics, and what the CPU runs): `latent_write_torch` is
RMSNorm + RoPE + TorchMLABackend.write_kv, `absorb_query_torch` the einsum + rope, and
`project_values_torch` the einsum; tests/ops/test_mla_fused.py holds each pair together (in
Triton's interpreter on the CPU), tests/gpu/test_mla_fused_gpu.py on CUDA in bf16 and fp16.

Every kernel rounds where its twin rounds: the norm rounds the normalised row to the model dtype
before the weight multiply (RMSNorm's torch path); RoPE rounds cos/sin to the dtype, then each
product and each sum (apply_rope_neox / apply_rope_gptj); the matmuls accumulate in float32 and
round once (torch's einsum). On CUDA the compiler may still contract a RoPE product into an FMA
(about a quarter of the bf16 values on the H200 then differ from the twin's by one rounding of
the terms), and the norm's sum of squares runs in another order. Grids depend only on shapes and
nothing syncs with the host, so every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.triton_paged_launch import unit_last_stride
from foretell.ops.common.protocols import RotaryModule
from foretell.ops.mla.triton_rope import _rope_heads_kernel, _rope_tables, _rope_tile


# ---------------------------------------------------------------------- per-head matmuls


@triton.jit
def _head_matmul_tile(
    a_ptr,  # [num_tokens, num_heads, K] rows: a[t, h, k]
    b_ptr,  # per head a [K, N] operand at strides (stride_b_k, stride_b_n)
    num_tokens,
    head,
    t0,
    n0,
    stride_a_token,
    stride_a_head,
    stride_b_head,
    stride_b_k,
    stride_b_n,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BLOCK_T, BLOCK_N] float32 tile of a[t0:, head, :] . B[head][:, n0:]."""
    t = t0 + tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    t_ok = t < num_tokens
    n_ok = n < N
    a_rows = a_ptr + t.to(tl.int64)[:, None] * stride_a_token + head * stride_a_head
    b_cols = b_ptr + head * stride_b_head + n[None, :] * stride_b_n
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_b_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_tokens"])
def _head_matmul_kernel(
    a_ptr,  # [num_tokens, num_heads, K]
    b_ptr,  # per head [K, N] at (stride_b_k, stride_b_n)
    out_ptr,  # [num_tokens, num_heads, N (+ 2 * HALF with ROPE)]
    rope_in_ptr,  # [num_tokens, num_heads, 2 * HALF] (with ROPE)
    positions_ptr,  # [num_tokens] (with ROPE)
    cos_ptr,  # [max_positions, HALF] float32 (with ROPE)
    sin_ptr,
    num_tokens,
    stride_a_token,
    stride_a_head,
    stride_b_head,
    stride_b_k,
    stride_b_n,
    stride_out_token,
    stride_out_head,
    stride_rope_token,
    stride_rope_head,
    stride_cos,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE: tl.constexpr,  # one more column block per (token block, head) rotates the rope part
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    # Program (token block, head, column block); with ROPE the last column block is the rope.
    t0 = tl.program_id(0) * BLOCK_T
    head = tl.program_id(1).to(tl.int64)
    n0 = tl.program_id(2) * BLOCK_N
    if ROPE and n0 >= N:
        _rope_tile(
            rope_in_ptr, out_ptr + N, positions_ptr, cos_ptr, sin_ptr, num_tokens, head, t0,
            stride_rope_token, stride_rope_head, stride_out_token, stride_out_head, stride_cos,
            HALF, HALF_P, BLOCK_T, INTERLEAVED,
        )
    else:
        acc = _head_matmul_tile(
            a_ptr, b_ptr, num_tokens, head, t0, n0, stride_a_token, stride_a_head,
            stride_b_head, stride_b_k, stride_b_n, K, N, BLOCK_T, BLOCK_N, BLOCK_K, DOT_PRECISION,
        )
        t = t0 + tl.arange(0, BLOCK_T)
        n = n0 + tl.arange(0, BLOCK_N)
        out = out_ptr + t.to(tl.int64)[:, None] * stride_out_token + head * stride_out_head + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(t < num_tokens)[:, None] & (n < N)[None, :])


# Up to this many tokens the q_pe RoPE rides in absorb_query's matmul launch (one launch less at
# decode); past it a second launch (_rope_heads_kernel) is faster: on the H200 the token-rows
# rope tile took most of a prefill-sized launch.
FUSED_ROPE_MAX_TOKENS = 16


def head_matmul_config(num_tokens: int, k: int, n: int, dtype: torch.dtype) -> dict:
    """Tiles from shapes only. Decode (a few tokens) is a weight read of about 2 MB at V2-Lite's
    sizes: narrow column blocks spread it over the SMs, with the whole K range in flight
    (faster than cuBLAS in an H200 sweep at T = 1: docs/perf-log.md).
    Prefill gets large tiles: the A rows are re-read once per column block."""
    k_p = max(16, triton.next_power_of_2(k))
    if dtype.itemsize > 2:  # float32 runs on FMAs: small tiles keep it out of spills
        return {"BLOCK_T": 16, "BLOCK_N": 32, "BLOCK_K": min(k_p, 32), "num_warps": 4, "num_stages": 1}
    if num_tokens <= 16:
        if n >= 256:  # W_UK: N = kv_lora_rank, K = nope
            return {"BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": min(k_p, 128), "num_warps": 4, "num_stages": 1}
        return {"BLOCK_T": 16, "BLOCK_N": 16, "BLOCK_K": min(k_p, 256), "num_warps": 2, "num_stages": 3}
    return {"BLOCK_T": 64, "BLOCK_N": 128, "BLOCK_K": min(k_p, 64), "num_warps": 4, "num_stages": 3}


def _launch_head_matmul(a, b, b_strides, out, n, rope=None, config=None):
    """out[t, h, :n] = a[t, h, :] . B[h] with B[h][k, j] at b + h*s_h + k*s_k + j*s_n; `rope`
    (rope_in, positions, cos, sin, interleaved) adds the rope part at out[t, h, n:]."""
    num_tokens, num_heads, k = a.shape
    cfg = {**head_matmul_config(num_tokens, k, n, a.dtype), **(config or {})}
    n_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    if rope is not None:
        rope_in, positions, cos, sin, interleaved = rope
        half = rope_in.shape[-1] // 2
    else:  # unused pointers: any tensor of the right kind
        rope_in, positions, cos, sin, interleaved, half = out, a, out, out, False, 1
    grid = (triton.cdiv(num_tokens, cfg["BLOCK_T"]), num_heads, n_blocks + (rope is not None))
    _head_matmul_kernel[grid](
        a, b, out, rope_in, positions, cos, sin, num_tokens,
        a.stride(0), a.stride(1), *b_strides, out.stride(0), out.stride(1),
        rope_in.stride(0), rope_in.stride(1), cos.stride(0),
        K=k, N=n, BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        ROPE=rope is not None, HALF=half, HALF_P=triton.next_power_of_2(half), INTERLEAVED=interleaved,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _check_weight(name: str, w: torch.Tensor, shape: tuple, like: torch.Tensor) -> None:
    if tuple(w.shape) != shape or w.dtype != like.dtype or w.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {list(shape)} {like.dtype} with a unit last stride (a view of "
            f"kv_b_proj.weight, see split_kv_b); got {list(w.shape)} {w.dtype}, stride {w.stride()}"
        )


# ---------------------------------------------------------------------- q side


def _output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """`out` checked against shape / like's dtype (unit last stride), or a new buffer."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(shape)} {like.dtype} with a unit last stride, got "
                         f"{list(out.shape)} {out.dtype}, stride {out.stride()}")
    return out


def absorb_query_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, nope + rope], may be a strided view
    w_uk: torch.Tensor,  # [num_heads, nope, kv_lora_rank], a view of kv_b_proj.weight
    positions: torch.Tensor,  # [num_tokens] int
    rotary_emb: RotaryModule,  # rotary_dim == rope
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, kv_lora_rank + rope], unit last stride
    config: dict | None = None,  # overrides of head_matmul_config (benchmarks sweep these)
    fused_rope: bool | None = None,  # None: by token count (FUSED_ROPE_MAX_TOKENS); the batch-invariant mode fixes it
) -> torch.Tensor:  # q_abs [num_tokens, num_heads, kv_lora_rank + rope]: [q_lat | rotated q_pe]
    """q_lat = q_nope . W_UK per head and RoPE of q_pe, written side by side, one launch."""
    if q.dim() != 3 or w_uk.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, nope + rope] and w_uk [heads, nope, rank]; got "
                         f"{list(q.shape)} and {list(w_uk.shape)}")
    num_tokens, num_heads, qk_head_dim = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    rope = qk_head_dim - nope
    if rope <= 0 or rope % 2:
        raise ValueError(f"q is {qk_head_dim} wide per head but W_UK takes {nope} nope channels: the "
                         f"rope part ({rope}) must be even and positive")
    _check_weight("w_uk", w_uk, (num_heads, nope, rank), q)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {list(positions.shape)}")
    cos, sin = _rope_tables(rotary_emb, rope, q)
    out = _output_buffer(out, (num_tokens, num_heads, rank + rope), q)
    if num_tokens == 0:
        return out
    q = unit_last_stride(q)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    interleaved = rotary_emb.style == "gptj"
    w_uk_strides = (w_uk.stride(0), w_uk.stride(1), 1)  # B[h][k=d, j=r] = W_UK[h, d, r]
    if (num_tokens <= FUSED_ROPE_MAX_TOKENS) if fused_rope is None else fused_rope:
        rope_args = (q_pe, positions, cos, sin, interleaved)
        return _launch_head_matmul(q_nope, w_uk, w_uk_strides, out, rank, rope_args, config)
    _launch_head_matmul(q_nope, w_uk, w_uk_strides, out, rank, config=config)
    half, block_heads = rope // 2, min(16, triton.next_power_of_2(num_heads))
    q_pe_out = out[..., rank:]
    _rope_heads_kernel[(num_tokens, triton.cdiv(num_heads, block_heads))](
        q_pe, q_pe_out, positions, cos, sin,
        q_pe.stride(0), q_pe.stride(1), q_pe_out.stride(0), q_pe_out.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, HALF=half, HALF_P=triton.next_power_of_2(half), BLOCK_HEADS=block_heads,
        INTERLEAVED=interleaved, num_warps=2,
    )
    return out


def project_values_triton(
    o_lat: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
    w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank], a view of kv_b_proj.weight
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, v_head_dim], unit last stride
    config: dict | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    """out[t, h, :] = o_lat[t, h, :] . W_UV[h]^T, one launch."""
    if o_lat.dim() != 3 or w_uv.dim() != 3:
        raise ValueError(f"o_lat must be [tokens, heads, rank] and w_uv [heads, v, rank]; got "
                         f"{list(o_lat.shape)} and {list(w_uv.shape)}")
    num_tokens, num_heads, rank = o_lat.shape
    v_head_dim = w_uv.shape[1]
    _check_weight("w_uv", w_uv, (num_heads, v_head_dim, rank), o_lat)
    out = _output_buffer(out, (num_tokens, num_heads, v_head_dim), o_lat)
    if num_tokens == 0:
        return out
    o_lat = unit_last_stride(o_lat)
    # B[h][k=r, j=v] = W_UV[h, v, r]
    return _launch_head_matmul(o_lat, w_uv, (w_uv.stride(0), 1, w_uv.stride(1)), out, v_head_dim,
                               config=config)
