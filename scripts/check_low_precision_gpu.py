"""Low-precision weights on one H200 (issue 25): real-shape end-to-end runs and the benchmarks of its bars.

    python scripts/check_low_precision_gpu.py [--out DIR] [--only SECTION ...]

Sections (each independent: a failure is recorded and the rest still runs):
  deepseek_v3_cut    DeepSeek-V3's config cut to 3 layers (1 dense + 2 MoE, real hidden sizes, 256
                     experts of 2048, top-8 + 1 shared) plus its MTP layer, FP8 128x128 block weights
                     (dummy, drawn on the GPU), run end to end: plain greedy and MTP k=3, tokens equal;
  kimi_k25_cut       Kimi-K2.5's layout cut to 3 layers (384 experts, int4 routed experts as
                     compressed-tensors packs them, bf16 shared experts and attention), with a dummy
                     3B-class EAGLE3 head (hidden 7168, one layer, full vocab): plain and EAGLE3 k=3
                     greedy, tokens equal;
  llama_fp8          Llama-3.1-8B shape with quantization="fp8" against bf16: batch-1 decode tok/s, and
                     EAGLE3 k=3 at a simulated mean acceptance length of 2.93 (bars: 450 and 1000 tok/s);
  v2_lite_fp8        DeepSeek-V2-Lite shape with FP8 block weights (a quantization_config added to its
                     config) against bf16, batch-1 decode tok/s (bar: 1.7x);
  int4_moe_bandwidth the int4 MoE GEMV kernels at Kimi-K2.5's expert shapes (H 7168, I 2048, 8 of 384
                     experts), and the FP8 ones at DeepSeek-V3's (8 + 1 of 257): bytes read per call over
                     CUDA-graph time, against the H200's 4.8 TB/s (bar: 70%);
  fp8_moe_configs    the FP8 MoE GEMV at DeepSeek-V3's experts, the default launch config against each
                     of fp8_triton_gemv.candidate_configs (the per-weight scaled kernels among them).
Prints a table at the end and writes check_low_precision_gpu.json to --out (default: $OUT, or .).
The engine helpers (make_llm, decode_tok_s, free) are scripts/bench_gpu.py's.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu  # noqa: E402  (make_llm, decode_tok_s, free, CONFIGS)
from foretell import LLM, SamplingParams  # noqa: E402

H200_BYTES_S = 4.8e12  # the datasheet's HBM3e bandwidth (device-to-device copies reach about 4.3e12)
RESULTS: dict = {}
FP8_BLOCK_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

DEEPSEEK_V3 = {  # config.json of deepseek-ai/DeepSeek-V3 (../shared/notes/checkpoint-formats.md, section 3)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1, "quantization_config": FP8_BLOCK_CONFIG,
}
KIMI_K25_TEXT = dict(  # Kimi-K2.5's text_config: K2's dimensions, 384 experts, no MTP layer
    DEEPSEEK_V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, vocab_size=163840,
    num_nextn_predict_layers=0, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144,
    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    bos_token_id=163584, eos_token_id=163585)
KIMI_K25_TEXT.pop("quantization_config")
KIMI_INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
KIMI_EAGLE3_HEAD = {  # a 3B-class EAGLE3 head for Kimi-K2.5 (lightseekorg/kimi-k2.5-eagle3's shape)
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168, "intermediate_size": 12288,
    "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128, "num_hidden_layers": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 262144, "vocab_size": 163840,
    "draft_vocab_size": 163840, "target_hidden_size": 7168, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def folder_with(config: dict) -> str:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as e:  # record and go on
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            gc.collect()
            torch.cuda.empty_cache()
            RESULTS.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 1)
            print(f"[{name}] {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
        run.section_name = name
        return run
    return wrap


def greedy_tokens(llm: LLM, num_prompts: int = 4, max_tokens: int = 32) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [(11 * i + j) % 5000 + 3 for j in range(24 + 7 * i)]} for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    failed = [o.error for o in outs if o.error is not None]
    if failed:  # two failed runs would give equal (empty) tokens: never count that as agreement
        raise RuntimeError(f"{len(failed)} of {num_prompts} greedy requests failed: {failed[0]}")
    return [o.outputs[0].token_ids for o in outs]


def end_to_end(folder: str, spec: dict, **kw) -> dict:
    """Plain greedy, then with speculation: the same tokens, and the speculative run's acceptance."""
    out = {}
    llm = bench_gpu.make_llm(folder, max_num_seqs=4, **kw)
    out["gpu_memory_gb"] = round(torch.cuda.memory_allocated() / 2**30, 1)
    plain = greedy_tokens(llm)
    out["plain_tok_s_b1"] = bench_gpu.decode_tok_s(llm, 1, new_tokens=32)["tok_s"]
    bench_gpu.free(llm)
    llm = bench_gpu.make_llm(folder, spec, max_num_seqs=4, **kw)
    spec_tokens = greedy_tokens(llm)
    out["spec_tok_s_b1"] = bench_gpu.decode_tok_s(llm, 1, new_tokens=32)["tok_s"]
    out["greedy_equal"] = spec_tokens == plain
    out["mean_acceptance_length"] = llm.get_stats().get("mean_acceptance_length")
    bench_gpu.free(llm)
    return out


