"""Tensor parallelism on 2 GPUs (issue 24), in one process (the engine starts its own workers: no
torchrun):

    python scripts/check_tp_gpu.py OUT_DIR [--model DIR] [--eagle3 DIR] [--max-tokens 64] [--dtype float32]
    python scripts/check_tp_gpu.py OUT_DIR --device cpu --max-tokens 4   # the script's own smoke
                                                     # test: gloo ranks, always eager

1. equality (float32 by default, --dtype): greedy tokens of tensor_parallel_size=2 equal
   tensor_parallel_size=1's, token for token, with CUDA graphs off (enforce_eager) and on (NCCL
   ranks capture their collectives: foretell/distributed/graph_capture.py), plain and with
   EAGLE3 k=3 (the head whole on each rank).
   Each TP=2 engine reports what its ranks decided (graphs captured, steps queued ahead, why).
2. decode timing: ms per decode step and tokens/s at batch 1 and 8 for TP=1 (graphs), TP=2 eager
   and TP=2 graphs: (time of max_tokens + 1 tokens - time of 1 token) / max_tokens, the prefill
   taken out.
Defaults: the shipped default family's target and EAGLE3 head (4 heads, 2 KV heads: both divide
by 2). Writes OUT_DIR/check_tp_gpu.json and prints a short table; exits 1 when an equality fails.

NCCL here never uses NVLink multicast: NCCL_NVLS_ENABLE=0 is set before any worker starts (the
workers inherit this process's environment).
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before torch or any worker: never NVLink multicast

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.engine_probe import parallel_graph_state  # noqa: E402
from foretell.defaults import member_path  # noqa: E402
from foretell.device_util import release_cached_device_memory  # noqa: E402

PROMPTS = [[(37 * i + 11 * j + 5) % 4000 + 10 for j in range(12 + 5 * i)] for i in range(8)]
ENGINE = {"cuda": dict(num_kv_blocks=2048, max_model_len=1024, gpu_memory_utilization=0.5),
          "cpu": dict(num_kv_blocks=256, max_model_len=512)}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def decode_ms(llm: LLM, batch: int, max_tokens: int) -> float:
    """ms per decode step at this batch (the median of 3, prefill taken out)."""
    prompts = PROMPTS[:batch]
    runs = []
    for _ in range(3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens(llm, prompts, 1)
        t1 = time.perf_counter()
        tokens(llm, prompts, max_tokens + 1)
        t2 = time.perf_counter()
        runs.append(1e3 * ((t2 - t1) - (t1 - t0)) / max_tokens)
    return sorted(runs)[1]


def engine(model: str, tp: int, eager: bool, spec: dict | None, device: str, dtype: str) -> LLM:
    return LLM(model, tensor_parallel_size=tp, enforce_eager=eager, speculative_config=spec, device=device,
               dtype=dtype, **ENGINE[device])


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens equal up to each prompt's first difference (1.0: identical)."""
    same = 0
    for a, b in zip(got, want):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(b) for b in want))


def close(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    release_cached_device_memory()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=member_path("target"))
    parser.add_argument("--eagle3", default=member_path("eagle3"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    # float32: the ranks' partial sums and one device's whole sums round alike enough for greedy
    # equality (the bar); in bfloat16 a near-tie may flip (the agreement column shows how often).
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    spec = {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": 3}
    report: dict = {"device": args.device, "dtype": args.dtype, "model": args.model, "eagle3": args.eagle3, "equality": [], "decode": [],
                    "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"]}
    failed = False

    one = engine(args.model, 1, eager=False, spec=None, device=args.device, dtype=args.dtype)
    reference = tokens(one, PROMPTS, args.max_tokens)
    report["decode"] += [{"setup": "tp1 graphs", "batch": b, "ms_per_step": decode_ms(one, b, args.max_tokens)}
                         for b in (1, 8)]
    close(one)

    for eager in (True, False):
        for draft in (None, spec):
            name = f"tp2 {'eager' if eager else 'graphs'}{' eagle3' if draft else ''}"
            started = time.perf_counter()
            llm = engine(args.model, 2, eager=eager, spec=draft, device=args.device, dtype=args.dtype)
            start_s = time.perf_counter() - started
            state = parallel_graph_state(llm)
            got = tokens(llm, PROMPTS, args.max_tokens)
            equal = got == reference
            failed |= not equal
            first_diff = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
            row = {"setup": name, "equal_to_tp1": equal, "first_differing_prompt": first_diff,
                   "agreement": round(agreement(got, reference), 4),
                   "start_s": round(start_s, 1), **state}
            if draft is not None:
                stats = llm.get_stats()
                row["mean_acceptance_length"] = stats.get("mean_acceptance_length")
            else:
                report["decode"] += [{"setup": name, "batch": b, "ms_per_step": decode_ms(llm, b, args.max_tokens)}
                                     for b in (1, 8)]
            report["equality"].append(row)
            close(llm)

    for row in report["decode"]:
        row["tokens_per_s"] = round(1e3 * row["batch"] / row["ms_per_step"], 1)
        row["ms_per_step"] = round(row["ms_per_step"], 3)
    print(f"{'setup':<22} {'equal':>6} {'agree':>6} {'graphs':>7} {'ahead':>6}  why")
    for row in report["equality"]:
        print(f"{row['setup']:<22} {str(row['equal_to_tp1']):>6} {row['agreement']:>6} {str(row['captured']):>7} "
              f"{str(row['queue_ahead']):>6}  {row['reason']}")
    print(f"\n{'setup':<22} {'batch':>5} {'ms/step':>8} {'tok/s':>8}")
    for row in report["decode"]:
        print(f"{row['setup']:<22} {row['batch']:>5} {row['ms_per_step']:>8} {row['tokens_per_s']:>8}")
    with open(os.path.join(args.out_dir, "check_tp_gpu.json"), "w") as f:
        json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
