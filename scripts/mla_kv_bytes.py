"""KV cache bytes per token: MLA's latent cache against an uncompressed cache, at the published
DeepSeek-V3 and Kimi-K2.5 shapes, computed from the configs and checked against the allocator.

    python scripts/mla_kv_bytes.py [--dtype bfloat16]

"uncompressed" is what the same attention needs when keys and values are cached per head:
K = heads x (qk_nope 128 + qk_rope 64), V = heads x v_head_dim 128. "padded" is the layout of
engines that cache K and V at one head size (V padded to 192), e.g. a plain GQA cache.
The check builds the real cache-owning layers (LatentAttention, Attention) at those shapes and
asks foretell.runner.kv_cache.plan_cache for its per-token bytes and the tokens a budget holds.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from foretell.layers.attention.layer import Attention
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.layers.mla import LatentAttention, MLADims
from foretell.runner.kv_cache import plan_cache

# From the published config.json files (DeepSeek-V3 / R1; Kimi-K2.5's text_config).
MODELS = {
    "DeepSeek-V3": dict(layers=61, heads=128, hidden=7168, mtp_layers=1),
    "Kimi-K2.5": dict(layers=61, heads=64, hidden=7168, mtp_layers=0),
}
KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD = 512, 128, 64, 128
# lightseekorg/kimi-k2.5-eagle3 (third-party): one Llama layer, 64 kv heads of 128.
EAGLE3_KIMI = dict(kv_heads=64, head_dim=128)
BUDGET = 64 << 30  # a 64 GiB cache budget, to show tokens held


class PerHeadKV(nn.Module):
    """Cache-shape stand-in for uncompressed MLA: per head K (nope + rope) and V, side by side."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.heads, QK_NOPE + QK_ROPE + V_HEAD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    backend = TorchAttentionBackend()
    print(f"KV cache bytes per token ({args.dtype}, {elem} B/value); tokens held by a "
          f"{BUDGET >> 30} GiB budget")
    header = f"{'model':<12} {'cache':<26} {'values/tok/layer':>16} {'B/tok/layer':>12} {'B/tok':>12} {'tokens':>12} {'vs MLA':>7}"
    print(header)
    print("-" * len(header))
    for name, m in MODELS.items():
        dims = MLADims(m["hidden"], m["heads"], 1536, KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD)
        layouts = {
            "MLA latent (c + k_pe)": ([LatentAttention(dims, 1.0) for _ in range(m["layers"])],
                                      KV_LORA_RANK + QK_ROPE),
            "uncompressed K|V": ([PerHeadKV(m["heads"]) for _ in range(m["layers"])],
                                 m["heads"] * (QK_NOPE + QK_ROPE + V_HEAD)),
            "padded GQA (V at 192)": ([Attention(m["heads"], QK_NOPE + QK_ROPE, m["heads"], 1.0, backend)
                                       for _ in range(m["layers"])],
                                      2 * m["heads"] * (QK_NOPE + QK_ROPE)),
        }
        mla_bytes = None
        for label, (layers, values) in layouts.items():
            plan = plan_cache(BUDGET, None, layers, dtype, args.block_size)
            arithmetic = values * elem * m["layers"]
            if plan.target_bytes_per_token != arithmetic:
                raise SystemExit(f"{name} {label}: allocator says {plan.target_bytes_per_token} B/token, "
                                 f"arithmetic {arithmetic}")
            expected_tokens = BUDGET // (arithmetic * args.block_size) * args.block_size
            if plan.num_tokens != expected_tokens:
                raise SystemExit(f"{name} {label}: allocator holds {plan.num_tokens} tokens, expected {expected_tokens}")
            mla_bytes = mla_bytes or arithmetic
            print(f"{name:<12} {label:<26} {values:>16,} {values * elem:>12,} {arithmetic:>12,} "
                  f"{plan.num_tokens:>12,} {arithmetic / mla_bytes:>6.1f}x")
        latent_layers = layouts["MLA latent (c + k_pe)"][0]
        if m["mtp_layers"]:
            mtp = [LatentAttention(dims, 1.0) for _ in range(m["mtp_layers"])]
            plan = plan_cache(BUDGET, None, latent_layers, dtype, args.block_size, mtp)
            print(f"{name:<12} {'+ MTP draft cache':<26} {'':>16} {'':>12} "
                  f"{plan.target_bytes_per_token + plan.draft_bytes_per_token:>12,} {plan.num_tokens:>12,}")
        else:
            head = [Attention(EAGLE3_KIMI["kv_heads"], EAGLE3_KIMI["head_dim"], EAGLE3_KIMI["kv_heads"], 1.0, backend)]
            plan = plan_cache(BUDGET, None, latent_layers, dtype, args.block_size, head)
            assert plan.draft_bytes_per_token == 2 * math.prod(EAGLE3_KIMI.values()) * elem
            print(f"{name:<12} {'+ EAGLE3 head cache':<26} {'':>16} {plan.draft_bytes_per_token:>12,} "
                  f"{plan.target_bytes_per_token + plan.draft_bytes_per_token:>12,} {plan.num_tokens:>12,}")
    print("all per-token sizes agree with plan_cache")


if __name__ == "__main__":
    main()