@section("deepseek_v3_cut")
def deepseek_v3_cut():
    config = dict(DEEPSEEK_V3, num_hidden_layers=3, first_k_dense_replace=1)
    return end_to_end(folder_with(config), {"method": "mtp", "num_speculative_tokens": 3})


@section("kimi_k25_cut")
def kimi_k25_cut():
    text = dict(KIMI_K25_TEXT, num_hidden_layers=3)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "quantization_config": KIMI_INT4_CONFIG, "tie_word_embeddings": False, "dtype": "bfloat16",
              "bos_token_id": 163584, "eos_token_id": 163585}
    head = folder_with(dict(KIMI_EAGLE3_HEAD, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))
    return end_to_end(folder_with(config), {"method": "eagle3", "model": head, "num_speculative_tokens": 3})


@section("llama_fp8")
def llama_fp8(mean_length: float = 2.93):
    model = f"{bench_gpu.CONFIGS}/llama-3.1-8b"
    spec = {"method": "eagle3", "model": f"{bench_gpu.CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
            "simulate_acceptance": {"mean_acceptance_length": mean_length}}
    out = {}
    for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        llm = bench_gpu.make_llm(model, max_num_seqs=4, **kw)
        out[f"{name}_decode_tok_s_b1"] = bench_gpu.decode_tok_s(llm, 1)["tok_s"]
        bench_gpu.free(llm)
        llm = bench_gpu.make_llm(model, spec, max_num_seqs=4, **kw)
        row = bench_gpu.decode_tok_s(llm, 1)
        out[f"{name}_eagle3_k3_tok_s_b1"] = row["tok_s"]
        out[f"{name}_eagle3_mean_acceptance_length"] = row.get("mean_acceptance_length")
        bench_gpu.free(llm)
    out["fp8_over_bf16_decode"] = out["fp8_decode_tok_s_b1"] / out["bf16_decode_tok_s_b1"]
    out["bars"] = {"decode_450": out["fp8_decode_tok_s_b1"] >= 450, "eagle3_1000": out["fp8_eagle3_k3_tok_s_b1"] >= 1000}
    return out


@section("v2_lite_fp8")
def v2_lite_fp8():
    config = json.load(open(f"{bench_gpu.CONFIGS}/deepseek-v2-lite/config.json"))
    out = {}
    for name, cfg in (("bf16", config), ("fp8", dict(config, quantization_config=FP8_BLOCK_CONFIG))):
        llm = bench_gpu.make_llm(folder_with(cfg), max_num_seqs=4)
        out[f"{name}_tok_s_b1"] = bench_gpu.decode_tok_s(llm, 1, new_tokens=64)["tok_s"]
        bench_gpu.free(llm)
    out["fp8_over_bf16"] = out["fp8_tok_s_b1"] / out["bf16_tok_s_b1"]
    out["bar_1_7x"] = out["fp8_over_bf16"] >= 1.7
    return out


def graph_time_s(fn, iters: int = 50) -> float:
    """Median time of one replay of fn captured in a CUDA graph (CUDA events)."""
    for _ in range(3):
        fn()  # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


V3_HIDDEN, V3_INTER, V3_TOP_K, V3_EXPERTS = 7168, 2048, 8, 257  # 256 routed + 1 shared FP8 experts


