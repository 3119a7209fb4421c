"""A/B of the start-up warm-up on plain decoding of the default models (H200 diagnostic):
    python scripts/ab_warm_up.py"""
import sys, time
sys.path.insert(0, ".")
from foretell import LLM, SamplingParams
from foretell.defaults import member_path
from foretell.bench.datasets import gsm8k_test_prompts

prompts = gsm8k_test_prompts(12)
params = SamplingParams(temperature=0, max_tokens=128)
for family in ("qwen3", "deepseek"):
    for mode in ("off", "on", "off", "on"):
        llm = LLM(member_path("target", family), device="cuda", dtype="bfloat16", max_num_seqs=4,
                  kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False, warm_up=mode, log_stats_interval_s=0)
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        pipeline = llm.engine.runner.pipeline
        print(family, mode, round(tokens / (time.perf_counter() - start), 1), "tok/s; ahead used/launched",
              pipeline.num_used, pipeline.num_launched, flush=True)
        del llm
