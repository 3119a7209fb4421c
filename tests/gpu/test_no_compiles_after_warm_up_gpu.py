"""Issue 32's bar on a GPU: after the engine's warm-up, serving prompts of 200 distinct lengths
(twice, the second pass over the prefix cache) compiles no Triton kernel, with the default family
and EAGLE3 as `foretell serve` runs it. A compilation is a latency spike some request pays.

scripts/check_serving_gpu.py measures the same thing with each compilation's kernel and key.
"""

from __future__ import annotations

from foretell import LLM, SamplingParams
from foretell.bench.datasets import gsm8k_test_prompts
from foretell.defaults import member_path
from foretell.runner.jit_counter import jit_compile_counter


def test_two_hundred_prompt_lengths_compile_nothing_after_warm_up():
    counter = jit_compile_counter()  # installed before the engine, as the server does
    spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}
    with LLM(member_path("target"), device="cuda", speculative_config=spec,
             kv_cache_memory_bytes=2 << 30) as llm:
        ids = llm.tokenizer.encode(" ".join(gsm8k_test_prompts(400)))
        longest = min(llm.engine.max_model_len - 16, len(ids))
        lengths = sorted({1 + i * (longest - 1) // 199 for i in range(200)})
        assert len(lengths) == 200
        after_warm_up = counter.count
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(2):
            for n in lengths:
                llm.generate([{"prompt_token_ids": ids[:n]}], params, use_tqdm=False)
        assert counter.count == after_warm_up, f"{counter.count - after_warm_up} compilations after warm-up"