def v3_fp8_experts(dev):
    """DeepSeek-V3's FP8 experts (128x128 blocks): gate_up, its scales, down, its scales."""
    h, inter, experts = V3_HIDDEN, V3_INTER, V3_EXPERTS
    gu = torch.randn(experts, 2 * inter, h, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    gu_s = torch.full((experts, 2 * inter // 128, h // 128), 0.02, device=dev)
    dn = torch.randn(experts, h, inter, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    dn_s = torch.full((experts, h // 128, inter // 128), 0.02, device=dev)
    return gu, gu_s, dn, dn_s


def v3_routed_tokens(tokens: int, dev):
    """x [tokens, H] bf16, routing weights [tokens, 9] and ids: 8 distinct routed experts each, then the
    shared one (id 256) as the ninth slot."""
    x = torch.randn(tokens, V3_HIDDEN, device=dev, dtype=torch.bfloat16)
    routed = torch.stack([torch.randperm(V3_EXPERTS - 1, device=dev)[:V3_TOP_K] for _ in range(tokens)])
    ids = torch.cat([routed, torch.full((tokens, 1), V3_EXPERTS - 1, device=dev)], dim=1)
    return x, torch.rand(tokens, V3_TOP_K + 1, device=dev), ids


@section("int4_moe_bandwidth")
def moe_bandwidth(token_counts=(1, 2, 4)):
    from foretell.ops.moe.fp8_triton_gemv import fused_fp8_experts_gemv_triton
    from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton

    dev, out = torch.device("cuda"), {}
    h, inter, top_k = 7168, 2048, 8
    gen = torch.Generator(device=dev).manual_seed(0)
    # Kimi-K2.5: 384 int4 experts; every token's 8 experts distinct, so a token reads 8 experts' bytes
    experts = 384
    gu_p = torch.randint(-2**31, 2**31 - 1, (experts, 2 * inter, h // 8), generator=gen, device=dev, dtype=torch.int32)
    gu_s = torch.full((experts, 2 * inter, h // 32), 0.005, device=dev, dtype=torch.bfloat16)
    d_p = torch.randint(-2**31, 2**31 - 1, (experts, h, inter // 8), generator=gen, device=dev, dtype=torch.int32)
    d_s = torch.full((experts, h, inter // 32), 0.005, device=dev, dtype=torch.bfloat16)
    per_expert = sum(t[0].numel() * t.element_size() for t in (gu_p, gu_s, d_p, d_s))
    for tokens in token_counts:
        x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device=dev)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, device=dev)
        used = ids.unique().numel()
        seconds = graph_time_s(lambda: fused_int4_experts_gemv_triton(x, gu_p, gu_s, d_p, d_s, weights, ids,
                                                                      out_dtype=torch.bfloat16))
        out[f"int4_kimi_t{tokens}"] = {"us": seconds * 1e6, "bytes": used * per_expert,
                                       "fraction_of_bandwidth": used * per_expert / seconds / H200_BYTES_S}
    del gu_p, gu_s, d_p, d_s
    gu, gu_s, dn, dn_s = v3_fp8_experts(dev)
    per_expert = sum(t[0].numel() * t.element_size() for t in (gu, gu_s, dn, dn_s))
    for tokens in token_counts:
        x, weights, ids = v3_routed_tokens(tokens, dev)
        used = ids.unique().numel()
        seconds = graph_time_s(lambda: fused_fp8_experts_gemv_triton(x, gu, gu_s, dn, dn_s, (128, 128), weights, ids))
        out[f"fp8_v3_t{tokens}"] = {"us": seconds * 1e6, "bytes": used * per_expert,
                                    "fraction_of_bandwidth": used * per_expert / seconds / H200_BYTES_S}
    out["bar_int4_70pct_t1"] = out["int4_kimi_t1"]["fraction_of_bandwidth"] >= 0.7
    return out


@section("fp8_moe_configs")
def fp8_moe_configs(token_counts=(1, 4)):
    """The FP8 MoE GEMV at DeepSeek-V3's experts (8 routed + the shared one of 257, 128x128 blocks)
    with its default launch config and each of the module's candidate_configs, one layer in a
    CUDA graph, the default re-timed before each candidate (its median and spread reported)."""
    from foretell.ops.moe.fp8_triton_gemv import candidate_configs, fused_fp8_experts_gemv_triton

    dev, out = torch.device("cuda"), {}
    gu, gu_s, dn, dn_s = v3_fp8_experts(dev)
    per_expert = sum(t[0].numel() * t.element_size() for t in (gu, gu_s, dn, dn_s))
    for tokens in token_counts:
        x, weights, ids = v3_routed_tokens(tokens, dev)
        used_bytes = ids.unique().numel() * per_expert

        def timed(config):
            seconds = graph_time_s(lambda: fused_fp8_experts_gemv_triton(x, gu, gu_s, dn, dn_s, (128, 128), weights,
                                                                         ids, config=config))
            share = round(used_bytes / seconds / H200_BYTES_S, 4)
            return {"us": round(seconds * 1e6, 2), "fraction_of_bandwidth": share}

        defaults, rows = [], []
        for config in candidate_configs(tokens, ids.shape[1]):
            defaults.append(timed(None)["us"])
            rows.append({"config": config, **timed(config)})
        defaults.append(timed(None)["us"])
        default_us = sorted(defaults)[len(defaults) // 2]
        out[f"t{tokens}_default"] = {"us": default_us, "min_us": min(defaults), "max_us": max(defaults),
                                     "fraction_of_bandwidth": round(used_bytes / (default_us * 1e-6) / H200_BYTES_S, 4)}
        out[f"t{tokens}_candidates"] = sorted(rows, key=lambda r: r["us"])
    return out


SECTIONS = {fn.section_name: fn for fn in (deepseek_v3_cut, kimi_k25_cut, llama_fp8, v2_lite_fp8, moe_bandwidth,
                                           fp8_moe_configs)}


def print_table() -> None:
    print(f"\n{'section':<20} {'measure':<40} value")
    for name, result in RESULTS.items():
        if name.startswith("_"):
            continue
        for key, value in result.items():
            if key == "traceback":
                continue
            if isinstance(value, dict):
                value = {k: round(v, 3) if isinstance(v, float) else v for k, v in value.items()}
            elif isinstance(value, float):
                value = round(value, 2)
            print(f"{name:<20} {key:<40} {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for check_low_precision_gpu.json")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run these sections only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_low_precision_gpu.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or list(SECTIONS):
        SECTIONS[name]()
        with open(os.path.join(args.out, "check_low_precision_gpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)
    print_table()


if __name__ == "__main__":
    main()
