"""CPU float32 weights stored transposed (layers/cpu_weight_layout.py): same values and shapes,
the products equal a float64 reference, a tied embedding still gathers the right rows, only the
float32 CPU layers are re-stored, and the environment override decides where it is set."""

from __future__ import annotations

import pytest
import torch

from foretell.layers import cpu_weight_layout
from foretell.layers.cpu_few_rows import fits_few_rows
from foretell.layers.cpu_weight_layout import is_transposed, store_weights_transposed, transposed_weights_preferred
from foretell.layers.embedding import LMHead, VocabEmbedding
from foretell.layers.linear import Linear, MergedLinear


def _reference(x, weight, bias=None):  # the product in float64, rounded once
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


def _filled(module):
    for p in module.parameters():
        p.data.normal_()
    return module


def test_restored_layers_keep_values_and_compute_the_product():
    torch.manual_seed(0)
    linear = _filled(Linear(32, 48, bias=True, dtype=torch.float32, device="cpu"))
    gate_up = _filled(MergedLinear(32, [40, 40], False, dtype=torch.float32, device="cpu"))
    embed = _filled(VocabEmbedding(100, 32, dtype=torch.float32, device="cpu"))
    head = LMHead(100, 32, tie_to=embed, dtype=torch.float32, device="cpu")
    before = {name: m.weight.detach().clone() for name, m in (("linear", linear), ("gate_up", gate_up), ("embed", embed))}
    root = torch.nn.ModuleList([linear, gate_up, embed, head])
    assert store_weights_transposed([root]) == 3  # the tied weight once
    assert store_weights_transposed([root]) == 0  # already transposed: left as it is
    for name, m in (("linear", linear), ("gate_up", gate_up), ("embed", embed)):
        assert is_transposed(m.weight) and isinstance(m.weight, torch.nn.Parameter)
        assert torch.equal(m.weight, before[name])
    assert head.weight is embed.weight
    ids = torch.tensor([3, 99, 0, 42])
    assert torch.equal(embed(ids), before["embed"][ids])
    for rows in (1, 2, 4, 8, 17):
        x = torch.randn(rows, 32)
        assert not fits_few_rows(x, linear.weight)  # F.linear: MKL's no-transpose form on this layout
        torch.testing.assert_close(linear(x), _reference(x, before["linear"], linear.bias), rtol=1e-5, atol=1e-4)
        up = _reference(x, before["gate_up"])
        torch.testing.assert_close(gate_up.forward_gated(x), torch.nn.functional.silu(up[:, :40]) * up[:, 40:],
                                   rtol=1e-5, atol=1e-4)
        logits = head(x)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 100) and logits.is_contiguous()
        torch.testing.assert_close(logits, _reference(x, before["embed"]), rtol=1e-5, atol=1e-4)


def test_only_float32_cpu_layers_without_a_bound_gemm():
    half = Linear(8, 16, dtype=torch.bfloat16, device="cpu")
    bound = Linear(8, 16, dtype=torch.float32, device="cpu")
    bound.small_m = object()  # a bound SmallMGemm reads the weight itself
    assert store_weights_transposed([torch.nn.ModuleList([half, bound])]) == 0
    assert half.weight.is_contiguous() and bound.weight.is_contiguous()


def test_is_transposed():
    w = torch.randn(6, 4)
    assert not is_transposed(w) and is_transposed(w.t().contiguous().t())
    assert not is_transposed(torch.randn(6))


@pytest.mark.parametrize("vendor, want", [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)])
def test_preferred_by_vendor_unless_overridden(monkeypatch, vendor, want):
    monkeypatch.delenv(cpu_weight_layout.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(cpu_weight_layout, "cpu_vendor", lambda: vendor)
    assert transposed_weights_preferred() is want
    monkeypatch.setenv(cpu_weight_layout.LAYOUT_ENV, "rows")
    assert transposed_weights_preferred() is False
    monkeypatch.setenv(cpu_weight_layout.LAYOUT_ENV, "Transposed")
    assert transposed_weights_preferred() is True
    monkeypatch.setenv(cpu_weight_layout.LAYOUT_ENV, "columns")
    with pytest.raises(ValueError, match="transposed"):
        transposed_weights_preferred()
