"""GPU benchmarks at real sizes with random weights (issue 5's bars), in one process.

    python scripts/bench_gpu.py OUT_DIR [--quick]

Llama-3.1-8B (bf16, dummy weights, CUDA graphs): batch-1 decode tok/s; the cost of a verify
forward with 4 query tokens against a 1-token decode (graph replays timed with CUDA events);
one EAGLE3 draft step (hidden 4096, draft vocab 32000) against a decode forward; EAGLE3 k=3 with
simulated mean acceptance length 2.93; batches 1/4/16/64 with and without EAGLE3; host time per
decode step. DeepSeek-V2-Lite shape at batch 1 against its roofline, and with MTP k=1 simulated at
85%. bf16 greedy agreement of speculation with plain greedy on a tiny model. Each section
is independent: a failure is recorded and the rest still runs. Writes OUT_DIR/bench_gpu.json.

What it measures inside an engine (graph replays, the draft loop, the synchronous engine, active
weight bytes) goes through foretell.bench.engine_probe; the tiny model is foretell.bench.tiny_checkpoints.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402
from foretell.bench.sweep import spec_counters  # noqa: E402

CONFIGS = os.path.join(ROOT, "foretell", "configs")
RESULTS: dict = {}
OUT_DIR: list[str] = []  # set by main()


def graph_ms(llm: LLM, key: tuple[int, int], context_len: int = 256) -> float:
    """GPU time of one bare replay of the target graph `key` (num_seqs, query_len) over a context
    of context_len (median of 50, CUDA events)."""
    return probe.target_graph_replay_ms(llm, *key, context_len=context_len)


def free(llm) -> None:
    llm.close()  # weights, KV cache and graphs go now, not at the next garbage collection


ENGINE_DEFAULTS: dict = {}  # set by main() from the command line (--small-m-gemm)


def make_llm(model: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 64)
    for key, value in ENGINE_DEFAULTS.items():
        kw.setdefault(key, value)
    return LLM(model, dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
               speculative_config=spec, log_stats_interval_s=0, **kw)


def decode_tok_s(llm: LLM, batch: int, prompt_len: int = 128, new_tokens: int = 128) -> dict:
    """Decode throughput from the requests' own timestamps: tokens after the first, over the time
    from the last first token to the last finish (prefill excluded without a second run). With a
    drafter, the timed run's own acceptance too (the warm-up runs drew theirs before it)."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(prompt_len)]} for i in range(batch)]
    full = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    # Warm-up with the measured run itself: every shape it meets (batches shrinking as requests end
    # at different steps) is compiled before the clock.
    for _ in range(2):  # simulated acceptance ends requests at different steps: two runs meet more shapes
        llm.generate(prompts, full, use_tqdm=False)
    steps0, before = probe.engine_step_count(llm), dict(llm.get_stats())
    outs = llm.generate(prompts, full, use_tqdm=False)
    steps = probe.engine_step_count(llm) - steps0
    failed = [o.error for o in outs if o.error is not None]
    if failed:  # a failed request has no first token: say why rather than fail on its missing time
        raise RuntimeError(f"{len(failed)} of {batch} timed requests failed: {failed[0]}")
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    decode_s = max(last - first, 1e-9)
    out = {"batch": batch, "tok_s": batch * (new_tokens - 1) / decode_s,
           "ms_per_step": 1000 * decode_s / max(steps - 1, 1), "steps": steps,
           "tokens_per_step": batch * (new_tokens - 1) / max(steps - 1, 1)}  # after the prefill step
    k = probe.num_speculative_tokens(llm)
    if k is not None:
        counters = spec_counters(before, llm.get_stats(), k)
        out["mean_acceptance_length"] = counters["mean_acceptance_length"]
    return out


def decode_sync_tok_s(llm: LLM, batch: int, **kw) -> dict:
    """decode_tok_s with decoding one step ahead switched off: the synchronous engine (each step
    waits for its tokens before the host schedules the next), for the before/after."""
    with probe.queue_ahead_off(llm):
        return decode_tok_s(llm, batch, **kw)


