"""The fused MoE kernels (align, gate_up + SiLU-and-mul, down + routing weights) held against
their torch twins (`moe_align_torch`, `experts_forward_torch`) in Triton's interpreter, on random
routings: top-k 2..6, 8..64 experts, some experts without tokens, odd sizes. Fresh random inputs
every run; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.moe.reference import experts_forward_torch

if torch.cuda.is_available():
    pytest.skip("on a GPU the kernels are tested in tests/gpu/test_mla_moe_gpu.py", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: F401  (autouse fixture)

moe_triton = import_interpreted("foretell.ops.moe.triton_experts")
TOLERANCE = {torch.float16: 2e-2, torch.float32: 1e-4}


def _seed() -> int:
    return random.randrange(2**31)


def routing(num_tokens, num_experts, top_k, gen, skip_experts=0):
    """Distinct experts per token, drawn from all but `skip_experts` of them (which get none)."""
    allowed = torch.randperm(num_experts, generator=gen)[: num_experts - skip_experts]
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights, ids


def experts(num_experts, hidden, inter, dtype, gen):
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return gate_up, down


def poison_buffers(monkeypatch):
    """Buffers the kernels allocate start as NaN (floats) or out-of-range indices (ints), so a
    row or column a kernel forgets to write, or a padding row it reads, shows in the output."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, inter, skip",
    [(1, 8, 2, 32, 16, 0), (5, 16, 6, 48, 40, 4), (23, 8, 3, 32, 24, 2), (40, 64, 4, 16, 32, 30),
     (3, 64, 6, 64, 16, 0), (70, 16, 2, 24, 16, 8)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fused_experts_match_torch(num_tokens, num_experts, top_k, hidden, inter, skip, dtype, monkeypatch):
    poison_buffers(monkeypatch)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up, down = experts(num_experts, hidden, inter, dtype, gen)
    weights, ids = routing(num_tokens, num_experts, top_k, gen, skip)
    expected = experts_forward_torch(x, gate_up, down, weights, ids)
    for align_kernel in (True, False):
        out = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, align_kernel=align_kernel)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol,
                                   msg=lambda m, a=align_kernel: f"align_kernel={a} (seed {seed}): {m}")


@pytest.mark.parametrize("num_tokens, top_k, hidden", [(1, 6, 48), (7, 2, 1100), (30, 3, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("path", ["grouped", "gemv"])
def test_shared_experts_added_and_cast_once(num_tokens, top_k, hidden, dtype, path):
    """The combine step (the combine kernel, or the GEMV path's down kernel): top_k rows summed,
    the shared experts' output added in float32, one cast to the model dtype (what MoE.forward's
    torch path computes); hidden 1100 spans two blocks."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up, down = experts(8, hidden, 24, dtype, gen)
    weights, ids = routing(num_tokens, 8, top_k, gen, 1)
    shared = torch.randn(2 * num_tokens, hidden, generator=gen).to(dtype)[::2]  # rows strided
    expected = (experts_forward_torch(x, gate_up, down, weights, ids) + shared).to(dtype)
    out = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=dtype, path=path)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("path", ["grouped", "gemv"])
def test_combine_sums_every_top_k_row_in_float32(path):
    """With expert outputs that cancel in low precision, only a float32 sum before the one cast
    gives the exact answer."""
    x = torch.ones(1, 16, dtype=torch.float16)
    gate_up, down = torch.zeros(2, 32, 16, dtype=torch.float16), torch.zeros(2, 16, 16, dtype=torch.float16)
    gate_up[:, :16] = 1.0  # silu(16) * 16 per intermediate row
    gate_up[:, 16:] = 1.0
    down[0] = 1.0
    down[1] = -1.0
    weights = torch.tensor([[1.0, 1.0]])
    ids = torch.tensor([[0, 1]])
    shared = torch.full((1, 16), 0.5, dtype=torch.float16)
    out = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=torch.float16,
                                          path=path)
    assert torch.equal(out, shared)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_larger_row_blocks(block_m):
    # Prefill-sized blocks, several blocks for one expert, K and N not multiples of the tiles.
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(90, 40, generator=gen).half()
    gate_up, down = experts(8, 40, 24, torch.float16, gen)
    weights, ids = routing(90, 8, 2, gen, skip_experts=3)
    config = {"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 16}
    out = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, config=config)
    torch.testing.assert_close(out, experts_forward_torch(x, gate_up, down, weights, ids),
                               rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("num_pairs, num_experts, block_m", [(1, 8, 16), (12, 64, 16), (200, 16, 16), (700, 8, 64),
                                                             (333, 384, 16)])
def test_align_kernel_matches_twin(num_pairs, num_experts, block_m):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    used = torch.randperm(num_experts, generator=gen)[: max(1, num_experts // 2)]
    flat_ids = used[torch.randint(len(used), (num_pairs,), generator=gen)]
    max_blocks = moe_triton.max_moe_blocks(num_pairs, num_experts, block_m)
    pairs, block_expert, rows = moe_triton._align(flat_ids, num_experts, block_m, max_blocks)
    ref_pairs, ref_expert, ref_rows = moe_triton.moe_align_torch(flat_ids, num_experts, block_m, max_blocks)
    assert torch.equal(block_expert, ref_expert), f"seed {seed}"
    assert torch.equal(rows, ref_rows), f"seed {seed}"
    real = (torch.arange(block_m)[None, :] < rows[:, None]).flatten()
    assert torch.equal(pairs[real], ref_pairs[real]), f"seed {seed}"
    # Every pair appears once, grouped by expert in ascending order, token order within one.
    assert sorted(ref_pairs[real].tolist()) == list(range(num_pairs))
    assert torch.equal(ref_pairs[real].long(), flat_ids.argsort(stable=True))
    assert int(rows.sum()) == num_pairs and bool((block_expert[rows == 0] == num_experts).all())


def test_no_tokens_and_bad_shapes():
    x = torch.zeros(0, 16)
    gate_up, down = torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    assert moe_triton.fused_experts_triton(x, gate_up, down, torch.zeros(0, 2), ids).shape == (0, 16)
    with pytest.raises(ValueError, match=r"shared must be \[0, 16\]"):
        moe_triton.fused_experts_triton(x, gate_up, down, torch.zeros(0, 2), ids, shared=torch.zeros(1, 16))
    empty = moe_triton.fused_experts_triton(x, gate_up, down, torch.zeros(0, 2), ids, shared=torch.zeros(0, 16),
                                            out_dtype=torch.float16)
    assert empty.shape == (0, 16) and empty.dtype == torch.float16
    with pytest.raises(ValueError, match="experts do not fit"):
        moe_triton.fused_experts_triton(torch.zeros(3, 8), gate_up, down, torch.zeros(3, 2), torch.zeros(3, 2).long())
