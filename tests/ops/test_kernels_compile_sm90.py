"""The newest Triton kernels (and older ones sharing their helpers) compile for an H100/H200 (sm_90)
without a GPU: Triton's frontend, its passes and ptxas run ahead of time, so an error that Triton's
interpreter cannot see (a constexpr branch, a type, a layout, a register limit) shows in CI rather
than in the first minutes of a GPU session. The kernels are compiled at the shapes the engine
launches them with (DeepSeek-V2-Lite, Kimi-K2, Llama-3.1-8B, Qwen3); correctness is the
interpreter tests' and tests/gpu's job.

The compiles run in one fresh process (fixtures/kernel_compile.py): kernel modules imported here
for the interpreter would be interpreter functions, and the other way round. Skipped when this
Triton cannot compile for CUDA on this machine (no CUDA backend or ptxas).
"""

from __future__ import annotations

import importlib.util

import pytest

from fixtures.sm90_compile import compile_cases

# Looked up, not imported: triton imported here without TRITON_INTERPRET would make the interpreter
# tests collected after this module build GPU kernels (fixtures/triton_interpreter.py).
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

CASES = [
    "argmax chunks", "argmax pick", "gqa attention, split, Llama", "mla absorbed query with rope",
    "mla attention, split, V2-Lite", "mla latent write", "mla merge", "moe gemv down + combine",
    "moe gemv gate_up", "rope + kv write, Qwen3 norms", "rope + kv write, partial rotary", "route, Kimi-K2",
    "route, V2-Lite", "rope (q and k), gptj partial", "select experts, Kimi-K2", "router logits",
    "gqa attention, unsplit prefill", "gqa attention, tree mask, split verify", "gemv with pdl, Llama qkv", "gemv with pdl, 4 rows, bias",
    "rms norm + residual, pdl trigger", "eagle3 input, Llama, pdl", "mma with pdl, split-K 4, Llama o", "mma with pdl, bias",
    "gemv with pdl, gated output (gate_up), bias", "mma with pdl, gated output (gate_up), split-K 2",
    "rope + gqa attention, split decode, Llama", "rope + gqa attention, verify, Qwen3 norms", "graph inputs unpack",
    "verify step: accept drawn (simulated), capped", "verify step: accept, greedy", "verify step: draft catch-up inputs",
    "verify step: next verify inputs",
    "batch-invariant linear, split-K 4, 128-row tiles", "batch-invariant linear, gated, decode tiles",
    "batch-invariant linear, LM head float32 out", "batch-invariant moe align, V2-Lite",
    "batch-invariant moe gate_up, V2-Lite", "batch-invariant moe down, V2-Lite", "batch-invariant moe combine, shared",
    "batch-invariant mla attention, V2-Lite", "batch-invariant mla attention, V3 heads",
    "batch-invariant mla absorbed query with rope", "batch-invariant mla value projection",
    "token bitmask, fallback, row index", "token bitmask, slice", "rope + gqa attention, tree mask, verify",
]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_cases("fixtures.kernel_compile")


def test_every_case_was_compiled(compiled):
    assert sorted(compiled) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90(compiled, case):
    assert compiled[case] == "ok", compiled[case]
