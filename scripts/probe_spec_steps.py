"""Which steps of a timed EAGLE3 run are slow, and why: the engine's steps one by one.

bench_gpu.py's EAGLE3 rows are whole-run averages; once in a while a run at some batch took twice
its usual time per step. This probe runs the same requests (Llama-3.1-8B shape, random bf16 weights,
EAGLE3 k = 3, simulated mean acceptance length 2.93, two warm-up runs, then the timed one) and
records for every step of the timed run: its wall time, the sequences in it, the path the runner
took (a step launched ahead and used, a graphed verify, or the general path: eager target or
draft), Python garbage collections during it, and Triton compilations during it.

    python scripts/probe_spec_steps.py OUT_DIR [--batches 1 4 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from bench_result import write_result  # noqa: E402
from foretell import LLM, SamplingParams  # noqa: E402

CONFIGS = os.path.join(ROOT, "foretell", "configs")


class StepLog:
    """Per-step records of one engine, by wrapping engine.step and the runner's general path."""

    def __init__(self, llm: LLM):
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.rows: list[dict] = []
        self.recording = False
        self.general = self.gc_ms = self.compiles = 0
        self.compile_hook = False  # whether Triton compilations are counted (JITFunction._do_compile)
        self._wrap()

    def _wrap(self) -> None:
        step, target_forward = self.engine.step, self.runner.target_forward

        def timed_step():
            general0, gc0, compiles0 = self.general, self.gc_ms, self.compiles
            used0 = self.runner.pipeline.num_used
            seqs = len(self.engine.scheduler.running)
            t0 = time.perf_counter()
            out = step()
            if self.recording:
                self.rows.append({"ms": 1000 * (time.perf_counter() - t0), "running": seqs,
                                  "ahead_used": self.runner.pipeline.num_used - used0, "general": self.general - general0,
                                  "gc_ms": round(self.gc_ms - gc0, 2), "compiles": self.compiles - compiles0})
            return out

        def counted_forward(*args, **kwargs):
            self.general += 1
            return target_forward(*args, **kwargs)

        self.engine.step, self.runner.target_forward = timed_step, counted_forward
        start = {}

        def on_gc(phase, info):
            if phase == "start":
                start["t"] = time.perf_counter()
            elif "t" in start:
                self.gc_ms += 1000 * (time.perf_counter() - start.pop("t"))

        gc.callbacks.append(on_gc)
        try:
            from triton.runtime.jit import JITFunction

            compile_kernel = JITFunction._do_compile if hasattr(JITFunction, "_do_compile") else None
            if compile_kernel is not None:
                def counted_compile(fn_self, *args, **kwargs):
                    self.compiles += 1
                    return compile_kernel(fn_self, *args, **kwargs)

                JITFunction._do_compile = counted_compile
                self.compile_hook = True
        except ImportError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per batch")
    args = parser.parse_args()
    spec = {"method": "eagle3", "model": f"{CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
            "simulate_acceptance": {"mean_acceptance_length": 2.93}}
    llm = LLM(f"{CONFIGS}/llama-3.1-8b", dtype="bfloat16", device="cuda", load_format="dummy",
              skip_tokenizer_init=True, speculative_config=spec, log_stats_interval_s=0, max_num_seqs=64)
    log = StepLog(llm)
    results = {}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(128)]} for i in range(batch)]
        for _ in range(2):
            llm.generate(prompts, params, use_tqdm=False)
        runs = []
        for _ in range(args.runs):
            log.rows, log.recording = [], True
            llm.generate(prompts, params, use_tqdm=False)
            log.recording = False
            rows = log.rows
            median = statistics.median(r["ms"] for r in rows)
            slow = [dict(r, step=i) for i, r in enumerate(rows) if r["ms"] > 1.5 * median]
            runs.append({"steps": len(rows), "total_ms": sum(r["ms"] for r in rows), "median_ms": median,
                         "general_steps": sum(r["general"] for r in rows), "slow": slow})
            print(f"batch {batch}: {len(rows)} steps, {runs[-1]['total_ms']:.1f} ms, median {median:.2f} ms, "
                  f"general path {runs[-1]['general_steps']}, slow steps {slow}", flush=True)
        results[batch] = runs
    write_result(args.out_dir, "probe_spec_steps", "EAGLE3 timed run step by step",
                 {"compile_hook": log.compile_hook, "batches": results})


if __name__ == "__main__":
    main()
