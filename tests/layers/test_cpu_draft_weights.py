"""An EAGLE3 head's CPU weights packed in fp16 for fbgemm (layers/cpu_draft_weights.py): the packed
product against a float64 reference of the fp16-rounded weights, each row's bits independent of
the rows beside it where this CPU's kernel gives that (rows_computed_alone), the gated and biased forms, the F.linear fallback, which layers are bound
(never the target's), the environment override, and greedy EAGLE3 output equal to plain decoding
with the default family's head packed."""

from __future__ import annotations

import pytest
import torch

from foretell.layers import cpu_draft_weights
from foretell.layers.cpu_draft_weights import (
    FORMAT_ENV, PackedDraftGemm, draft_weight_format, pack_draft_weights, packed_gemm_available,
    rows_computed_alone,
)
from foretell.layers.embedding import LMHead, VocabEmbedding
from foretell.layers.linear import Linear, MergedLinear
from foretell.ops.pointwise.reference import silu_and_mul_torch

needs_fbgemm = pytest.mark.skipif(not packed_gemm_available(), reason="this torch build runs no fbgemm GEMM here")


def _filled(module, scale: float = 0.1):
    for p in module.parameters():
        p.data.normal_(0.0, scale)
    return module


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_fp16_product_is_the_float64_product_of_the_rounded_weights(rows):
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.1  # [N, K]
    x = torch.randn(rows, 64)
    out = PackedDraftGemm(weight)(x, weight)  # [rows, N]
    reference = (x.double() @ weight.half().double().t()).float()
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@needs_fbgemm
def test_each_row_is_computed_alone_where_the_cpu_says_so():
    """Bit for bit where rows_computed_alone() (the Xeon of the CPU bar); elsewhere (an AVX2-only
    EPYC: rows blocked in the kernel) each row alone still equals its row among others to float32
    rounding."""
    torch.manual_seed(1)
    weight = torch.randn(128, 256) * 0.05  # [N, K]
    x = torch.randn(9, 256)
    gemm = PackedDraftGemm(weight)
    together = gemm(x, weight)  # [9, N]
    same = torch.equal if rows_computed_alone() else (
        lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    for i in range(9):
        assert same(together[i : i + 1], gemm(x[i : i + 1].contiguous(), weight))
    assert same(together[2:6], gemm(x[2:6].contiguous(), weight))


@needs_fbgemm
def test_gated_biased_and_batched_forms():
    torch.manual_seed(2)
    weight, bias = torch.randn(64, 32) * 0.1, torch.randn(64)
    gemm = PackedDraftGemm(weight)
    x = torch.randn(2, 3, 32)
    plain = gemm(x, weight)  # [2, 3, 64]
    assert plain.shape == (2, 3, 64)
    torch.testing.assert_close(plain[1], gemm(x[1].contiguous(), weight))
    torch.testing.assert_close(gemm(x, weight, bias), plain + bias)
    torch.testing.assert_close(gemm(x, weight, gated=True), silu_and_mul_torch(plain))


@needs_fbgemm
def test_other_inputs_take_f_linear_on_the_float32_weight():
    torch.manual_seed(3)
    weight, bias = torch.randn(16, 8), torch.randn(16)
    gemm = PackedDraftGemm(weight)
    x64 = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(gemm(x64, weight.double(), bias.double()),
                       torch.nn.functional.linear(x64, weight.double(), bias.double()))
    x = torch.randn(3, 8, requires_grad=True)
    assert torch.equal(gemm(x, weight), torch.nn.functional.linear(x, weight))


def test_bad_format_is_refused():
    with pytest.raises(ValueError, match="fp16, fp32"):
        pack_draft_weights([torch.nn.Linear(2, 2)], "int8")


@needs_fbgemm
def test_packing_binds_the_drafter_layers_only():
    torch.manual_seed(4)
    kw = dict(dtype=torch.float32, device="cpu")
    target_embed = _filled(VocabEmbedding(50, 16, **kw))
    target = torch.nn.ModuleList([target_embed, _filled(Linear(16, 16, bias=False, **kw))])
    shared_head = LMHead(50, 16, tie_to=target_embed, **kw)  # a drafter layer on a target weight
    draft_linear = _filled(Linear(16, 24, bias=True, **kw))
    gate_up = _filled(MergedLinear(16, [8, 8], False, **kw))
    bf16_linear = Linear(16, 16, bias=False, dtype=torch.bfloat16, device="cpu")
    drafter = torch.nn.ModuleList([draft_linear, gate_up, bf16_linear, shared_head, target[1]])
    assert pack_draft_weights([drafter], "fp32", exclude=target) == 0
    assert pack_draft_weights([drafter], "fp16", exclude=target) == 2
    assert isinstance(draft_linear.small_m, PackedDraftGemm) and isinstance(gate_up.small_m, PackedDraftGemm)
    assert bf16_linear.small_m is None and shared_head.small_m is None and target[1].small_m is None
    assert pack_draft_weights([drafter], "fp16", exclude=target) == 0  # bound already
    x = torch.randn(3, 16)
    reference = x.double() @ draft_linear.weight.double().t() + draft_linear.bias.double()
    assert (draft_linear(x).double() - reference).abs().max() < 1e-3
    gated = gate_up.forward_gated(x)  # [3, 8]
    reference_gated = silu_and_mul_torch(x @ gate_up.weight.t())
    assert gated.shape == (3, 8) and (gated - reference_gated).abs().max() < 1e-3


def test_environment_decides_the_format(monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, "fp32")
    assert draft_weight_format() == "fp32"
    monkeypatch.setenv(FORMAT_ENV, "bf16")
    with pytest.raises(ValueError, match=FORMAT_ENV):
        draft_weight_format()
    monkeypatch.delenv(FORMAT_ENV)
    monkeypatch.setattr(cpu_draft_weights, "packed_gemm_available", lambda: True)
    assert draft_weight_format() == "fp16"
    monkeypatch.setattr(cpu_draft_weights, "packed_gemm_available", lambda: False)
    assert draft_weight_format() == "fp32"
    monkeypatch.setenv(FORMAT_ENV, "fp16")
    with pytest.raises(ValueError, match="no fbgemm fp16"):
        draft_weight_format()


@needs_fbgemm
@pytest.mark.parametrize("fmt", ["fp16", "fp32"])
def test_default_family_eagle3_greedy_equals_plain_with_packed_head(fmt, monkeypatch):
    from foretell import LLM, SamplingParams

    monkeypatch.setenv(FORMAT_ENV, fmt)
    prompts = ["Natalia sold clips to 48 of her friends in April.", "A robe takes 2 bolts of blue fiber."]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for method in (None, "eagle3"):
        llm = LLM.default("qwen3", method, num_speculative_tokens=None if method is None else 3, device="cpu",
                          dtype="auto", num_cpu_threads=1, log_stats_interval_s=0)
        if method is not None:
            head = llm.engine.runner.proposer.head
            bound = [isinstance(m.small_m, PackedDraftGemm) for m in head.modules() if isinstance(m, (Linear, LMHead))]
            assert len(bound) == 6 and all(bound) == (fmt == "fp16") and any(bound) == (fmt == "fp16")
            assert all(getattr(m, "small_m", None) is None for m in llm.engine.runner.model.modules())
        outputs[method] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["eagle3"] == outputs[None]
