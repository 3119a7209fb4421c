"""layers/quantized_linear.py: an Fp8Linear filled from a block-quantized checkpoint's tensors (as the
loader's weight_loader hooks copy them) computes the dequantized weight's product, and one made
from a float weight (`quantization="fp8"`, per-channel scales) stays within e4m3's rounding of the
float layer; wrong tensors are refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foretell.layers.quantized_linear import Fp8Linear
from foretell.ops.gemm import fp8_reference as ref


def test_filled_from_checkpoint_tensors_computes_the_dequantized_product():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 300, generator=gen) / 300**0.5
    q, scale_inv = ref.quantize_fp8_blocks(weight, (128, 128))
    layer = Fp8Linear(300, 200, bias=True, dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale_inv)
    bias = torch.randn(200, generator=gen)
    layer.bias.weight_loader(layer.bias, bias)
    layer.check()
    x = torch.randn(3, 5, 300, generator=gen).to(torch.bfloat16)
    expected = F.linear(x.double(), ref.dequantize_fp8(q, scale_inv, (128, 128)).double(),
                        bias.to(torch.bfloat16).double())
    got = layer(x)
    assert got.shape == (3, 5, 200) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=1e-2)
    assert "128x128 blocks" in repr(layer)


def test_quantized_from_a_float_weight_is_close_to_the_float_layer():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(64, 96, generator=gen) / 96**0.5).to(torch.bfloat16)
    layer = Fp8Linear.quantized(weight)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (64, 1)
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs())
    assert ((layer(x).double() - exact).abs() <= magnitude * 2.0**-4 + exact.abs() * 2.0**-7 + 1e-6).all()


def test_wrong_checkpoint_tensors_are_refused():
    layer = Fp8Linear(300, 200)
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\), found shape \(2, 2\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(2, 2))
    with pytest.raises(ValueError, match="expected a torch.float8_e4m3fn tensor.*found torch.bfloat16"):
        layer.weight.weight_loader(layer.weight, torch.zeros(200, 300, dtype=torch.bfloat16))