def save() -> None:
    if OUT_DIR:
        with open(os.path.join(OUT_DIR[0], "bench_gpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as e:  # record and go on: one broken section must not hide the rest
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            # The section's engines are unreachable now, but the first engine of a process sits in
            # a reference cycle (a traceback an import made while it was built holds its frames):
            # collect it before the next section measures free GPU memory.
            gc.collect()
            torch.cuda.empty_cache()
            RESULTS.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 1)
            print(f"[{name}] {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
            save()
        return run
    return wrap


@section("llama_baseline")
def llama_baseline(batches):
    llm = make_llm(f"{CONFIGS}/llama-3.1-8b")
    out = {"decode": [decode_tok_s(llm, b) for b in batches]}  # one step ahead (async_scheduling)
    out["decode_sync"] = [decode_sync_tok_s(llm, b) for b in (batches[0], batches[-1])]
    out["decode_graph_ms_b1"] = graph_ms(llm, (1, 1))
    out["warm_up_s"] = probe.warm_up_seconds(llm)  # start-up dummy requests (Triton compiles)
    # Wall time per step beyond a lone replay of the graph (which includes its own launch). Without
    # the step ahead the GPU waits for the host every step: that difference is the host's work per
    # step. With it the host's work hides behind the GPU, and the difference is what the device
    # runs between graphs minus the replay's launch (it can be below zero).
    out["host_ms_per_step_b1"] = out["decode_sync"][0]["ms_per_step"] - out["decode_graph_ms_b1"]
    out["overhead_ms_per_step_b1"] = out["decode"][0]["ms_per_step"] - out["decode_graph_ms_b1"]
    free(llm)
    return out


@section("llama_small_m_off")
def llama_small_m_off():
    """The same graphs with every linear on cuBLAS: the small-M GEMM's before/after."""
    llm = make_llm(f"{CONFIGS}/llama-3.1-8b", small_m_gemm="off", max_num_seqs=4)
    out = {"decode_graph_ms_b1": graph_ms(llm, (1, 1)), "decode": decode_tok_s(llm, 1)}
    free(llm)
    return out


@section("default_family")
def default_family():
    """The shipped default models (bf16, batch 1, GSM8K test prompts, greedy, k=3): tok/s of each
    drafter against plain decoding in the same process, and acceptance."""
    from foretell.defaults import member_path
    from foretell.bench.datasets import gsm8k_test_prompts

    prompts = gsm8k_test_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=128)
    out = {}
    for family, methods in (("qwen3", ("eagle3", "draft_model", "ngram")), ("deepseek", ("mtp", "eagle3", "draft_model", "ngram"))):
        rows = {}
        for method in ("none",) + methods:
            spec = None if method == "none" else {"method": method, "num_speculative_tokens": 3}
            if method in ("eagle3", "draft_model"):
                spec["model"] = member_path(method, family)
            # No prefix caching: the timed pass then meets exactly the shapes of the warm-up pass
            # (with it, the timed pass hit the cache and ran new short prefill shapes whose Triton
            # variants compiled inside the timed window, first row of each family only).
            llm = LLM(member_path("target", family), device="cuda", dtype="bfloat16", max_num_seqs=4,
                      kv_cache_memory_bytes=2 << 30, speculative_config=spec, log_stats_interval_s=0,
                      enable_prefix_caching=False)
            warmup_ms = []
            for prompt in prompts:  # warm-up: the timed pass itself (its times show compile stalls)
                t0 = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                warmup_ms.append(round(1000 * (time.perf_counter() - t0), 1))
            before = dict(llm.get_stats())
            start, tokens, per_prompt_ms = time.perf_counter(), 0, []
            for prompt in prompts:  # batch 1
                t0 = time.perf_counter()
                tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
                per_prompt_ms.append(round(1000 * (time.perf_counter() - t0), 1))
            seconds = time.perf_counter() - start
            s = llm.get_stats()
            draft_s = s["draft_time_s"] - before["draft_time_s"]
            target_s = s["target_time_s"] - before["target_time_s"]
            rows[method] = {"tok_s": tokens / seconds, "tokens": tokens, "per_prompt_ms": per_prompt_ms, "warmup_ms": warmup_ms,
                            "engine_warm_up_s": probe.warm_up_seconds(llm),
                            "draft_time_share": draft_s / (draft_s + target_s),
                            "mean_acceptance_length": None if spec is None else
                            spec_counters(before, s, 3)["mean_acceptance_length"]}
            free(llm)
            del llm
        for row in rows.values():
            row["speedup"] = row["tok_s"] / rows["none"]["tok_s"]
        out[family] = rows
    return out


@section("llama_eager_b1")
def llama_eager():
    llm = make_llm(f"{CONFIGS}/llama-3.1-8b", enforce_eager=True, max_num_seqs=4)
    out = decode_tok_s(llm, 1, new_tokens=32)
    free(llm)
    return out


@section("llama_eagle3")
def llama_eagle3(batches, mean_length=2.93):
    spec = {"method": "eagle3", "model": f"{CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
            "simulate_acceptance": {"mean_acceptance_length": mean_length}}
    llm = make_llm(f"{CONFIGS}/llama-3.1-8b", spec)
    # Each replay timed on inputs prepared for its own query length (the buffers otherwise hold
    # the last capture's, q = 4: a bare decode replay then ran 4 rows through 1-row tensors).
    out = {"decode_graph_ms_b1": graph_ms(llm, (1, 1)), "verify4_graph_ms_b1": graph_ms(llm, (1, 4))}
    out["verify_over_decode"] = out["verify4_graph_ms_b1"] / out["decode_graph_ms_b1"]
    # One EAGLE3 chain step at batch 1 (eager, one token after 100), against the decode forward.
    out["draft_step_eager_ms_b1"] = probe.draft_chain_step_ms(llm, context_len=100)
    # The graphed draft loop (catch-up + k - 1 chained steps, what a greedy verify step runs):
    # per draft step = loop / k.
    out["draft_loop_graph_ms_b1"] = probe.draft_loop_replay_ms(llm, 1)
    out["draft_step_ms_b1"] = out["draft_loop_graph_ms_b1"] / 3
    out["draft_over_decode"] = out["draft_step_ms_b1"] / out["decode_graph_ms_b1"]
    out["spec"] = [decode_tok_s(llm, b) for b in batches]
    # verify steps not queued ahead (the synchronous engine)
    out["spec_sync"] = [decode_sync_tok_s(llm, b) for b in (batches[0], batches[-1])]
    out["synthetic_acceptance"] = llm.get_stats().get("synthetic_acceptance", False)
    free(llm)
    return out


@section("llama_eagle3_arrivals")
def llama_eagle3_arrivals(rounds: int = 2, num_requests: int = 32, prompt_len: int = 256):
    """Requests arriving while others verify: 32 of them through 8 slots, their prompts chunked at
    512 tokens and their lengths unequal, so each new prompt's chunk meets 7 verifies. Output
    tok/s with such batches split (the verifies on the padded step: graph replays and the draft
    loop's graphs) and run whole on the host step, in turns on one engine (EAGLE3 k = 3, simulated
    mean length 2.93)."""
    spec = {"method": "eagle3", "model": f"{CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
            "simulate_acceptance": {"mean_acceptance_length": 2.93}}
    llm = make_llm(f"{CONFIGS}/llama-3.1-8b", spec, max_num_seqs=8, max_num_batched_tokens=512)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(prompt_len)]} for i in range(num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=64 + 32 * (i % 4), ignore_eos=True) for i in range(num_requests)]
    out_tokens = sum(p.max_tokens for p in params)

    def run() -> dict:
        split0, t0 = probe.split_step_count(llm), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return {"tok_s": out_tokens / (time.perf_counter() - t0), "split_steps": probe.split_step_count(llm) - split0}

    for _ in range(2):  # warm-up: both ways meet their shapes before the clock
        run()
        with probe.split_batches_off(llm):
            run()
    split, whole = [], []
    for _ in range(rounds):
        split.append(run())
        with probe.split_batches_off(llm):
            whole.append(run())
    free(llm)
    best_split, best_whole = max(r["tok_s"] for r in split), max(r["tok_s"] for r in whole)
    return {"split": split, "whole": whole, "split_over_whole": best_split / best_whole}


