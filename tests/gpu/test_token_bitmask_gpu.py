"""On a CUDA GPU: the grammar mask in one launch (ops/sampling/triton_token_bitmask.py, what
structured/bitmask.apply_token_bitmask runs on CUDA) gives the torch twin's values (computed on the
CPU from the same inputs) at the default family's vocabulary and a 151,936-token one, with and
without the fallback, and is captured in a CUDA graph. Prints the host time of a call in both forms
(the twin: about a dozen small kernels)."""

from __future__ import annotations

import time

import pytest
import torch

from foretell.ops.sampling.triton_token_bitmask import apply_token_bitmask_triton
from foretell.structured.bitmask import apply_token_bitmask, num_mask_words

DEVICE = torch.device("cuda")


def _inputs(rows: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[torch.rand(rows, vocab, generator=gen) < 0.02] = float("nan")
    logits[torch.rand(rows, vocab, generator=gen) < 0.02] = float("inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, num_mask_words(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0
    logits[1] = float("-inf")  # nothing alive: the fallback's row
    return logits, bitmask, torch.randn(rows, vocab, generator=gen)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(nan=0.0), b.nan_to_num(nan=0.0))


@pytest.mark.parametrize("vocab", [4096, 151936])
@pytest.mark.parametrize("with_fallback", [False, True], ids=["plain", "fallback"])
def test_one_launch_equals_the_twin_and_costs_one_launch(vocab, with_fallback):
    logits, bitmask, fallback = _inputs(4, vocab, seed=vocab)
    fb = fallback if with_fallback else None
    want = logits.clone()
    apply_token_bitmask(want, slice(0, 4), bitmask, fb)  # the twin, on the CPU
    got = logits.to(DEVICE)
    apply_token_bitmask(got, slice(0, 4), bitmask.to(DEVICE), None if fb is None else fb.to(DEVICE))
    assert _same(got.cpu(), want)
    indexed = logits.to(DEVICE)
    apply_token_bitmask_triton(indexed, torch.arange(4, device=DEVICE), bitmask.to(DEVICE),
                               None if fb is None else fb.to(DEVICE))
    assert _same(indexed.cpu(), want)

    def host_us(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - start) / 50 * 1e6
        torch.cuda.synchronize()
        return host

    x, m, f = logits.to(DEVICE), bitmask.to(DEVICE), None if fb is None else fb.to(DEVICE)
    from foretell.structured import bitmask as bitmask_module

    one = host_us(lambda: apply_token_bitmask(x, slice(0, 4), m, f))
    original = bitmask_module.use_triton
    bitmask_module.use_triton = lambda *tensors: False  # the twin on the device
    try:
        twin = host_us(lambda: apply_token_bitmask(x, slice(0, 4), m, f))
    finally:
        bitmask_module.use_triton = original
    print(f"bitmask 4 x {vocab} ({'fallback' if fb is not None else 'plain'}): one launch {one:.1f} us a call "
          f"on the host, the torch twin {twin:.1f}")


def test_captured_in_a_cuda_graph():
    logits, bitmask, fallback = _inputs(4, 4096, seed=1)
    want = logits.clone()
    apply_token_bitmask(want, None, bitmask, fallback)
    x, m, f = logits.to(DEVICE), bitmask.to(DEVICE), fallback.to(DEVICE)
    static = x.clone()
    apply_token_bitmask_triton(static, None, m, f)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    static.copy_(x)
    with torch.cuda.graph(graph):
        apply_token_bitmask_triton(static, None, m, f)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(static.cpu(), want)
