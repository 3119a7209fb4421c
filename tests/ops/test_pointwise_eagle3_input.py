"""The EAGLE3 input kernel (embedding gather + two RMSNorms + concatenation in one launch) held
against its twin, the draft layer's torch path (Eagle3LayerBase.layer_input off CUDA).

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors. Outputs come from a
NaN-poisoned torch.empty, so a skipped element shows; every case draws fresh random inputs and a
failure names its seed. The norms' float32 means may sum in another order than torch's, so each
half may differ by a rounding of the dtype that went the other way (tests/ops/test_pointwise_kernels.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.float64_linear import poisoned_empty  # noqa: F401 (a fixture)
from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.common import kernel_choice
from foretell.layers.embedding import VocabEmbedding
from foretell.layers.norm import RMSNorm

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
ei = import_interpreted("foretell.ops.pointwise.triton_eagle3_input")

NEAR = {torch.float16: dict(rtol=4e-3, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
        torch.float32: dict(rtol=1e-6, atol=1e-7)}


def _case(dtype, hidden, rows, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    vocab = 50
    embedding = VocabEmbedding(vocab, hidden, dtype=dtype, device=DEVICE)
    norms = [RMSNorm(hidden, eps, dtype=dtype, device=DEVICE) for eps in (1e-6, 1e-5)]
    with torch.no_grad():
        embedding.weight.copy_(rand(vocab, hidden, scale=0.05))
        for norm in norms:
            norm.weight.copy_(rand(hidden))
    ids = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    g = rand(rows, hidden, scale=4.0)
    return embedding, norms, ids, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 1000])
def test_matches_the_layers_torch_path(dtype, hidden, poisoned_empty):  # noqa: F811
    seed = random.randrange(2**31)
    rows = random.Random(seed).randint(1, 6)
    embedding, (embed_norm, hidden_norm), ids, g = _case(dtype, hidden, rows, seed)
    wide_g = torch.cat([g, g], dim=1)[:, :hidden]  # a row stride past the width: read as strided
    strided_ids = torch.stack([ids, ids], dim=1)[:, 0]  # a column of a drafts buffer, say
    with reports_seed(seed), torch.no_grad():
        x = ei.eagle3_input_triton(strided_ids, embedding.weight, wide_g, embed_norm.weight, embed_norm.eps,
                                   hidden_norm.weight, hidden_norm.eps)
        expected = torch.cat([embed_norm(embedding(ids))[0], hidden_norm(g)[0]], dim=-1)
        assert not torch.isnan(x).any(), "kernel left poisoned elements"
        assert x.shape == (rows, 2 * hidden) and x.dtype == dtype and x.is_contiguous()
        torch.testing.assert_close(x, expected, **NEAR[dtype])


def test_the_draft_layer_runs_the_kernel_where_triton_runs(eagle3_head, qwen3_checkpoint, monkeypatch):
    """Eagle3LayerBase.layer_input takes the kernel when kernel_choice allows it (here: the
    interpreter, patched in) and its twin otherwise: the same x and residual either way."""
    from foretell import LLM
    from foretell.ops.pointwise import triton_eagle3_input

    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=16,
              speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2})
    head = llm.engine.runner.proposer.head
    layer, embedding = head.midlayer, head.embed_tokens or head.shared_embed
    device = head.fc.weight.device  # the GPU on a CUDA machine
    ids = torch.tensor([3, 17, 5], device=device)
    g = torch.randn(3, head.hidden_size, device=device)
    with torch.no_grad():
        monkeypatch.setattr(kernel_choice, "use_triton", lambda *t: False)
        twin_x, twin_residual = layer.layer_input(ids, embedding, g)
        calls, kernel = [], ei.eagle3_input_triton
        monkeypatch.setattr(kernel_choice, "use_triton", lambda *t: True)
        monkeypatch.setattr(triton_eagle3_input, "eagle3_input_triton", lambda *args: calls.append(1) or kernel(*args))
        x, residual = layer.layer_input(ids, embedding, g)
    assert calls == [1]
    torch.testing.assert_close(x, twin_x, **NEAR[torch.float32])
    torch.testing.assert_close(residual, twin_residual, **NEAR[torch.float32])


def test_bad_inputs_raise_clear_errors():
    embedding, (embed_norm, hidden_norm), ids, g = _case(torch.float32, 64, 3, 0)
    args = (embed_norm.weight, 1e-6, hidden_norm.weight, 1e-6)
    with pytest.raises(ValueError, match="input_ids must be"):
        ei.eagle3_input_triton(ids[:2], embedding.weight, g, *args)
    with pytest.raises(ValueError, match="input_ids must be"):
        ei.eagle3_input_triton(ids.float(), embedding.weight, g, *args)
    with pytest.raises(ValueError, match="embedding must be"):
        ei.eagle3_input_triton(ids, embedding.weight[:, :32], g, *args)
    with pytest.raises(ValueError, match="embedding must be"):
        ei.eagle3_input_triton(ids, embedding.weight.half(), g, *args)
    with pytest.raises(ValueError, match="hidden_norm must be"):
        ei.eagle3_input_triton(ids, embedding.weight, g, embed_norm.weight, 1e-6, hidden_norm.weight[:8], 1e-6)
    assert ei.eagle3_input_triton(ids[:0], embedding.weight, g[:0], *args).shape == (0, 128)
