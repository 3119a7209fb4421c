"""The EAGLE3 layer's input on the CPU from a table of normed embedding rows (models/eagle3.py,
Eagle3LayerBase.build_normed_embedding_table): the runner builds it for a CPU head, and layer_input
through it equals the module path bit for bit (x and the residual, with and without
norm_before_residual, one row and several, repeated tokens); it is refused for other dtypes and
large vocabularies, and inputs under autograd take the module path."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM
from foretell.models import eagle3 as eagle3_module


@pytest.fixture
def head(qwen3_checkpoint, eagle3_head):
    llm = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1, max_num_seqs=1,
              speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3})
    return llm.engine.runner.proposer.head


def _module_path(layer, input_ids, embedding, g):
    table, layer.normed_embedding = layer.normed_embedding, None
    try:
        return layer.layer_input(input_ids, embedding, g)
    finally:
        layer.normed_embedding = table


@pytest.mark.parametrize("before_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_table_input_equals_the_module_path(head, rows, before_residual):
    layer, embedding = head.midlayer, head.embed_tokens or head.shared_embed
    assert layer.normed_embedding is not None and layer.normed_embedding[0] is embedding  # the runner built it
    gen = torch.Generator().manual_seed(rows)
    vocab = embedding.weight.shape[0]
    input_ids = torch.randint(0, vocab, (rows,), generator=gen)
    input_ids[-1] = input_ids[0]  # a repeated token
    g = torch.randn(rows, head.hidden_size, generator=gen)
    layer.norm_before_residual = before_residual
    with torch.inference_mode():
        x, residual = layer.layer_input(input_ids, embedding, g)
        want_x, want_residual = _module_path(layer, input_ids, embedding, g)
    assert x.shape == (rows, 2 * head.hidden_size)
    assert torch.equal(x, want_x) and torch.equal(residual, want_residual)
    reference = torch.cat([embedding.weight[input_ids].double(), g.double()], dim=-1)  # float64, per half
    for half, weight in ((0, layer.input_layernorm.weight), (1, layer.hidden_norm.weight)):
        part = reference[:, half * head.hidden_size:(half + 1) * head.hidden_size]
        normed = part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + layer.input_layernorm.eps) * weight.double()
        torch.testing.assert_close(x[:, half * head.hidden_size:(half + 1) * head.hidden_size].double(), normed,
                                   rtol=1e-5, atol=1e-5)


def test_autograd_inputs_take_the_module_path(head):
    layer, embedding = head.midlayer, head.embed_tokens or head.shared_embed
    g = torch.randn(2, head.hidden_size, requires_grad=True)
    input_ids = torch.tensor([3, 4])
    x, _ = layer.layer_input(input_ids, embedding, g)
    assert x.requires_grad  # the module path keeps the graph
    assert torch.equal(x.detach(), _module_path(layer, input_ids, embedding, g.detach())[0])


def test_table_is_refused_for_other_dtypes_and_large_vocabularies(head, monkeypatch):
    layer, embedding = head.midlayer, head.embed_tokens or head.shared_embed
    monkeypatch.setattr(eagle3_module, "MAX_NORMED_TABLE_ELEMENTS", embedding.weight.numel() - 1)
    layer.normed_embedding = None
    assert not layer.build_normed_embedding_table(embedding) and layer.normed_embedding is None
    monkeypatch.setattr(eagle3_module, "MAX_NORMED_TABLE_ELEMENTS", embedding.weight.numel())
    with torch.no_grad():
        embedding.weight.data = embedding.weight.data.bfloat16()
    assert not layer.build_normed_embedding_table(embedding) and layer.normed_embedding is None
    with torch.no_grad():
        embedding.weight.data = embedding.weight.data.float()
    assert layer.build_normed_embedding_table(embedding) and layer.normed_embedding[1].shape == embedding.weight.shape
