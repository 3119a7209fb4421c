"""The GEMV MoE path (ops/moe/triton_gemv.py: gate_up GEMV, down GEMV + combine) held against its
torch twin `experts_forward_torch` (+ the shared experts' output) and against the grouped path in
Triton's interpreter: 1-3 tokens, top_k 1, 2 and 8 (6 routed + 2 shared experts that every token
picks), sizes that are not multiples of the tiles, the slot split of the down kernel, the
dispatch of fused_experts_triton, and bad inputs. Buffers the kernels allocate start poisoned;
fresh random inputs every run, a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.moe.reference import experts_forward_torch

if torch.cuda.is_available():
    pytest.skip("on a GPU the kernels are tested in tests/gpu/test_moe_gemv_gpu.py", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: F401  (autouse fixture)

gemv = import_interpreted("foretell.ops.moe.triton_gemv")
moe_triton = import_interpreted("foretell.ops.moe.triton_experts")
TOLERANCE = {torch.float16: 2e-2, torch.float32: 1e-4}
# gemv and grouped round the same values at the same points; only the order of the float32
# reduction inside a projection differs, which can move a float16 rounding by one ulp.
PATHS_TOLERANCE = {torch.float16: 5e-3, torch.float32: 1e-5}
ROUTED = 10  # routed experts; shared experts are packed after them
SMALL_TILES = {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 64}, "down": {"BLOCK_N": 64, "BLOCK_K": 32}}  # 2 K chunks


def _seed() -> int:
    return random.randrange(2**31)


def poison_buffers(monkeypatch):
    """torch.empty returns NaN (floats) or 2**30 (ints): an unwritten output column, a scratch
    slot read before it is written or a counter nobody zeroed shows in the output."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


def moe_case(num_tokens, top_k, hidden, inter, dtype, gen, with_shared=False):
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights / ids [T, top_k], shared [T, H] or None.
    top_k 8 is V2-Lite's routing: 6 routed experts per token, then the 2 shared ones (ids 10, 11,
    weight 1) that every token picks."""
    num_shared = 2 if top_k == 8 else 0
    routed = top_k - num_shared
    ids = torch.stack([torch.randperm(ROUTED, generator=gen)[:routed] for _ in range(num_tokens)])
    ids = torch.cat([ids, torch.arange(ROUTED, ROUTED + num_shared).expand(num_tokens, num_shared)], dim=1)
    weights = torch.cat([torch.rand(num_tokens, routed, generator=gen), torch.ones(num_tokens, num_shared)], dim=1)
    num_experts = ROUTED + num_shared
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_shared else None
    return x, gate_up, down, weights, ids, shared


def reference(x, gate_up, down, weights, ids, shared, out_dtype):  # [T, H] out_dtype
    out = experts_forward_torch(x, gate_up, down, weights, ids)  # float32
    return (out if shared is None else out + shared).to(out_dtype)


@pytest.mark.parametrize(
    "num_tokens, top_k, hidden, inter, with_shared, out",
    [(1, 1, 72, 40, False, "float32"), (1, 8, 96, 80, True, "model"), (2, 2, 64, 48, True, "float32"),
     (3, 8, 72, 40, False, "model"), (2, 8, 72, 56, True, "bfloat16")],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gemv_matches_torch(num_tokens, top_k, hidden, inter, with_shared, out, dtype, monkeypatch):
    """Default tiles (one K chunk, the slot split the heuristic picks at these sizes)."""
    poison_buffers(monkeypatch)
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_case(num_tokens, top_k, hidden, inter, dtype,
                                                      torch.Generator().manual_seed(seed), with_shared)
    out_dtype = dtype if out == "model" else getattr(torch, out)
    got = gemv.fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=out_dtype)
    expected = reference(x, gate_up, down, weights, ids, shared, out_dtype)
    assert got.dtype == out_dtype and got.shape == (num_tokens, hidden)
    tol = max(TOLERANCE[dtype], 1e-2 if out_dtype == torch.bfloat16 else 0)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gemv_equals_grouped_path(dtype, monkeypatch):
    """Both paths of fused_experts_triton on one input: 3 tokens, top_k 8 with shared experts,
    K and N not multiples of the tiles (several K chunks)."""
    poison_buffers(monkeypatch)
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_case(3, 8, 80, 56, dtype, torch.Generator().manual_seed(seed),
                                                      with_shared=True)
    got = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=dtype,
                                          path="gemv", config=SMALL_TILES)
    grouped = moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=dtype,
                                              path="grouped")
    tol = PATHS_TOLERANCE[dtype]
    torch.testing.assert_close(got, grouped, rtol=tol, atol=tol, msg=lambda m: f"gemv vs grouped (seed {seed}): {m}")
    torch.testing.assert_close(got, reference(x, gate_up, down, weights, ids, shared, dtype),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], msg=lambda m: f"seed {seed}: {m}")


def test_slot_split_is_bitwise_the_same(monkeypatch):
    """SPLIT 1 (one program sums all slots), 3 (groups of 3, 3 and 2 slots) and 8 (a slot per
    program, the last to arrive sums): the same float32 sum in slot order, bit for bit."""
    poison_buffers(monkeypatch)
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_case(2, 8, 80, 56, torch.float16,
                                                      torch.Generator().manual_seed(seed), with_shared=True)
    outs = [gemv.fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared,
                                           config={**SMALL_TILES, "SPLIT": split}) for split in (1, 3, 8)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), f"seed {seed}"
    torch.testing.assert_close(outs[0], reference(x, gate_up, down, weights, ids, shared, torch.float32),
                               rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")


def test_tokens_on_the_same_expert_twice(monkeypatch):
    """Both tokens route both slots to expert 3 (a pair's expert is read per pair, never grouped)."""
    poison_buffers(monkeypatch)
    seed = _seed()
    x, gate_up, down, _, _, _ = moe_case(2, 2, 64, 48, torch.float32, torch.Generator().manual_seed(seed))
    ids = torch.full((2, 2), 3)
    weights = torch.tensor([[0.25, 0.5], [1.0, 0.125]])
    got = gemv.fused_experts_gemv_triton(x, gate_up, down, weights, ids, config={"SPLIT": 2})
    torch.testing.assert_close(got, reference(x, gate_up, down, weights, ids, None, torch.float32),
                               rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("split", [1, 2])
def test_sum_in_float32_before_the_one_cast(split):
    """Slot outputs 4096, 1 and -4096 (then shared 0.5): a float16 running sum loses the 1
    (4097 rounds to 4096); the float32 sum, cast once, gives 1.5. SPLIT 2 groups 2 + 1 slots."""
    x = torch.ones(1, 16, dtype=torch.float16)
    gate_up, down = torch.ones(3, 32, 16, dtype=torch.float16), torch.ones(3, 16, 16, dtype=torch.float16)
    down[2] = -1.0  # act = silu(16) * 16 = 256 per intermediate row; y = +-4096
    weights, ids = torch.tensor([[1.0, 2.0**-12, 1.0]]), torch.tensor([[0, 1, 2]])
    shared = torch.full((1, 16), 0.5, dtype=torch.float16)
    out = gemv.fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=torch.float16,
                                         config={"SPLIT": split})
    assert torch.equal(out, torch.full((1, 16), 1.5, dtype=torch.float16))


class _GroupedPathTaken(Exception):
    pass


def test_dispatch_by_token_count(monkeypatch):
    """path None: gemv up to GEMV_MAX_TOKENS tokens, grouped past it or when align_kernel is forced."""
    chosen = []
    monkeypatch.setattr(moe_triton, "launch_gemv_experts", lambda *a: chosen.append("gemv") or "gemv")

    def grouped(*a):
        chosen.append("grouped")
        raise _GroupedPathTaken  # at the grouped path's first launch: enough to know it was taken

    monkeypatch.setattr(moe_triton, "_align", grouped)
    gate_up, down = torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)

    def run(num_tokens, **kw):
        ids = torch.zeros(num_tokens, 2, dtype=torch.int64)
        try:
            moe_triton.fused_experts_triton(torch.zeros(num_tokens, 8), gate_up, down, torch.zeros(num_tokens, 2),
                                            ids, **kw)
        except _GroupedPathTaken:
            pass
        return chosen.pop()

    limit = gemv.GEMV_MAX_TOKENS
    assert [run(1), run(limit), run(limit + 1)] == ["gemv", "gemv", "grouped"]
    assert [run(1, align_kernel=True), run(1, path="grouped"), run(limit + 1, path="gemv")] == \
        ["grouped", "grouped", "gemv"]


