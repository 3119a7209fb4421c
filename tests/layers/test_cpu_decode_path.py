"""The Llama family's few-call torch forward (DecoderModel.forward_torch, layers/attention/qkv_block.py:
what the CPU runs, issue 32) holds the module path's arithmetic bit for bit: the same logits, hidden
and aux states as run_decoder_stack over the same steps (a varlen prefill batch, a cached prefix
mixed with decodes, one-sequence decode and verify rows), and the same KV cache afterwards; the
attention block falls back to the module path where its few-call form does not apply."""

from __future__ import annotations

import pytest
import torch

from fixtures import PagedRunner
from foretell.layers.attention.qkv_block import (
    ForwardRows, attend_one_sequence, attend_qkv, causal_hidden, fits_torch_block, paired_rope_rows,
)
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.rotary import RotaryEmbedding
from foretell.models import loading as model_loading
from foretell.models.base import HFConfig, ModelOptions, run_decoder_stack
from foretell.models.llama import DecoderModel
from foretell.ops.attention.reference import TorchAttentionBackend, write_kv_torch

FAMILIES = ["qwen3", "qwen3_tied", "qwen2", "llama31"]


def _build(folder: str, dtype: torch.dtype, aux_layers=(0, 2)):
    options = ModelOptions(dtype, torch.device("cpu"), TorchAttentionBackend(), tuple(aux_layers))
    return model_loading.build_model(folder, HFConfig.from_folder(folder), options)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


STEPS = [
    [("a", _tokens(9, 1)), ("b", _tokens(5, 2))],  # a varlen prefill batch
    [("a", _tokens(1, 3)), ("c", _tokens(6, 4)), ("b", _tokens(3, 5))],  # a decode beside prefills
    [("a", _tokens(1, 6))],  # one sequence's decode row
    [("b", _tokens(4, 7))],  # one sequence's verify rows (1 + 3)
]


def _run(folder, dtype, module_path: bool, monkeypatch):
    if module_path:
        monkeypatch.setattr(DecoderModel, "forward", lambda self, ids, pos, meta, aux=(): run_decoder_stack(
            self.embed_tokens, self.layers, self.norm, ids, pos, meta, aux))
    runner = PagedRunner(_build(folder, dtype))
    outputs = [runner.step(chunks) for chunks in STEPS]
    monkeypatch.undo()
    caches = [layer.kv_cache for layer in runner.model.attention_layers()]
    return outputs, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_torch_equals_the_module_path_bit_for_bit(family, dtype, request, monkeypatch):
    folder = request.getfixturevalue(f"{family}_checkpoint")
    want, want_caches = _run(folder, dtype, True, monkeypatch)
    got, got_caches = _run(folder, dtype, False, monkeypatch)
    for (logits, hidden, aux), (want_logits, want_hidden, want_aux) in zip(got, want):
        assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)
        assert len(aux) == len(want_aux) == 2 and all(torch.equal(a, b) for a, b in zip(aux, want_aux))
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


def test_paired_rope_rows_only_for_neox_over_whole_heads():
    positions = torch.tensor([0, 7, 30])
    neox = RotaryEmbedding(64, 128, 10000.0)
    cos_pair, sin_pair = paired_rope_rows(neox, positions, 64, torch.float32)
    assert cos_pair.shape == sin_pair.shape == (3, 1, 2, 32)
    torch.testing.assert_close(cos_pair[:, 0, 0], neox.cos_cache[positions], rtol=0, atol=0)
    torch.testing.assert_close(sin_pair[:, 0, 0], -neox.sin_cache[positions], rtol=0, atol=0)
    assert paired_rope_rows(neox, positions, 64, torch.bfloat16)[0].dtype == torch.bfloat16
    assert paired_rope_rows(RotaryEmbedding(32, 128, 10000.0), positions, 64, torch.float32) is None  # partial
    assert paired_rope_rows(RotaryEmbedding(64, 128, 10000.0, style="gptj"), positions, 64, torch.float32) is None


def test_attend_qkv_takes_the_module_path_where_its_form_does_not_fit(qwen3_checkpoint):
    """An FP8 cache (another dtype than the projection) and q/k norms of different eps go through
    Attention.forward_rotary; the result is the module path's own."""
    model = _build(qwen3_checkpoint, torch.float32, ())
    runner = PagedRunner(model)
    runner.step([("a", _tokens(5, 8))])
    attn_module = model.model.layers[0].self_attn
    attn = attn_module.attn
    assert fits_torch_block(attn, torch.zeros(1, 4))
    assert not fits_torch_block(attn, torch.zeros(1, 4, dtype=torch.bfloat16))
    ids, positions, metadata = runner.metadata([("a", _tokens(1, 9))])
    hidden = torch.randn(1, model.model.dims.hidden_size, generator=torch.Generator().manual_seed(3))
    qkv = attn_module.qkv_proj(hidden)
    norms = (attn_module.q_norm, attn_module.k_norm)
    q, k, v = attn_module.qkv_proj.split(qkv.clone())
    dims = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    want = attn.forward_rotary(positions, q.view(1, dims[0], dims[2]), k.view(1, dims[1], dims[2]),
                               v.view(1, dims[1], dims[2]), attn_module.rotary_emb, metadata, norms)
    got = attend_qkv(attn, qkv.clone(), positions, attn_module.rotary_emb, metadata, norms)
    assert torch.equal(got, want.reshape(1, -1))
    own_eps = type(norms[1])(attn.head_dim, 1e-5)
    with torch.no_grad():
        own_eps.weight.copy_(norms[1].weight)
    want = attn.forward_rotary(positions, q.view(1, dims[0], dims[2]), k.view(1, dims[1], dims[2]),
                               v.view(1, dims[1], dims[2]), attn_module.rotary_emb, metadata, (norms[0], own_eps))
    got = attend_qkv(attn, qkv.clone(), positions, attn_module.rotary_emb, metadata, (norms[0], own_eps))
    assert torch.equal(got, want.reshape(1, -1))


