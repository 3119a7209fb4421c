"""A decoder whose norms run inside the GEMV (DecoderLayer.forward_stream): where the GEMV runs a
step's projections (one row), the residual stream is one tensor, each RMSNorm is fused into the
projection after it and each residual add into the projection before it. Its logits, final hidden
states and EAGLE3 aux hidden states must equal Hugging Face's, as the (hidden, residual) form's do.

Runs the kernels in Triton's interpreter on the CPU (float32), every Triton-backed layer bound as
on a GPU (kernel_dispatch.use_triton forced on, the kernel modules interpreted).
"""

from __future__ import annotations

import pytest
import torch

from fixtures import PagedRunner
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.layers import kernel_dispatch
from foretell.layers.small_m_dispatch import prepare_small_m_linears
from foretell.models.base import HFConfig
from test_models_vs_hf import ATOL, build_model, hf_run, prompt

if HAS_CUDA:
    pytest.skip("on a GPU the fused decode runs in tests/gpu (engine and graph tests)", allow_module_level=True)

for name in ("fused_kernels", "small_m_gemm", "small_m_mma", "small_m_kernels"):
    import_interpreted(f"foretell.layers.{name}")
sm = import_interpreted("foretell.layers.small_m_gemm")


@pytest.mark.parametrize("family", ["llama31", "qwen3"])
def test_decode_with_norms_in_the_gemv_matches_hf(request, family, monkeypatch):
    folder = request.getfixturevalue(f"{family}_checkpoint")
    num_layers = HFConfig.from_folder(folder).num_hidden_layers
    aux_layers = (0, 1, num_layers - 1)
    model = build_model(folder, aux_layers=aux_layers)
    monkeypatch.setattr(kernel_dispatch, "use_triton", lambda *tensors: True)
    assert prepare_small_m_linears(model, max_m=4, mode="on") is not None
    fused_calls = []
    kernel = sm.small_m_linear

    def counting(*args, **kwargs):
        fused_calls.append(("norm_weight" in kwargs, "residual" in kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(sm, "small_m_linear", counting)
    tokens = prompt(9, seed=11)
    runner = PagedRunner(model, block_size=4)
    runner.step([("a", tokens[:6])])  # a prefill: the (hidden, residual) form, cuBLAS
    assert fused_calls == []
    expected = hf_run(folder, tokens, output_hidden_states=True)
    for pos in range(6, 9):  # one row: every projection a GEMV, the norms inside
        before = len(fused_calls)
        logits, hidden, aux = runner.step([("a", [tokens[pos]])])
        torch.testing.assert_close(logits[0], expected.logits[0, pos], rtol=0, atol=ATOL)
        torch.testing.assert_close(hidden[0], expected.hidden_states[-1][0, pos], rtol=0, atol=ATOL)
        for layer, captured in zip(aux_layers, aux):
            torch.testing.assert_close(captured[0], expected.hidden_states[layer][0, pos], rtol=0, atol=ATOL)
        # Per layer: qkv (norm), o (residual), gate_up (norm), down (residual); then lm_head.
        assert fused_calls[before:] == [(True, False), (False, True)] * 2 * num_layers + [(False, False)]


def test_layers_keep_the_pair_form_where_a_norm_cannot_be_fused(qwen3_checkpoint, monkeypatch):
    """Two rows in float32 run on cuBLAS (no GEMV): the stream form is not taken."""
    model = build_model(qwen3_checkpoint)
    monkeypatch.setattr(kernel_dispatch, "use_triton", lambda *tensors: True)
    prepare_small_m_linears(model, max_m=4, mode="on")
    one, two = torch.zeros(1, model.config.hidden_size), torch.zeros(2, model.config.hidden_size)
    layers = model.model.layers
    assert all(layer.fuses_norms(one) for layer in layers)
    assert not any(layer.fuses_norms(two) for layer in layers)
