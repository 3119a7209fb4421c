"""Time an EAGLE3 head's catch-up over prompt rows that draft nothing: the whole layer (what it ran
before issue 28's change), Eagle3Head.cache_kv with the whole q|k|v projection, and cache_kv with
the k|v rows multiplied alone (layers/attention/kv_only.py; the default on CUDA), plus fc alone.

    python scripts/time_eagle3_catch_up.py [--seqs 16] [--rows 128] [--threads 1] [--reps 30]
        [--shape default|llama8b]

--shape default: the default family's head (foretell/default_models/qwen3-eagle3) as the engine
runs it on the CPU (float32, its packed draft weights), inside a one-engine LLM. --shape llama8b:
the Llama-3.1-8B head's shape (foretell/configs/llama-3.1-8b-eagle3, bf16, random weights, Triton
attention) on CUDA. Prints the median and minimum of --reps calls of each, in ms (CUDA: events
around each call after a synchronize).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from foretell.layers.attention import kv_only
from foretell.spec_decode.proposer import catch_up_metadata

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def default_head(threads: int):
    from foretell import LLM
    from foretell.defaults import default_speculative_config, default_target

    llm = LLM(default_target(), dtype="float32", device="cpu", num_kv_blocks=512, max_num_seqs=16,
              num_cpu_threads=threads, speculative_config=default_speculative_config())
    proposer = llm.engine.runner.proposer
    return proposer.head, proposer.draft_block_size, proposer.target_hidden, llm


def llama8b_head():
    from foretell.models.base import HFConfig, ModelOptions
    from foretell.models.eagle3 import Eagle3Head
    from foretell.ops.attention.triton_backend import TritonAttentionBackend

    with open(os.path.join(ROOT, "foretell", "configs", "llama-3.1-8b-eagle3", "config.json")) as f:
        config = json.load(f)
    device = torch.device("cuda")
    head = Eagle3Head(HFConfig(config), config["target_hidden_size"], 8192,
                      ModelOptions(torch.bfloat16, device, TritonAttentionBackend()), has_embed=True, has_lm_head=True)
    with torch.no_grad():
        for p in head.parameters():
            if p.dtype.is_floating_point and p.dim():
                p.normal_(std=0.02)
    attn = head.attention_layers()[0]
    attn.bind_kv_cache(torch.zeros(attn.kv_cache_shape(4096, 16), dtype=torch.bfloat16, device=device))
    return head.eval(), 16, config["target_hidden_size"], None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shape", choices=["default", "llama8b"], default="default")
    args = ap.parse_args()
    head, block_size, target_hidden, _keep = default_head(args.threads) if args.shape == "default" else llama8b_head()
    if args.shape == "default":
        torch.set_num_threads(args.threads)
    device = head.fc.weight.device
    per_seq = -(-args.rows // block_size)
    table = torch.arange(args.seqs * per_seq, dtype=torch.int32, device=device).view(args.seqs, per_seq)
    meta = catch_up_metadata([0] * args.seqs, [args.rows] * args.seqs, table, block_size, block_size)
    n = args.seqs * args.rows
    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, head.vocab_size, (n,), generator=gen, device=device)
    positions = torch.arange(args.rows, device=device).repeat(args.seqs)
    aux = [torch.randn(n, target_hidden, generator=gen, device=device).to(head.fc.weight.dtype) for _ in range(3)]
    rows_alone = kv_only.multiplies_rows_alone

    def kv_with(alone: bool):
        def run():
            kv_only.multiplies_rows_alone = lambda linear, x: alone
            try:
                head.cache_kv(ids, positions, head.combine(aux), meta)
            finally:
                kv_only.multiplies_rows_alone = rows_alone
        return run

    cases = {
        "whole layer": lambda: head(ids, positions, head.combine(aux), meta),
        "kv only, whole qkv": kv_with(False),
        "kv only, k|v rows": kv_with(True),
        "fc alone": lambda: head.combine(aux),
    }
    cuda = device.type == "cuda"
    print(f"{args.shape} head, {args.seqs} x {args.rows} rows, {head.fc.weight.dtype}, {device}"
          + ("" if cuda else f", {torch.get_num_threads()} thread(s), fc GEMM {type(head.fc.small_m).__name__}"))
    results: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            for _ in range(3):
                fn()
        for _ in range(args.reps):  # interleaved: a noisy neighbour hits every case alike
            for name, fn in cases.items():
                if cuda:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    torch.cuda.synchronize()
                    results[name].append(start.elapsed_time(end))
                else:
                    t = time.perf_counter()
                    fn()
                    results[name].append((time.perf_counter() - t) * 1e3)
    for name, times in results.items():
        times.sort()
        print(f"  {name:20s} median {times[len(times) // 2]:8.3f} ms   min {times[0]:8.3f} ms")


if __name__ == "__main__":
    main()
