"""The attention backend interface and the choice of backend (the attention op's dispatch).

A backend does two things over a paged cache: write this step's new keys/values into their slots,
and attend each sequence's queries to its whole context (cached prefix + new tokens), causally.
It never decides anything about scheduling; everything it needs is in AttentionMetadata.

GQA cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), in
the model's dtype or e4m3 with per-layer scales (fp8_kv.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend


class AttentionBackend(Protocol):
    name: str
    #: Whether a forward using it can be captured in a CUDA graph and replayed for other
    #: lengths (true when it reads no host-side lengths).
    graph_safe: bool
    #: Whether it has `rope_attend`: RoPE (after Qwen3's q_norm / k_norm), the KV write and the
    #: attention in one or two launches (TritonAttentionBackend.rope_attend).
    fuses_rope: bool

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k_scale: float = 1.0,  # an FP8 cache (fp8_kv.py) stores key / k_scale, value / v_scale
        v_scale: float = 1.0,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # an FP8 cache's entries stand for stored * scale
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def build_attention_backend(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    """Pick a backend by name. "auto" is Triton on CUDA when Triton imports, else torch.
    batch_invariant (ModelConfig.batch_invariant): that backend's batch-invariant form
    (batch_invariant.py, triton_batch_invariant.py), whose rows do not depend on their step."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if batch_invariant and name in ("torch", "triton"):
        return build_batch_invariant_backend(name)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from foretell.ops.attention.triton_backend import TritonAttentionBackend  # imports triton

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected one of: auto, torch, triton")


def build_batch_invariant_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from foretell.ops.attention.triton_batch_invariant import BatchInvariantTritonAttention  # imports triton

        return BatchInvariantTritonAttention()
    from foretell.ops.attention.batch_invariant import BatchInvariantTorchAttention

    return BatchInvariantTorchAttention()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