def test_no_tokens():
    gate_up, down = torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = gemv.fused_experts_gemv_triton(torch.zeros(0, 16), gate_up, down, torch.zeros(0, 2), ids,
                                         shared=torch.zeros(0, 16), out_dtype=torch.float16)
    assert out.shape == (0, 16) and out.dtype == torch.float16


def test_bad_inputs_raise_clear_errors():
    x, gate_up, down = torch.zeros(3, 16), torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)
    weights, ids = torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64)
    run = gemv.fused_experts_gemv_triton
    with pytest.raises(ValueError, match="experts do not fit"):
        run(torch.zeros(3, 8), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="experts do not fit"):
        run(x, gate_up, torch.zeros(4, 8, 16), weights, ids)
    with pytest.raises(ValueError, match="experts do not fit"):
        run(x, torch.zeros(4, 15, 16), down, weights, ids)
    with pytest.raises(ValueError, match=r"ids must be an integer tensor \[3, top_k\]"):
        run(x, gate_up, down, weights, ids[:2])
    with pytest.raises(ValueError, match=r"ids must be an integer tensor"):
        run(x, gate_up, down, weights, ids.float())
    with pytest.raises(ValueError, match=r"weights must have the shape of ids \(3, 2\)"):
        run(x, gate_up, down, torch.zeros(3, 3), ids)
    with pytest.raises(ValueError, match=r"shared must be \[3, 16\]"):
        run(x, gate_up, down, weights, ids, shared=torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"unknown GEMV MoE config keys \['BLOCK_M', 'down.TILE'\]"):
        run(x, gate_up, down, weights, ids, config={"BLOCK_M": 16, "down": {"TILE": 1}})
    with pytest.raises(ValueError, match="gate_up BLOCK_K must be a power of two, got 48"):
        run(x, gate_up, down, weights, ids, config={"gate_up": {"BLOCK_K": 48}})
    with pytest.raises(ValueError, match="path must be one of"):
        moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, path="dense")
    with pytest.raises(ValueError, match="align_kernel applies to the grouped path only"):
        moe_triton.fused_experts_triton(x, gate_up, down, weights, ids, path="gemv", align_kernel=True)
