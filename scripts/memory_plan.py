"""On paper: DeepSeek-V3 and Kimi-K2.5 on 8 H200s with foretell's tensor / expert parallelism.

    python scripts/memory_plan.py [--gpus 8] [--gpu-gib 139.8] [--utilization 0.9]

For each model, in its shipped precision, per GPU: weight bytes (what each rank holds under
foretell's split: MLA's q_b / kv_b / o and every MLP split, q_a / kv_a and the router replicated,
experts split inside each expert (TP) or partitioned (EP: the same bytes), embedding and LM head
split by vocabulary, the MTP layer like the target's layers, an EAGLE3 head replicated), KV bytes
per token (MLA's latent cache is replicated on every rank: it does not shrink with TP), the tokens
the rest of the GPU holds, the longest context and the batch at 8k / 32k contexts, and the bytes of
the collectives per decode and verify step. Shapes are the published configs' (see
shared notes: checkpoint formats). No torch needed.
"""

from __future__ import annotations

import argparse

GIB = 1 << 30
ACTIVATION_RESERVE = 2 * GIB  # the engine keeps this back for activations (model_runner)

# Published shapes (DeepSeek-V3 / R1 config.json; Kimi-K2.5 text_config).
MODELS = {
    "DeepSeek-V3": dict(layers=61, dense_layers=3, hidden=7168, heads=128, q_lora=1536, kv_lora=512,
                        nope=128, rope=64, v=128, inter=18432, moe_inter=2048, experts=256,
                        shared=1, vocab=129280, mtp_layers=1, experts_format="fp8", dense_format="fp8"),
    "Kimi-K2.5": dict(layers=61, dense_layers=1, hidden=7168, heads=64, q_lora=1536, kv_lora=512,
                      nope=128, rope=64, v=128, inter=18432, moe_inter=2048, experts=384,
                      shared=1, vocab=163840, mtp_layers=0, experts_format="int4", dense_format="bf16"),
}
# lightseekorg/kimi-k2.5-eagle3 (third-party, unverified): one Llama layer, H 7168, I 12288,
# 64 q / 64 kv heads of 128, vocab 163840 with its own embedding and LM head.
EAGLE3_KIMI = dict(hidden=7168, inter=12288, heads=64, kv_heads=64, head_dim=128, vocab=163840)

# Bytes per parameter: FP8 e4m3 with an fp32 scale per 128x128 block; int4 packed 8 to an int32
# with a bf16 scale per group of 32 (compressed-tensors pack-quantized).
BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "int4": 0.5 + 2 / 32}


def layer_params(m: dict, moe: bool) -> dict[str, float]:
    """Parameters of one decoder layer by how they are split: 'split' (divided by the ranks),
    'replicated' (whole on every rank), 'experts' (divided by the ranks, TP or EP alike)."""
    h, nh = m["hidden"], m["heads"]
    attn_split = m["q_lora"] * nh * (m["nope"] + m["rope"]) + m["kv_lora"] * nh * (m["nope"] + m["v"]) \
        + nh * m["v"] * h
    attn_replicated = h * m["q_lora"] + h * (m["kv_lora"] + m["rope"])  # q_a, kv_a
    if not moe:
        return {"attn_split": attn_split, "attn_replicated": attn_replicated, "mlp_split": 3 * h * m["inter"],
                "router": 0, "experts": 0}
    return {"attn_split": attn_split, "attn_replicated": attn_replicated,
            "mlp_split": 3 * h * m["moe_inter"] * m["shared"], "router": m["experts"] * h,
            "experts": 3 * h * m["moe_inter"] * m["experts"]}


def weight_bytes_per_gpu(m: dict, gpus: int) -> dict[str, float]:
    dense, experts = BYTES[m["dense_format"]], BYTES[m["experts_format"]]
    total = {"attention + MLP": 0.0, "routed experts": 0.0, "embedding + head": 0.0}
    for i in range(m["layers"] + m["mtp_layers"]):
        p = layer_params(m, moe=i >= m["dense_layers"])
        total["attention + MLP"] += (p["attn_split"] + p["mlp_split"]) * dense / gpus
        total["attention + MLP"] += p["attn_replicated"] * dense + p["router"] * BYTES["bf16"]
        total["routed experts"] += p["experts"] * experts / gpus
    heads = 2 + 2 * m["mtp_layers"]  # embedding and LM head; an MTP layer ships its own copies
    total["embedding + head"] = heads * m["vocab"] * m["hidden"] * BYTES["bf16"] / gpus
    total["embedding + head"] += m["mtp_layers"] * 2 * m["hidden"] * m["hidden"] * dense / gpus  # eh_proj
    return total


def eagle3_bytes(e: dict) -> tuple[float, float]:
    """An EAGLE3 head replicated on every rank: weights, and its KV bytes per token."""
    h, d = e["hidden"], e["head_dim"]
    params = (3 * h * h                                      # fc: three aux hidden states -> h
              + 2 * h * (e["heads"] + 2 * e["kv_heads"]) * d  # q, k, v read [embedding | hidden]
              + e["heads"] * d * h                           # o
              + 3 * h * e["inter"]                           # gate, up, down
              + 2 * e["vocab"] * h)                          # embedding and LM head
    return params * BYTES["bf16"], 2 * e["kv_heads"] * d * BYTES["bf16"]


def kv_bytes_per_token(m: dict) -> float:
    return (m["layers"] + m["mtp_layers"]) * (m["kv_lora"] + m["rope"]) * BYTES["bf16"]


def collective_bytes(m: dict, tokens: int) -> tuple[int, float]:
    """All-reduces per step and their payload: after attention and after the MLP / MoE in every
    layer, after the vocabulary-parallel embedding; bf16 [tokens, hidden] each."""
    count = 2 * (m["layers"]) + 1
    return count, count * tokens * m["hidden"] * BYTES["bf16"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-gib", type=float, default=139.8, help="device memory torch reports on an H200")
    p.add_argument("--utilization", type=float, default=0.90, help="gpu_memory_utilization")
    args = p.parse_args()
    usable = args.gpu_gib * GIB * args.utilization - ACTIVATION_RESERVE
    print(f"{args.gpus} GPUs of {args.gpu_gib} GiB, utilization {args.utilization}, "
          f"{ACTIVATION_RESERVE / GIB:.0f} GiB kept for activations\n")
    print("| model | weights / GPU (GiB) | of which experts | KV B/token/GPU | KV tokens / GPU "
          "| batch at 8k | batch at 32k | all-reduces / step | payload B, decode (1 token) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in MODELS.items():
        w = weight_bytes_per_gpu(m, args.gpus)
        weights = sum(w.values())
        kv = kv_bytes_per_token(m)
        extra = ""
        if name == "Kimi-K2.5":
            head, head_kv = eagle3_bytes(EAGLE3_KIMI)
            weights += head
            kv += head_kv
            extra = " + EAGLE3 head"
        tokens = int((usable - weights) // kv)
        count, payload = collective_bytes(m, 1)
        print(f"| {name}{extra} | {weights / GIB:.1f} | {w['routed experts'] / GIB:.1f} | {kv:,.0f} "
              f"| {tokens:,} | {tokens // 8192} | {tokens // 32768} | {count} | {payload:,.0f} |")
    print("\nA verify of k + 1 tokens per sequence multiplies the payload by k + 1 (the count stays);")
    print("a ring all-reduce sends 2 (n - 1) / n of the payload from each GPU.")


if __name__ == "__main__":
    main()
