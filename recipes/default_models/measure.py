"""What the default-model recipe measures for each target: greedy on GSM8K test prompts, plain
and with each drafter (online acceptance from the engine, and whether the output equals plain
greedy), and for each EAGLE3 head the trainer's teacher-forced acceptance on the same prompts,
including its replay of the engine's walk (the fidelity check of issue 8)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import time

import torch

from foretell.bench.datasets import gsm8k_test_prompts


def measure_methods(target_dir: str, methods: dict[str, dict | None], prompts: list[str], max_tokens: int,
                    device: str) -> dict:
    """methods: name -> speculative_config (None for plain, which must come first). Returns
    per method: seconds, output tokens and (drafters) drafts, acceptance per position, mean
    acceptance length (1 + accepted per draft), greedy equality with plain."""
    from foretell import LLM, SamplingParams
    from foretell.bench.sweep import spec_counters

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine = dict(device=device, kv_cache_memory_bytes=2 << 30, max_num_seqs=256)
    results: dict = {"prompts": len(prompts), "max_tokens": max_tokens,
                     "dtype": "bfloat16" if device.startswith("cuda") else "float32"}  # the engine's auto
    baseline = None
    for name, spec in methods.items():
        try:
            llm = LLM(target_dir, speculative_config=spec, **engine)
            llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up (CUDA graphs, allocator)
            before = llm.get_stats()
            start = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.time() - start
        except Exception as e:  # one failing method must not lose the others' numbers
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        tokens = [o.outputs[0].token_ids for o in outs]
        entry = {"seconds": elapsed, "output_tokens": sum(map(len, tokens)), "speculative_config": spec}
        entry["tokens_per_s"] = entry["output_tokens"] / max(elapsed, 1e-9)
        if baseline is None:
            baseline = tokens
        else:
            counters = spec_counters(before, llm.get_stats(), spec["num_speculative_tokens"])
            differ = [_first_difference(x, y) for x, y in zip(tokens, baseline) if x != y]
            entry.update(num_drafts=counters["num_drafts"], acceptance_per_position=counters["acceptance_per_position"],
                         mean_acceptance_length=counters["mean_acceptance_length"] or 1.0, greedy_equal=not differ,
                         greedy_mismatch_prompts=len(differ), greedy_first_mismatch_positions=differ)
        results[name] = entry
        del llm
        free_memory()
    return results


def teacher_forced(target_dir: str, head_dir: str, prompts: list[str], max_tokens: int, device: str,
                   work: str) -> dict:
    """The trainer's evaluation of head_dir on the target's greedy answers to prompts."""
    from foretell.training.trainer import TrainConfig, train_eagle3

    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "measure_prompts.jsonl")
    with open(data, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    tf = train_eagle3(TrainConfig(target=target_dir, data=[data], out=head_dir, regenerate=True,
                                  regen_max_tokens=max_tokens, max_len=4096, eval_only=True,
                                  device=device, ttt_steps=7, batch_size=32))
    keep = ("config.json", "model.safetensors")  # eval_only wrote its files into the head folder
    for name in os.listdir(head_dir):
        if name not in keep:
            moved = os.path.join(work, f"eval_{name}")
            shutil.rmtree(moved, ignore_errors=True) if os.path.isdir(moved) else None
            shutil.move(os.path.join(head_dir, name), moved)
    return {k: tf[k] for k in ("acceptance_per_position", "mean_acceptance_length", "engine_walk")}


def _first_difference(x: list[int], y: list[int]) -> int:
    return next(i for i, (a, b) in enumerate(zip(x + [None], y + [None])) if a != b)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
