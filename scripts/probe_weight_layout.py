"""Does where the weights sit in device memory change the batch-1 decode graph's time?

The tenth session saw one decode graph replay at about 4.00 or about 4.09 ms, by process and
machine, with identical outputs. This probe times, in one process (Llama-3.1-8B shape, random bf16
weights, context 256): the engine's captured graph and a fresh capture of the same forward; then
moves every weight of the target into one contiguous allocation (the old tensors kept alive, so
the engine's graph still reads them) and times both again: the engine graph reads the old layout,
the fresh capture the packed one. Run it under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for the allocator's other way of mapping memory.

    python scripts/probe_weight_layout.py OUT_DIR [--label NAME] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from bench_result import graph_replay_ms, replay_ms, write_result  # noqa: E402
from foretell import LLM  # noqa: E402

ALIGN = 256


def pack_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter's data moved into one allocation, in the module's order; returns the old
    tensors (kept alive by the caller)."""
    params = list(model.parameters())
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=params[0].device)
    old, offset = [], 0
    for p, size in zip(params, sizes):
        view = flat[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        old.append(p.data)
        p.data = view
        offset += size
    torch.cuda.synchronize()
    return old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--label", default="default allocator")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(os.path.join(ROOT, "foretell", "configs", "llama-3.1-8b"), dtype="bfloat16", device="cuda",
              load_format="dummy", skip_tokenizer_init=True, log_stats_interval_s=0, max_num_seqs=1)
    runner = llm.engine.runner
    graphs = runner.graphs
    rows = []
    with torch.inference_mode():
        graphs.prepare_replay((1, 1), args.context)
        engine_graph = graphs.graphs[(1, 1)].graph

        def measure(layout: str) -> None:
            for _ in range(args.rounds):
                engine = replay_ms(engine_graph, reps=50)
                fresh = graph_replay_ms(lambda: graphs._forward(1, 1), reps=50)[0]
                rows.append({"weights": layout, "engine_graph_ms": engine, "fresh_capture_ms": fresh})
                print(f"{args.label} | {layout:8} | engine graph {engine:.3f} ms | fresh capture {fresh:.3f} ms", flush=True)

        measure("as loaded")
        kept = pack_weights(runner.model)
        measure("packed")
        del kept
    write_result(args.out_dir, f"probe_weight_layout_{args.label.replace(' ', '_').replace(':', '_')}",
                 "decode graph replay against the weights' layout", {"label": args.label, "rows": rows})


if __name__ == "__main__":
    main()
