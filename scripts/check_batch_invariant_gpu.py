"""The batch-invariant mode on a GPU (issue 23): what it costs and whether it is exact, in one process.

    python scripts/check_batch_invariant_gpu.py OUT_DIR [--quick] [--sections cost,agreement,sampling]
        [--cost-runs plain,eagle3_k3_sim2.93] [--cost-tokens 128]
    python scripts/check_batch_invariant_gpu.py OUT_DIR --sections kernels   (about 1 minute)

The quick cost check (four Llama-8B engines, their graphs and timed runs; under 2 minutes once
Triton's cache holds the kernels): --sections cost. Only plain decoding: --cost-runs plain.

cost        Llama-3.1-8B shapes (bf16, dummy weights, CUDA graphs), batch 1 and 64, plain decoding and
            EAGLE3 k=3 at a simulated mean acceptance length of 2.93, with batch_invariant off and on:
            tok/s, the decode graph's replay time, and the mode's cost (1 - on / off). The goal
            of the issue: at most 3% at batch 1 and 10% at batch 64.
agreement   the default family in bf16 with the mode on, 64 GSM8K test prompts x 256 tokens, greedy:
            each drafter's output (qwen3: eagle3, draft_model, ngram; deepseek: mtp) against plain
            output, and plain output run one at a time, all at once, mixed into a batch of 128 with
            64 other prompts, and against a cold and a warm prefix cache (matches out of 64); the
            same for eagle3 with the mode off, for contrast. Sub-checks run most important first
            (qwen3 batched / warm / mixed, its drafters, DeepSeek MTP, then one at a time, then the
            contrast) and each writes the JSON as it finishes, with its time in agreement._seconds.
sampling    seeded sampling (temperature 0.8, a seed per request) at batch 1 and 64, mode on.
kernels     (not in the default sections) each Llama-8B linear alone at M = 1, 4 and 64: the default
            path's kernel (the GEMV at 1, the few-row MMA at 4, cuBLAS at 64: SmallMGemm "on")
            against the mode's linear at its own pipeline depth and at 1-4 stages (a launch choice
            that changes no bits: tests/ops/test_batch_invariant_gemm.py), us per call with L2
            flushed (ops/gemm/dispatch.CudaEventTimer). Where the mode's GEMM time goes per shape.

Prints a table per section and writes OUT_DIR/check_batch_invariant_gpu.json (after every engine
and sub-check).
Engines are built as scripts/bench_gpu.py builds them (its make_llm / decode_tok_s); what it reads
inside an engine goes through foretell.bench.engine_probe. About 6 minutes on an H200 (--quick: fewer
prompts and tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import bench_gpu  # noqa: E402  (scripts/bench_gpu.py: make_llm, decode_tok_s, CONFIGS)
from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402

RESULTS: dict = {}


def save(out_dir: str) -> None:
    with open(os.path.join(out_dir, "check_batch_invariant_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)


def run_section(name: str, fn, out_dir: str, *args) -> None:
    t0 = time.perf_counter()
    try:
        RESULTS[name] = fn(*args)
    except Exception as e:  # record and go on: one broken section must not hide the rest
        kept = RESULTS.get(name) if isinstance(RESULTS.get(name), dict) else {}
        RESULTS[name] = {**kept, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    gc.collect()
    torch.cuda.empty_cache()
    RESULTS.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    save(out_dir)


# ------------------------------------------------------------------------------------------ cost


COST_RUNS = ("plain", "eagle3_k3_sim2.93")


def cost(batches: list[int], new_tokens: int, runs: list[str], out_dir: str) -> dict:
    """Each engine's row recorded (and the JSON written) as it finishes, with its seconds."""
    eagle3 = {"method": "eagle3", "model": f"{bench_gpu.CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
              "simulate_acceptance": {"mean_acceptance_length": 2.93}}
    rows = RESULTS.setdefault("cost", {})
    for label, spec in (("plain", None), ("eagle3_k3_sim2.93", eagle3)):
        if label not in runs:
            continue
        for mode in (False, True):
            t0 = time.perf_counter()
            llm = bench_gpu.make_llm(f"{bench_gpu.CONFIGS}/llama-3.1-8b", spec, batch_invariant=mode)
            row = {"build_s": round(time.perf_counter() - t0, 1),
                   "decode_graph_ms_b1": probe.target_graph_replay_ms(llm, 1, 1)}
            for b in batches:
                row[f"b{b}"] = bench_gpu.decode_tok_s(llm, b, new_tokens=new_tokens)
            row["total_s"] = round(time.perf_counter() - t0, 1)
            rows[f"{label}_{'on' if mode else 'off'}"] = row
            save(out_dir)
            llm.close()
            del llm
            gc.collect()
        off, on = rows[f"{label}_off"], rows[f"{label}_on"]
        rows[f"{label}_cost"] = {f"b{b}": 1 - on[f"b{b}"]["tok_s"] / off[f"b{b}"]["tok_s"] for b in batches}
        save(out_dir)
    return rows


