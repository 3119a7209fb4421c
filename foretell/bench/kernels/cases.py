"""The kernels `foretell bench kernels` times, each at the shapes of the models that run it.

A KernelCase is one shape of one kernel: its paths (the engine's entry point, "foretell", which
runs the Triton kernel on CUDA and the torch twin elsewhere; the plain-torch twin, "torch"; and
whatever the kernel replaces, e.g. cuBLAS at bf16), the path the others are checked against, and
the bytes and floating-point operations of one call (counted from the shapes: the least a call
must read and write, and the multiply-adds x 2). On CUDA each path's run cycles over enough copies
of the weights or caches to outsize L2 (at most MAX_COPIES), as a step's layers do; times are per
call. Builders are generators: a case's tensors go before the next case's are made.

Presets: "full" (the model shapes of BENCHMARKS.md), "quick" (fewer batches), "tiny" (the same
cases at toy widths, for the CPU and tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from foretell.bench.kernels import inputs as make
from foretell.ops.common.kernel_choice import use_triton

PRESETS = ("full", "quick", "tiny")
L2_OUTSIZE_BYTES = 384 << 20  # well past the 50-60 MiB L2 of an H100 / H200
MAX_COPIES = 32

# Llama-3.1-8B's attention, MLP and linear shapes; DeepSeek-V2-Lite / V3 MLA and experts; Kimi-K2.5's
# int4 experts; DeepSeek-V3's FP8 linears. "tiny" rows keep the structure at toy widths.
ATTENTION = {"model": dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16),
             "tiny": dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)}
MLA = {"model": dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, block_size=16),
       "tiny": dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, block_size=16)}
MLA_HEADS = {"model": {"V2-Lite": 16, "V3": 128}, "tiny": {"tiny": 4}}
MOE = {"model": dict(num_experts=64, top_k=6, hidden=2048, intermediate=1408),  # DeepSeek-V2-Lite
       "tiny": dict(num_experts=8, top_k=2, hidden=64, intermediate=32)}
# Kimi-K2.5's expert widths and top-8; 64 of its 384 experts (a call reads only the chosen ones).
MOE_INT4 = {"model": dict(num_experts=64, top_k=8, hidden=7168, intermediate=2048),
            "tiny": dict(num_experts=8, top_k=2, hidden=64, intermediate=64)}
GEMM = {"model": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
        "tiny": {"qkv": (96, 64), "down": (64, 128)}}
FP8_GEMM = {"model": {"q_b": (24576, 1536), "o": (7168, 16384), "shared_gate_up": (4096, 7168),
                      "shared_down": (7168, 2048)},
            "tiny": {"tiny": (256, 384)}}
FP8_BLOCK = (128, 128)
POINTWISE = {"model": dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate=14336),
             "tiny": dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96)}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@dataclass
class KernelPath:
    run: Callable[[], Any]  # one timed run (calls_per_run calls); returns the last call's output
    graph_safe: bool = False  # may be captured in a CUDA graph and replayed


@dataclass
class KernelCase:
    kernel: str
    shape: dict[str, Any]
    paths: dict[str, KernelPath]
    reference: str  # the path whose output the others are compared with
    bytes_per_call: int
    flops_per_call: int
    calls_per_run: int = 1
    notes: dict[str, Any] = field(default_factory=dict)


def sizes(preset: str) -> str:
    return "tiny" if preset == "tiny" else "model"


def num_copies(bytes_per_copy: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_COPIES, L2_OUTSIZE_BYTES // max(1, bytes_per_copy)))


def cycle(fn: Callable[[Any], Any], copies: list[Any]) -> Callable[[], Any]:
    """A run that calls fn on every copy; returns the last output."""
    def run():
        out = None
        for item in copies:
            out = fn(item)
        return out
    return run


def visible_keys(context: int, query_len: int) -> int:
    """Keys the query rows of one sequence attend to in all (causal, the queries last)."""
    return query_len * (context - query_len + 1) + query_len * (query_len - 1) // 2


# ------------------------------------------------------------------------------- attention

def attention_grid(kernel: str, preset: str) -> list[tuple[int, int, int]]:
    """(batch, context, query_len) of each case."""
    if preset == "tiny":
        return [(1, 24, 24)] if kernel == "attention_prefill" else [(b, 40, 1 if kernel == "attention_decode" else 4)
                                                                     for b in (1, 3)]
    if kernel == "attention_prefill":
        return [(1, c, c) for c in ((1024,) if preset == "quick" else (1024, 4096))]
    batches = (1, 64) if preset == "quick" else (1, 16, 64)
    q = 1 if kernel == "attention_decode" else 4
    return [(b, c, q) for b in batches for c in (1024, 4096)]


def attention_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    from foretell.ops.attention.dispatch import build_attention_backend
    from foretell.ops.attention.reference import TorchAttentionBackend

    dims = ATTENTION[sizes(preset)]
    heads, kv_heads, head_dim = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
    backend, reference = build_attention_backend("auto", device), TorchAttentionBackend()
    for batch, context, q_len in attention_grid(kernel, preset):
        data = make.paged_attention_inputs(batch, context, q_len, dtype=dtype, device=device, **dims)
        elem = data.kv_cache.element_size()
        kv_bytes = 2 * batch * context * kv_heads * head_dim * elem
        copies = num_copies(kv_bytes, device)
        caches = [data.kv_cache] + [data.kv_cache.clone() for _ in range(copies - 1)]
        query, md, scale = data.query, data.metadata, head_dim**-0.5
        dense = [dense_kv(cache, md) for cache in caches]
        paths = {
            "foretell": KernelPath(cycle(lambda c, q=query, md=md: backend.attend(q, c, md, scale), caches),
                                   backend.graph_safe),
            "torch": KernelPath(cycle(lambda c, q=query, md=md: reference.attend(q, c, md, scale), caches)),
            "sdpa_dense": KernelPath(cycle(lambda kv, q=query, md=md: sdpa(q, kv, md, scale), dense), True),
        }
        yield KernelCase(kernel, dict(batch=batch, context=context, query_len=q_len, **dims), paths, "torch",
                         bytes_per_call=kv_bytes + 2 * query.numel() * elem,
                         flops_per_call=4 * heads * head_dim * batch * visible_keys(context, q_len),
                         calls_per_run=copies, notes={"backend": backend.name})


def dense_kv(cache: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged context copied out to K and V [batch, kv_heads, context, head_dim] for SDPA (its
    best case: no paging)."""
    table = md.block_table.long()  # [batch, blocks]
    k = cache[0][table].flatten(1, 2)[:, :md.max_seq_len].transpose(1, 2).contiguous()
    v = cache[1][table].flatten(1, 2)[:, :md.max_seq_len].transpose(1, 2).contiguous()
    return k, v


