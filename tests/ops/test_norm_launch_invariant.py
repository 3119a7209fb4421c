"""RMSNorm's Triton launch does not depend on how many rows it normalises (issue 23).

The H200 run of the batch-invariant mode found the default family's greedy tokens one prompt at a
time differing from 64 at once on 4 of 64 prompts. Its k_norm (2 KV heads x head_dim 64) normalised 2
rows per decode token at batch 1, and rms_norm_triton sized its tile by the row count: a 2 x 64 tile
gets 4 elements a thread over 16 lanes a row, a 4+ row tile 8 over 8, so a row's float32 sum of
squares ran in another order. The tile (BLOCK_ROWS, num_warps) is now a function of the row width
alone. Here: the launch rms_norm_triton makes, recorded, is the same at every row count; the sm_90
compile of those launches gives the same register layouts (fixtures/kernel_compile_norm_layout.py,
a fresh process, skipped where this Triton cannot compile for CUDA); and in the interpreter a row
normalised alone equals the row among others.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # looked up, not imported (see test_kernels_compile_sm90.py)
    pytest.skip("needs triton", allow_module_level=True)

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401,E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
fk = import_interpreted("foretell.ops.pointwise.triton_kernels")


def recorded_launch(monkeypatch, x: torch.Tensor, residual: torch.Tensor | None = None) -> dict:
    """The constexprs and num_warps rms_norm_triton launches its kernel with for x."""
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs, grid=grid)
            return launch

    monkeypatch.setattr(fk, "_rms_norm_kernel", Recorder())
    fk.rms_norm_triton(x, torch.ones(x.shape[-1], dtype=x.dtype), 1e-6, residual)
    return seen


@pytest.mark.parametrize("width,heads", [(64, 2), (64, 4), (128, 8), (256, 1), (1000, 1), (4096, 1), (7168, 1)])
def test_tile_depends_on_the_row_width_only(monkeypatch, width, heads):
    launches = {}
    for tokens in (1, 2, 3, 4, 7, 16, 64, 257):
        shape = (tokens, heads, width) if heads > 1 else (tokens, width)
        x = torch.zeros(shape, dtype=torch.bfloat16)
        launch = recorded_launch(monkeypatch, x, None if heads > 1 else x.clone())
        launches[tokens] = {k: launch[k] for k in ("BLOCK_ROWS", "BLOCK_H", "num_warps")}
        rows = tokens * heads
        assert launch["grid"] == (-(-rows // launch["BLOCK_ROWS"]),), "every row in exactly one program"
    assert all(v == launches[1] for v in launches.values()), launches
    tile = launches[1]["BLOCK_ROWS"] * launches[1]["BLOCK_H"]
    assert launches[1]["BLOCK_H"] >= width and (tile == launches[1]["BLOCK_H"] or tile == 4096)


def test_sm90_layouts_do_not_depend_on_the_row_count():
    from fixtures.sm90_compile import compile_cases

    results = compile_cases("fixtures.kernel_compile_norm_layout")
    assert results and all(v == "ok" for v in results.values()), results


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_row_alone_equals_the_row_among_others(dtype):
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(9, 2, 64, generator=gen).to(dtype).to(DEVICE)  # a k_norm's rows: 9 tokens x 2 KV heads
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype).to(DEVICE)
    together, _ = fk.rms_norm_triton(x, weight, 1e-6)
    for t in range(9):
        alone, _ = fk.rms_norm_triton(x[t : t + 1].clone(), weight, 1e-6)
        assert torch.equal(alone, together[t : t + 1]), f"token {t}"
    hidden = torch.randn(5, 256, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(5, 256, generator=gen).to(dtype).to(DEVICE)
    normed, summed = fk.rms_norm_triton(hidden, weight.repeat(4), 1e-6, residual)
    for t in range(5):
        one, one_sum = fk.rms_norm_triton(hidden[t : t + 1].clone(), weight.repeat(4), 1e-6, residual[t : t + 1].clone())
        assert torch.equal(one, normed[t : t + 1]) and torch.equal(one_sum, summed[t : t + 1])
