"""The rows the few-row GEMMs are bound for under draft trees (issue 28): a tree step's verify puts
T = num_draft_tokens rows a sequence through every linear, so its graphs must be captured with the
SmallMGemm serving that many rows (runner/tree_graphs.tree_step_gemm_rows, used by
runner/graph_setup.py). Bound for the plain runner's batch x 2 rows instead, a 16-node tree's
verify at batch 1 went to cuBLAS on the H200. Mode "on" then picks the tensor-core MMA for every
Llama-8B layer at 16 rows, the down projection's K = 14336 included (ops/gemm/dispatch.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foretell.layers.linear import Linear
from foretell.layers.small_m import prepare_small_m_linears
from foretell.ops.common import kernel_choice
from foretell.ops.gemm.dispatch import MAX_M, SmallMGemm
from foretell.runner.tree_graphs import tree_step_gemm_rows


@pytest.mark.parametrize("batch, depth, topk, nodes, expected", [
    (1, 6, 4, 16, 16),  # the H200 bar's tree: its verify's 16 rows
    (1, 6, 1, 7, 7),  # a chain as a tree: verify and catch-up alike
    (1, 8, 4, 5, 9),  # a few nodes of a deep tree: the catch-up's depth + 1 rows
    (1, 2, 10, 5, 10),  # a wide tree: the expansion's topk rows
    (2, 6, 4, 16, 32),  # past MAX_M: SmallMGemm serves up to MAX_M, cuBLAS above
])
def test_tree_step_gemm_rows(batch, depth, topk, nodes, expected):
    assert tree_step_gemm_rows(batch, depth, topk, nodes) == expected


class RecordingKernels:
    """Stands in for ops/gemm/triton_kernels: records the row counts it ran, computes F.linear."""

    def __init__(self):
        self.rows: list[int] = []

    def default_config(self, m, n, k, dtype, device):
        return f"kernel M<={m}"

    def small_m_linear(self, x, weight, bias, config, gated=False, float32_out=False):
        self.rows.append(x.shape[0])
        return F.linear(x, weight, bias)


@pytest.mark.parametrize("bound_rows, served", [
    (1 * (1 + 1), False),  # what a tree runner bound before: the decode graphs' batch x 2 rows
    (tree_step_gemm_rows(1, 6, 4, 16), True),
])
def test_a_16_node_verify_takes_the_kernel_only_when_bound_for_its_rows(monkeypatch, bound_rows, served):
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    layer = Linear(32, 24, dtype=torch.float16)
    layer.weight.data.normal_()
    kernels = RecordingKernels()
    gemm = prepare_small_m_linears(layer, bound_rows, "on", gemm=SmallMGemm("on", bound_rows, kernels=kernels))
    kernels.rows.clear()  # (binding decides keys, runs nothing)
    x = torch.randn(16, 32).to(torch.float16)  # the verify's root + 15 nodes
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
        layer(x[:7])  # the catch-up's depth + 1 rows
        layer(x[:4])  # an expansion depth's topk rows
    assert gemm.max_m == min(MAX_M, 1 << (bound_rows - 1).bit_length())
    assert kernels.rows == ([16, 7, 4] if served else [])


def test_mode_on_takes_the_mma_at_16_rows_for_every_llama8b_layer():
    """triton_kernels.default_config (mode "on") at M = 16, bf16: the MMA, split-K for o and down
    (K = 14336: no K limit since the activation moved into gate_up's epilogue)."""
    pytest.importorskip("triton")
    from foretell.ops.gemm import triton_kernels
    from foretell.ops.gemm.triton_mma import MmaConfig

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    for name, (n, k) in shapes.items():
        config = triton_kernels.default_config(16, n, k, torch.bfloat16, torch.device("cpu"))
        assert isinstance(config, MmaConfig), name
    assert triton_kernels.default_config(16, 4096, 14336, torch.bfloat16, torch.device("cpu")).split == 4
    assert triton_kernels.default_config(32, 4096, 14336, torch.bfloat16, torch.device("cpu")) is None
    assert triton_kernels.default_config(16, 4096, 4096, torch.float32, torch.device("cpu")) is None
