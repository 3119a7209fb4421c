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


def _compiles_after_warm_up(spec: dict, prompts: list[str], batch: bool) -> list[str]:
    """The kernels Triton compiled after the engine's warm-up while serving prompts, each with its
    compile key (argument types, alignments, constexprs) and the keys the same kernel was compiled
    with at start-up, so a failure shows which specialization was new."""
    counter = jit_compile_counter()
    compiled: list[tuple[str, str, str]] = []  # (phase, kernel, key)
    phase = ["start-up"]
    previous = counter.previous_hook

    def recording(**hook_kwargs):
        fn = hook_kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", fn), "__name__", str(fn))
        compiled.append((phase[0], name, str(hook_kwargs.get("key"))[:700]))
        return previous(**hook_kwargs) if previous is not None else None

    counter.previous_hook = recording
    try:
        with LLM(member_path("target"), device="cuda", speculative_config=spec, kv_cache_memory_bytes=2 << 30) as llm:
            phase[0] = "serving"
            params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
            for _ in range(2):
                if batch:
                    llm.generate(prompts, params, use_tqdm=False)
                else:
                    for prompt in prompts:
                        llm.generate([prompt], params, use_tqdm=False)
    finally:
        counter.previous_hook = previous
    late = [(name, key) for when, name, key in compiled if when == "serving"]
    early = {name: [key for when, n, key in compiled if when == "start-up" and n == name] for name, _ in late}
    return [f"{name} key={key}; at start-up: {early[name]}" for name, key in late]


def test_adaptive_speculation_compiles_nothing_after_warm_up():
    """Every k in 0..K (k = 0 decoded plainly) is met in the warm-up (engine/warm_up.py), so adaptive
    speculation's choices compile nothing in serving, alone or batched."""
    spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": "auto"}
    batched = _compiles_after_warm_up(spec, gsm8k_test_prompts(16), batch=True)
    assert not batched, "\n".join(batched)
    alone = _compiles_after_warm_up(spec, gsm8k_test_prompts(4), batch=False)
    assert not alone, "\n".join(alone)


def test_suffix_drafting_compiles_nothing_after_warm_up():
    """A host drafter drafts nothing on the warm-up's dummy prompts; its verification kernels are
    compiled at start-up instead (GraphedVerify.compile_verification)."""
    from foretell.bench.repetitive import repetitive_prompts

    spec = {"method": "suffix", "num_speculative_tokens": 16}
    assert _compiles_after_warm_up(spec, [p.text for p in repetitive_prompts(8)], batch=False) == []


def test_plain_decoding_over_repeated_prompts_compiles_nothing_after_warm_up():
    """The second pass over the repetitive set's prompts prefills short tails over long cached
    prefixes (the one-launch attention with a query block of 9..16 tokens and its context split),
    which the warm-up's own cached prompts did not reach until its cached-tail requests."""
    from foretell.bench.repetitive import repetitive_prompts

    assert _compiles_after_warm_up(None, [p.text for p in repetitive_prompts(8)], batch=False) == []
