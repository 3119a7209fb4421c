"""What one decode / verify attention launch costs on the critical path of a batch-1 step.

The one-launch RoPE + attention (ops/attention/triton_rope_paged.py) sits between the qkv
and o projections of every layer; in the engine's graphs it spans about 9.5 us a layer at batch 1.
Here 32 launches (one cache per layer, Llama-3.1-8B shapes: 32 query heads, 8 kv heads, head_dim
128, block 16) run back to back in a CUDA graph, each launched with PDL like the engine's, so a
launch costs what it adds to the chain: from the previous launch's completion to its own. The
sweep varies what the launch configuration decides: the context splits launched (at most
triton_rope_paged.MAX_SPLITS, fewer when the block table is narrow), the fewest tokens per
split, the warps per program (splits64_warps4 is the engine before those two were measured). A
chain of 32 one-row RMSNorm launches gives the floor of a PDL launch in a chain.

    python scripts/bench_attention_chain.py OUT_DIR [--contexts 256 1024 4096]

Prints a table and writes OUT_DIR/bench_attention_chain.json (us per launch, median graph replay).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import graph_replay_ms, write_result  # noqa: E402
from foretell.ops.attention import triton_rope_paged as rope_attention  # noqa: E402
from foretell.ops.common.split_counters import SplitCounters  # noqa: E402
from foretell.layers.norm import RMSNorm  # noqa: E402
from foretell.layers.rotary import RotaryEmbedding  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 32, 8, 128, 16, 32
MAX_MODEL_LEN = 8192  # the block table's width, as the engine's graphs size it
DEVICE = torch.device("cuda")


def build_chain(context: int, q_len: int):
    """32 layers' worth of inputs for one sequence of `context` tokens, the last q_len new; returns
    a function that runs the 32 launches (keyword arguments go to every launch)."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    table = torch.randperm(blocks, device=DEVICE, generator=gen).to(torch.int32)[None, :]  # [1, W]
    positions = torch.arange(context - q_len, context, device=DEVICE)
    block_of = table[0, positions // BLOCK_SIZE].to(torch.int64)
    slots = block_of * BLOCK_SIZE + positions % BLOCK_SIZE
    seq_lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(LAYERS, q_len, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=dtype,
                      generator=gen)
    caches = [torch.randn(2, blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype, generator=gen)
              for _ in range(LAYERS)]
    rotary = RotaryEmbedding(HEAD_DIM, MAX_MODEL_LEN, 500000.0, None, "neox", device=DEVICE)
    counters = SplitCounters()
    q_width, kv_width = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM

    def run(**kwargs):
        for layer in range(LAYERS):
            x = qkv[layer]
            query = x[:, :q_width].view(q_len, NUM_HEADS, HEAD_DIM)
            key = x[:, q_width:q_width + kv_width].view(q_len, NUM_KV_HEADS, HEAD_DIM)
            value = x[:, q_width + kv_width:].view(q_len, NUM_KV_HEADS, HEAD_DIM)
            rope_attention.rope_paged_attention_triton(
                positions, query, key, value, rotary.cos_cache, rotary.sin_cache, caches[layer], slots, table,
                seq_lens, starts, q_len, HEAD_DIM ** -0.5, counters=counters, **kwargs)

    return run


def norm_chain():
    """32 one-row RMSNorm launches in a chain: the floor of a PDL launch."""
    norm = RMSNorm(4096, 1e-5, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)

    def run():
        y = x
        for _ in range(LAYERS):
            y = norm(y)[0]
    return run


def with_warps(num_warps: int):
    """rope_attention's launches of 16-bit tiles with another warp count."""
    return mock.patch.object(rope_attention, "WARPS_16_BIT", num_warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--contexts", type=int, nargs="*", default=[256, 1024, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention_chain.py needs a CUDA device")
    rows = {}
    with torch.inference_mode():
        floor = graph_replay_ms(norm_chain(), reps=50)[0] * 1000 / LAYERS
        print(f"rms norm chain (floor): {floor:6.2f} us a launch", flush=True)
        rows["norm_floor"] = floor
        for context in args.contexts:
            for q_len in (1, 4):
                run = build_chain(context, q_len)
                variants = {"engine": ({}, None), "splits64_warps4": ({"num_splits": 64}, 4), "warps4": ({}, 4)}
                for splits in (4, 8, 32, 64):
                    variants[f"splits{splits}"] = ({"num_splits": splits}, None)
                for tokens in (64, 128):
                    variants[f"min_split{tokens}"] = ({"min_split_tokens": tokens}, None)
                for name, (kwargs, warps) in variants.items():
                    try:
                        with with_warps(warps) if warps else contextlib.nullcontext():
                            us = graph_replay_ms(lambda: run(**kwargs), reps=50)[0] * 1000 / LAYERS
                    except Exception as error:  # a configuration this Triton cannot build: say so, go on
                        print(f"context {context} q={q_len} {name}: failed ({type(error).__name__}: {error})")
                        continue
                    rows.setdefault(f"ctx{context}_q{q_len}", {})[name] = us
                    print(f"context {context:5d} q={q_len} {name:16s} {us:6.2f} us a launch", flush=True)
    write_result(args.out_dir, "bench_attention_chain", "bench_attention_chain", {"us_per_launch": rows})


if __name__ == "__main__":
    main()