@pytest.mark.parametrize("heads", [(4, 2, 64), (8, 8, 16), (4, 1, 32)], ids=["gqa", "mha", "one-kv-head"])
@pytest.mark.parametrize("num_tokens", [1, 4, 7])
def test_attend_one_sequence_is_the_backend_bit_for_bit(heads, num_tokens):
    num_heads, num_kv_heads, head_dim = heads
    num_blocks, block_size = 12, 4
    generator = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    row = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    backend = TorchAttentionBackend()
    for seq_len in (num_tokens, 8, 13, 48):  # exactly whole blocks, a partial last block, every block
        query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_table=row[None],
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), block_size=block_size,
            max_query_len=num_tokens, max_seq_len=seq_len, query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[seq_len],
        )
        want = backend.attend(query, cache, metadata, head_dim**-0.5)
        got = attend_one_sequence(query, cache, row[: -(-seq_len // block_size)], seq_len, head_dim**-0.5)
        assert torch.equal(got, want.reshape(num_tokens, -1))
        if num_tokens > 1:  # the mask gathered once per forward (ForwardRows) instead of per layer
            hidden = causal_hidden(num_tokens, seq_len, query.device)
            got = attend_one_sequence(query, cache, row[: -(-seq_len // block_size)], seq_len, head_dim**-0.5, hidden)
            assert torch.equal(got, want.reshape(num_tokens, -1))


def test_causal_hidden_hides_the_keys_after_each_row():
    hidden = causal_hidden(3, 5, torch.device("cpu"))  # rows at positions 2, 3, 4
    want = torch.tensor([[key > position for key in range(5)] for position in (2, 3, 4)])
    assert torch.equal(hidden, want)


def test_attend_qkv_writes_keys_and_values_as_write_kv_does(qwen3_checkpoint):
    """The stacked K/V write (one index_copy_) leaves the cache as write_kv_torch's two copies do,
    and a cache that is not contiguous (no [2, slots, KV, D] view) takes write_kv_torch itself."""
    model = _build(qwen3_checkpoint, torch.float32, ())
    runner = PagedRunner(model)
    runner.step([("a", _tokens(5, 8))])
    attn_module = model.model.layers[0].self_attn
    attn = attn_module.attn
    ids, positions, metadata = runner.metadata([("a", _tokens(3, 9))])
    hidden = torch.randn(3, model.model.dims.hidden_size, generator=torch.Generator().manual_seed(4))
    qkv = attn_module.qkv_proj(hidden)
    norms = (attn_module.q_norm, attn_module.k_norm)
    before = attn.kv_cache.clone()
    want_out = attend_qkv(attn, qkv.clone(), positions, attn_module.rotary_emb, metadata, norms)
    rotated = qkv.clone()
    attend_qkv(attn, rotated, positions, attn_module.rotary_emb, metadata, norms)  # rotated: RoPE in place
    heads = rotated.view(3, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    want = before.clone()
    key, value = heads[:, attn.num_heads :].split(attn.num_kv_heads, dim=1)
    write_kv_torch(key, value, want, metadata.slot_mapping)
    assert torch.equal(attn.kv_cache, want)
    strided = torch.zeros(2, *before.shape[1:-1], 2 * attn.head_dim)[..., : attn.head_dim]  # not contiguous
    strided.copy_(before)
    attn.kv_cache = strided
    got_out = attend_qkv(attn, qkv.clone(), positions, attn_module.rotary_emb, metadata, norms)
    assert torch.equal(got_out, want_out) and torch.equal(strided, want)


def test_forward_rows_hold_the_blocks_of_a_one_sequence_step_only():
    rotary = RotaryEmbedding(16, 64, 10000.0)
    table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)

    def metadata(starts, seq_lens):
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table[: len(seq_lens)], slot_mapping=torch.zeros(starts[-1], dtype=torch.int64), block_size=4,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        )

    one = ForwardRows.gather(rotary, torch.tensor([9]), metadata([0, 1], [10]), 16, torch.float32)
    assert one.context_blocks.tolist() == [5, 2, 7] and one.rope[0].shape == (1, 1, 2, 8)
    assert one.hidden_keys is None  # one row sees its whole context
    verify = ForwardRows.gather(rotary, torch.tensor([7, 8, 9]), metadata([0, 3], [10]), 16, torch.float32)
    assert torch.equal(verify.hidden_keys, causal_hidden(3, 10, torch.device("cpu")))
    two = ForwardRows.gather(rotary, torch.tensor([9, 3]), metadata([0, 1, 2], [10, 4]), 16, torch.float32)
    assert two.context_blocks is None and two.hidden_keys is None and two.rope[0].shape == (2, 1, 2, 8)
    assert ForwardRows.gather(rotary, torch.tensor([9]), metadata([0, 1], [10]), 32, torch.float32).rope is None
    cache = torch.zeros(2, 8, 4, 1, 16)
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold a context of 10"):
        attend_one_sequence(torch.zeros(1, 2, 16), cache, table[0, :2], 10, 0.25)