def v2_lite_folder(mtp: bool) -> str:
    config = json.load(open(f"{CONFIGS}/deepseek-v2-lite/config.json"))
    if mtp:
        config["num_nextn_predict_layers"] = 1
    folder = tempfile.mkdtemp()
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder


@section("deepseek_v2_lite")
def deepseek_v2_lite(bandwidth_bytes_s: float):
    llm = make_llm(v2_lite_folder(False), max_num_seqs=4)
    out = decode_tok_s(llm, 1, new_tokens=64)
    out["tok_s_sync"] = decode_sync_tok_s(llm, 1, new_tokens=64)["tok_s"]
    config = json.load(open(f"{CONFIGS}/deepseek-v2-lite/config.json"))
    # Weights read per token at batch 1: everything but the embedding table and the routed
    # experts not selected.
    out["active_bytes"] = probe.active_weight_bytes(llm, config["n_routed_experts"], config.get("n_shared_experts", 0),
                                                    config["num_experts_per_tok"])
    out["roofline_tok_s"] = bandwidth_bytes_s / out["active_bytes"]
    out["fraction_of_roofline"] = out["tok_s"] / out["roofline_tok_s"]
    free(llm)
    del llm
    spec = {"method": "mtp", "num_speculative_tokens": 1, "simulate_acceptance": {"rates": [0.85]}}
    llm = make_llm(v2_lite_folder(True), spec, max_num_seqs=4)
    mtp = decode_tok_s(llm, 1, new_tokens=64)
    out["mtp_k1_sim85_tok_s"] = mtp["tok_s"]
    out["mtp_k1_sim85_tok_s_sync"] = decode_sync_tok_s(llm, 1, new_tokens=64)["tok_s"]
    out["mtp_speedup"] = mtp["tok_s"] / out["tok_s"]
    free(llm)
    return out


