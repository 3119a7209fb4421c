"""The Triton compilation counter: it sits in Triton's jit_post_compile_hook slot, counts every
call, keeps calling the hook it replaced, is installed once per process however often it is asked
for, and is what Engine.get_stats() reports as jit_compiles. (A real compilation needs a GPU:
tests/gpu/test_jit_counter_gpu.py; the interpreter compiles nothing, so on the CPU it stays put.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from foretell.runner.jit_counter import JitCompileCounter, jit_compile_counter

HOOK_KWARGS = {"key": "k", "repr": "kernel[...]", "fn": None, "compile": {}, "is_manual_warmup": False,
               "already_compiled": False}


def test_counts_and_chains_the_previous_hook():
    seen = []
    knobs = SimpleNamespace(jit_post_compile_hook=lambda **kw: seen.append(kw["key"]))
    counter = jit_compile_counter(knobs)
    assert knobs.jit_post_compile_hook is counter and counter.count == 0
    for i in range(3):
        knobs.jit_post_compile_hook(**{**HOOK_KWARGS, "key": i})  # as Triton calls it
    assert counter.count == 3 and seen == [0, 1, 2]
    assert jit_compile_counter(knobs) is counter  # installed once, shared
    assert counter.previous_hook is not None and not isinstance(counter.previous_hook, JitCompileCounter)


def test_empty_slot_and_concurrent_compiles():
    knobs = SimpleNamespace(jit_post_compile_hook=None)
    counter = jit_compile_counter(knobs)
    assert counter(**HOOK_KWARGS) is None  # no previous hook: returns None (compile goes on)

    def compile_many():
        for _ in range(1000):
            counter(**HOOK_KWARGS)

    threads = [threading.Thread(target=compile_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.count == 4001


def test_installed_in_triton_and_reported_by_the_engine(qwen3_checkpoint):
    knobs = pytest.importorskip("triton").knobs
    from foretell import LLM, SamplingParams

    counter = jit_compile_counter()
    assert knobs.runtime.jit_post_compile_hook is counter
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32, max_model_len=128)
    llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    before = llm.get_stats()["jit_compiles"]
    assert before == counter.count
    knobs.runtime.jit_post_compile_hook(**HOOK_KWARGS)  # what Triton does after compiling
    assert llm.get_stats()["jit_compiles"] == before + 1