def sdpa(query: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], md, scale: float) -> torch.Tensor:
    k, v = kv
    batch, q_len, context = md.num_seqs, md.max_query_len, md.max_seq_len
    q = query.view(batch, q_len, *query.shape[1:]).transpose(1, 2)  # [batch, heads, q_len, head_dim]
    key_pos = torch.arange(context, device=query.device)
    query_pos = torch.arange(context - q_len, context, device=query.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, context]: causal, queries last
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(query.shape)


# ------------------------------------------------------------------------------------- MLA

def mla_cases(kernel: str, preset: str, device: torch.device, dtype: torch.dtype) -> Iterator[KernelCase]:
    from foretell.ops.mla.dispatch import build_mla_backend
    from foretell.ops.mla.reference import TorchMLABackend

    dims = MLA[sizes(preset)]
    rank, rope, nope, v_dim = (dims[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    if preset == "tiny":
        grid = [(b, 40, 1 if kernel == "mla_decode" else 4) for b in (1, 3)]
    elif kernel == "mla_decode":
        grid = [(b, c, 1) for b in ((1, 64) if preset == "quick" else (1, 16, 64)) for c in (1024, 4096)]
    else:
        grid = [(b, 4096, 4) for b in ((1,) if preset == "quick" else (1, 16))]
    reference = TorchMLABackend()
    for model, heads in MLA_HEADS[sizes(preset)].items():
        for batch, context, q_len in grid:
            data = make.latent_attention_inputs(batch, context, q_len, heads, dtype=dtype, device=device, **dims)
            backend = build_mla_backend("triton" if use_triton(data.kv_cache) else "torch")
            elem = data.kv_cache.element_size()
            latent_bytes = batch * context * (rank + rope) * elem
            copies = num_copies(latent_bytes, device)
            caches = [data.kv_cache] + [data.kv_cache.clone() for _ in range(copies - 1)]
            scale = (nope + rope) ** -0.5

            def attend(cache, backend=backend, data=data, scale=scale):
                return backend.attend(data.q_nope, data.q_pe, data.kv_b_weight, cache, data.metadata, scale, v_dim)

            def attend_torch(cache, data=data, scale=scale):
                return reference.attend(data.q_nope, data.q_pe, data.kv_b_weight, cache, data.metadata, scale, v_dim)

            rows = batch * q_len * heads
            # Absorbed form: q_nope W_UK, scores over [c | k_pe], the weighted sum of c, then W_UV.
            flops = 2 * rows * (nope * rank + rank * v_dim) + 2 * heads * (2 * rank + rope) * batch * visible_keys(context, q_len)
            yield KernelCase(kernel, dict(model=model, heads=heads, batch=batch, context=context, query_len=q_len, **dims),
                             {"foretell": KernelPath(cycle(attend, caches), True),
                              "torch": KernelPath(cycle(attend_torch, caches))},
                             "torch", bytes_per_call=latent_bytes + data.kv_b_weight.numel() * elem,
                             flops_per_call=flops, calls_per_run=copies,
                             notes={"backend": type(backend).__name__})