@section("deepseek_small_m")
def deepseek_small_m():
    """V2-Lite at batch 1 with its few-row linears on cuBLAS (small_m_gemm off) and timed per shape
    (auto), against the default GEMV (the deepseek_v2_lite section): its attention projections are
    small (8-15 MB), where cuBLAS reads far below the bandwidth."""
    out = {}
    for mode in ("off", "auto"):
        llm = make_llm(v2_lite_folder(False), small_m_gemm=mode, max_num_seqs=4)
        out[mode] = {"decode_graph_ms_b1": graph_ms(llm, (1, 1)), "decode": decode_tok_s(llm, 1, new_tokens=64)}
        free(llm)
        del llm
    return out


@section("bf16_agreement")
def bf16_agreement():
    return speculation_agreement("cuda", ("float32", "bfloat16"))


def speculation_agreement(device: str, dtypes, num_prompts: int = 32, max_tokens: int = 96) -> dict:
    """The share of prompts whose greedy output with each drafter (k=3) equals plain greedy on a
    tiny random Qwen3, in each dtype."""
    from foretell.bench.tiny_checkpoints import write_tiny_eagle3_head, write_tiny_qwen3

    root = tempfile.mkdtemp()
    write_tiny_qwen3(f"{root}/qwen3")
    write_tiny_eagle3_head(f"{root}/head", f"{root}/qwen3", draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j * j) % 440 + 1 for j in range(60 + 9 * (i % 7))]}
               for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = dict(device=device, num_kv_blocks=512, skip_tokenizer_init=True)
    out = {}
    for dtype in dtypes:
        with LLM(f"{root}/qwen3", dtype=dtype, **engine) as llm:
            plain = llm.generate(prompts, params, use_tqdm=False)
        for method, model in (("eagle3", f"{root}/head"), ("draft_model", f"{root}/qwen3"), ("ngram", None)):
            spec = {"method": method, "num_speculative_tokens": 3}
            if model:
                spec["model"] = model
            with LLM(f"{root}/qwen3", dtype=dtype, speculative_config=spec, **engine) as llm:
                got = llm.generate(prompts, params, use_tqdm=False)
            same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, got))
            out[f"{dtype}_{method}_match_fraction"] = same / len(prompts)
    return out


SECTIONS = ("llama_baseline", "llama_eagle3", "llama_eagle3_arrivals", "llama_small_m_off", "default_family",
            "bf16_agreement", "llama_eager_b1", "deepseek_v2_lite", "deepseek_small_m")
OPT_IN = {"deepseek_small_m"}  # experiments, run only when named


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for rooflines")
    parser.add_argument("--only", help="comma-separated sections to run (default: all but deepseek_small_m)")
    parser.add_argument("--small-m-gemm", choices=["auto", "on", "off"],
                        help="few-row linears for every engine here (default: the engine's default)")
    args = parser.parse_args()
    if args.only and set(args.only.split(",")) - set(SECTIONS):
        parser.error(f"--only: unknown sections {sorted(set(args.only.split(',')) - set(SECTIONS))}; "
                     f"known: {', '.join(SECTIONS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.small_m_gemm:
        ENGINE_DEFAULTS["small_m_gemm"] = args.small_m_gemm
        RESULTS["small_m_gemm"] = args.small_m_gemm
    OUT_DIR.append(args.out)
    batches = [1, 4] if args.quick else [1, 4, 16, 64]
    RESULTS["gpu"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    sections = {"llama_baseline": lambda: llama_baseline(batches), "llama_eagle3": lambda: llama_eagle3(batches),
                "llama_eagle3_arrivals": llama_eagle3_arrivals,
                "llama_small_m_off": llama_small_m_off, "default_family": default_family,
                "bf16_agreement": bf16_agreement, "llama_eager_b1": llama_eager,
                "deepseek_v2_lite": lambda: deepseek_v2_lite(args.bandwidth), "deepseek_small_m": deepseek_small_m}
    assert tuple(sections) == SECTIONS
    chosen = args.only.split(",") if args.only else [name for name in sections if name not in OPT_IN]
    for name in chosen:
        sections[name]()
    save()
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "_seconds"}, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
