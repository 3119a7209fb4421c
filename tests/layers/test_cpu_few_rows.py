"""The CPU's few-row float32 linear (layers/cpu_few_rows.py): W x^T for 2 to 8 rows equals the
product (float64 reference, float32 rounding), comes out as contiguous [M, N] rows, and is what
Linear and LMHead run for such rows on the CPU (and only for them: one row, many rows, bf16,
autograd and a bound SmallMGemm keep their own path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foretell.layers import cpu_few_rows
from foretell.layers.cpu_few_rows import MAX_ROWS, few_rows_linear, fits_few_rows
from foretell.layers.embedding import LMHead
from foretell.layers.linear import Linear, MergedLinear


def _reference(x, weight, bias=None):  # the product in float64, rounded once
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("rows", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(512, 256), (256, 768), (4096, 256), (7, 5)])
def test_few_rows_linear_is_the_product(rows, shape):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    weight = torch.randn(shape, generator=g)
    x = torch.randn(rows, shape[1], generator=g)
    bias = torch.randn(shape[0], generator=g)
    for b in (None, bias):
        got = few_rows_linear(x, weight, b)
        assert got.shape == (rows, shape[0]) and got.is_contiguous()
        torch.testing.assert_close(got, _reference(x, weight, b), rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


def test_fits_few_rows_only_cpu_float32_2_to_8_rows_outside_autograd():
    weight = torch.randn(16, 8)
    assert fits_few_rows(torch.randn(2, 8), weight) and fits_few_rows(torch.randn(MAX_ROWS, 8), weight)
    assert not fits_few_rows(torch.randn(1, 8), weight)  # a decode row: MKL's GEMV as it was
    assert not fits_few_rows(torch.randn(MAX_ROWS + 1, 8), weight)
    assert not fits_few_rows(torch.randn(2, 3, 8), weight)  # [..., K] inputs of other ranks
    assert not fits_few_rows(torch.randn(4, 8, dtype=torch.bfloat16), weight.bfloat16())
    assert not fits_few_rows(torch.randn(4, 8, requires_grad=True), weight)
    assert not fits_few_rows(torch.randn(4, 8), weight.clone().requires_grad_())


def _spy(monkeypatch):
    calls = []
    real = cpu_few_rows.few_rows_linear

    def spy(x, weight, bias=None):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    import foretell.layers.embedding as embedding_module
    import foretell.layers.linear as linear_module
    monkeypatch.setattr(linear_module, "few_rows_linear", spy)
    monkeypatch.setattr(embedding_module, "few_rows_linear", spy)
    return calls


def test_linear_and_lm_head_take_it_for_few_cpu_rows(monkeypatch):
    torch.manual_seed(0)
    calls = _spy(monkeypatch)
    linear = Linear(32, 48, bias=True, dtype=torch.float32, device="cpu")
    gate_up = MergedLinear(32, [40, 40], False, dtype=torch.float32, device="cpu")
    head = LMHead(100, 32, dtype=torch.float32, device="cpu")
    for module in (linear, gate_up, head):
        for p in module.parameters():
            p.data.normal_()
    x = torch.randn(4, 32)
    torch.testing.assert_close(linear(x), _reference(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)
    up = _reference(x, gate_up.weight)
    torch.testing.assert_close(gate_up.forward_gated(x), F.silu(up[:, :40]) * up[:, 40:], rtol=1e-5, atol=1e-4)
    logits = head(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _reference(x, head.weight), rtol=1e-5, atol=1e-4)
    assert calls == [4, 4, 4]
    # one row and many rows keep F.linear (bit for bit), and so does a bound SmallMGemm
    for rows in (1, 9):
        y = torch.randn(rows, 32)
        assert torch.equal(linear(y), F.linear(y, linear.weight, linear.bias))
        assert torch.equal(head(y), F.linear(y, head.weight))
    linear.small_m = lambda x, weight, bias: torch.zeros(x.shape[0], 48)
    assert torch.equal(linear(x), torch.zeros(4, 48))
    assert calls == [4, 4, 4]