def print_cost(rows: dict, batches: list[int]) -> None:
    print("\nbatch-invariant cost, Llama-3.1-8B shapes (bf16, dummy weights, graphs)")
    print(f"{'run':<24}" + "".join(f"{'b' + str(b) + ' off':>12}{'b' + str(b) + ' on':>12}{'cost':>8}" for b in batches))
    for label in COST_RUNS:
        if f"{label}_cost" not in rows:
            continue
        line = f"{label:<24}"
        for b in batches:
            off, on = rows[f"{label}_off"][f"b{b}"]["tok_s"], rows[f"{label}_on"][f"b{b}"]["tok_s"]
            line += f"{off:>12.1f}{on:>12.1f}{100 * rows[f'{label}_cost'][f'b{b}']:>7.1f}%"
        print(line)


# --------------------------------------------------------------------------------------- kernels

LLAMA8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                   "lm_head": (128256, 4096)}


def kernels(rows_list: list[int], stages_list: list[int]) -> dict:
    """us per call of each Llama-8B linear: the default path's kernel and the mode's at each depth."""
    from foretell.ops.gemm import triton_batch_invariant as invariant
    from foretell.ops.gemm.batch_invariant import BatchInvariantGemm
    from foretell.ops.gemm.dispatch import CudaEventTimer, SmallMGemm

    device = torch.device("cuda")
    timer, default = CudaEventTimer(reps=20), SmallMGemm("on")
    gemm = BatchInvariantGemm()
    out: dict = {}
    gen = torch.Generator(device).manual_seed(0)
    for name, (n, k) in LLAMA8B_LINEARS.items():
        weight = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)  # [N, K]
        extra = {"gated": name == "gate_up", "float32_out": name == "lm_head"}
        config = invariant.pick_shape_config(n, k, torch.bfloat16, device)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)  # [M, K]
            chosen = default.kernels.default_config(m, n, k, torch.bfloat16, device) if m <= 16 else None
            row = {"config": str(config), "default_us": 1e6 * timer(lambda: default(x, weight, **extra), device),
                   "default_kernel": "cublas" if chosen is None else str(chosen)}
            row["invariant_us"] = 1e6 * timer(lambda: gemm(x, weight, **extra), device)
            for stages in stages_list:
                run = lambda stages=stages: invariant.linear_batch_invariant_triton(  # noqa: E731
                    x, weight, gated=extra["gated"], float32_out=extra["float32_out"], counters=gemm._counters,
                    num_stages=stages)
                try:
                    row[f"stages{stages}_us"] = 1e6 * timer(run, device)
                except Exception as e:  # a depth whose shared memory does not fit: recorded, not fatal
                    row[f"stages{stages}_us"] = f"{type(e).__name__}: {str(e)[:200]}"
            out[f"{name} M={m}"] = row
        del weight
        torch.cuda.empty_cache()
    return out


def print_kernels(rows: dict, stages_list: list[int]) -> None:
    print("\nLlama-8B linears alone, us per call (L2 flushed): default path vs the mode's linear")
    print(f"{'shape':<16}{'default':>10}{'mode':>10}" + "".join(f"{'s' + str(s):>10}" for s in stages_list)
          + "   default kernel / mode config")
    for name, row in rows.items():
        if not isinstance(row, dict) or "default_us" not in row:
            continue
        cells = [row.get(f"stages{s}_us") for s in stages_list]
        line = f"{name:<16}{row['default_us']:>10.1f}{row['invariant_us']:>10.1f}"
        line += "".join(f"{c:>10.1f}" if isinstance(c, float) else f"{'-':>10}" for c in cells)
        print(line + f"   {row['default_kernel']} / {row['config']}")


# ------------------------------------------------------------------------------------- agreement


def outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def matches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def agreement(num_prompts: int, max_tokens: int, out_dir: str) -> dict:
    """Sub-checks in the order of what matters most, each recorded (and the JSON written) as it
    finishes, so a run cut short keeps what it did: the qwen3 reference and its drafters first, the
    slow one-at-a-time run and DeepSeek's MTP after, the mode-off contrast last."""
    from foretell.bench.datasets import gsm8k_test_prompts
    from foretell.defaults import member_path

    texts = gsm8k_test_prompts(2 * num_prompts)
    prompts, others = texts[:num_prompts], texts[num_prompts:]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = dict(device="cuda", dtype="bfloat16", max_num_seqs=2 * num_prompts, kv_cache_memory_bytes=4 << 30,
                  log_stats_interval_s=0)
    out = RESULTS.setdefault("agreement", {})
    out.update(num_prompts=num_prompts, max_tokens=max_tokens)
    seconds = out.setdefault("_seconds", {})
    t0 = time.perf_counter()

    def record(family: str, name: str, value) -> None:
        out.setdefault(family, {})[name] = value
        seconds[f"{family}.{name}"] = round(time.perf_counter() - t0, 1)  # since the section began
        save(out_dir)

    def drafter(family: str, method: str, reference: list[list[int]]) -> None:
        spec = {"method": method, "num_speculative_tokens": 3}
        if method in ("eagle3", "draft_model"):
            spec["model"] = member_path(method, family)
        with LLM(member_path("target", family), batch_invariant=True, speculative_config=spec, **engine) as llm:
            record(family, f"{method}_vs_plain", matches(outputs(llm, prompts, params), reference))

    qwen3 = member_path("target", "qwen3")
    with LLM(qwen3, batch_invariant=True, enable_prefix_caching=True, **engine) as llm:
        batched = outputs(llm, prompts, params)  # cold cache (first run of these prompts)
        record("qwen3", "warm_prefix_cache", matches(outputs(llm, prompts, params), batched))
        mixed = outputs(llm, [x for pair in zip(others, prompts) for x in pair], params)[1::2]
        record("qwen3", "mixed_into_128", matches(mixed, batched))
    for method in ("eagle3", "draft_model", "ngram"):
        drafter("qwen3", method, batched)
    deepseek = member_path("target", "deepseek")
    with LLM(deepseek, batch_invariant=True, **engine) as llm:
        deepseek_batched = outputs(llm, prompts, params)
        record("deepseek", "plain_runs", 1)
    drafter("deepseek", "mtp", deepseek_batched)
    # One at a time: num_prompts runs of max_tokens steps each, the slowest sub-check; in an engine
    # without a prefix cache, whose batched run is the cold / no-cache check as well.
    with LLM(qwen3, batch_invariant=True, enable_prefix_caching=False, **engine) as llm:
        record("qwen3", "no_prefix_cache", matches(outputs(llm, prompts, params), batched))
        record("qwen3", "one_at_a_time", matches([outputs(llm, [p], params)[0] for p in prompts], batched))
    with LLM(qwen3, **engine) as llm:  # the default path, for contrast
        plain_off = outputs(llm, prompts, params)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": member_path("eagle3", "qwen3")}
    with LLM(qwen3, speculative_config=spec, **engine) as llm:
        record("qwen3", "mode_off_eagle3_vs_plain", matches(outputs(llm, prompts, params), plain_off))
    return out


def print_agreement(rows: dict) -> None:
    n = rows.get("num_prompts")
    print(f"\nbf16 agreement with the mode on ({n} GSM8K prompts x {rows.get('max_tokens')} tokens, greedy): matches of {n}")
    for family in ("qwen3", "deepseek"):
        for name, value in rows.get(family, {}).items():
            if name != "plain_runs":
                print(f"  {family:<10}{name:<28}{value:>4} / {n}")
    print(f"  seconds since the section began, per sub-check: {rows.get('_seconds')}")


# -------------------------------------------------------------------------------------- sampling


def sampling(num_prompts: int, max_tokens: int) -> dict:
    from foretell.bench.datasets import gsm8k_test_prompts
    from foretell.defaults import member_path

    prompts = gsm8k_test_prompts(num_prompts)
    params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
              for i in range(num_prompts)]
    with LLM(member_path("target", "qwen3"), device="cuda", dtype="bfloat16", batch_invariant=True,
             max_num_seqs=num_prompts, log_stats_interval_s=0) as llm:
        together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [list(llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids) for p, q in zip(prompts, params)]
    return {"num_prompts": num_prompts, "batch1_equals_batch64": matches(alone, together)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a smoke run)")
    parser.add_argument("--sections", default="cost,agreement,sampling")
    parser.add_argument("--cost-runs", default=",".join(COST_RUNS),
                        help=f"which of {','.join(COST_RUNS)} the cost section measures (each: two engines)")
    parser.add_argument("--cost-tokens", type=int, default=128,
                        help="tokens per timed decode request in the cost section (--quick: 32)")
    args = parser.parse_args()
    cost_runs = args.cost_runs.split(",")
    unknown = sorted(set(cost_runs) - set(COST_RUNS))
    if unknown:
        parser.error(f"--cost-runs: unknown {unknown}; expected some of {list(COST_RUNS)}")
    os.makedirs(args.out, exist_ok=True)
    sections = args.sections.split(",")
    batches = [1, 64]
    num_prompts, max_tokens = (8, 32) if args.quick else (64, 256)
    if "cost" in sections:
        run_section("cost", cost, args.out, batches, 32 if args.quick else args.cost_tokens, cost_runs, args.out)
        print_cost(RESULTS["cost"], batches)
    if "agreement" in sections:
        run_section("agreement", agreement, args.out, num_prompts, max_tokens, args.out)
        print_agreement(RESULTS["agreement"])  # what finished, also when a sub-check failed
    if "sampling" in sections:
        run_section("sampling", sampling, args.out, num_prompts, max_tokens // 2)
    if "kernels" in sections:
        stages_list = [1, 2, 3, 4]
        run_section("kernels", kernels, args.out, [1, 4, 64], stages_list)
        print_kernels(RESULTS["kernels"], stages_list)
    for name, value in RESULTS.items():
        if isinstance(value, dict) and "error" in value:
            print(f"[{name}] {value['error']}")
    print(f"\nsections took {RESULTS.get('_seconds')} s; JSON in {args.out}/check_batch_invariant_gpu.json")


if __name__ == "__main__":
    main()
