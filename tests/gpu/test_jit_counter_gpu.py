"""The compilation counter on a real GPU: a kernel's first launch with a new specialization
compiles (count +1), a second launch of the same one does not, a new constexpr compiles again."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.runner.jit_counter import jit_compile_counter


@triton.jit
def _add_constant(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + VALUE, mask=mask)


def test_counts_each_new_specialization_once():
    counter = jit_compile_counter()
    x = torch.zeros(100, device="cuda")
    start = counter.count
    _add_constant[(1,)](x, 100, VALUE=1.0, BLOCK=128)
    torch.cuda.synchronize()
    assert counter.count == start + 1
    _add_constant[(1,)](x, 100, VALUE=1.0, BLOCK=128)
    assert counter.count == start + 1  # cached: no compilation
    _add_constant[(1,)](x, 100, VALUE=2.0, BLOCK=128)
    torch.cuda.synchronize()
    assert counter.count == start + 2
    assert torch.equal(x, torch.full_like(x, 4.0))
