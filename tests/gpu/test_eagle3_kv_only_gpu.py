"""Eagle3Head.cache_kv on CUDA at the Llama-3.1-8B head's shape (bf16, Triton backend): the draft cache
it leaves against the whole layer's, for a prompt chunk (8 x 128 rows) and a decode step (256 x 1).
With the whole q|k|v projection (layers/attention/kv_only.py's form off CUDA) the cache must be equal
bit for bit for the prompt chunk; at one row a sequence the whole layer rotates its keys in the one-launch
decode kernel (ops/attention/triton_rope_paged.py), and the GPU's compiler fuses RoPE's products with
their sums differently there than in rope_write_kv_triton (tests/ops/test_attention_rope_paged.py says so
too): keys one rounding apart, values equal. With the k|v rows multiplied alone (CUDA's form) the cache must be
close, and the test prints whether cuBLAS gave the same bits (a different output width may pick another
kernel)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from foretell.layers.attention import kv_only
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.eagle3 import Eagle3Head
from foretell.ops.attention.triton_backend import TritonAttentionBackend
from foretell.spec_decode.proposer import catch_up_metadata

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "foretell", "configs", "llama-3.1-8b-eagle3",
                      "config.json")
BLOCK_SIZE = 16
NUM_BLOCKS = 4096


@pytest.fixture(scope="module")
def head():
    with open(CONFIG) as f:
        config = json.load(f)
    device = torch.device("cuda")
    options = ModelOptions(torch.bfloat16, device, TritonAttentionBackend())
    head = Eagle3Head(HFConfig(config), config["target_hidden_size"], 4096, options, has_embed=True, has_lm_head=True)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            if p.dtype.is_floating_point and p.dim():
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02 + (p.dim() == 1))
    attn = head.attention_layers()[0]
    # enough blocks for the largest case's table (256 sequences x 13 blocks)
    attn.bind_kv_cache(torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), dtype=torch.bfloat16, device=device))
    return head.eval()


def assert_nearly_equal_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for one rounding per element (a bf16 ulp; near zero an absolute 2^-6)."""
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -6, rtol=2 ** -7)


@pytest.mark.parametrize("seqs,rows", [(8, 128), (256, 1)])
@pytest.mark.parametrize("rows_alone", [False, True])
def test_cache_against_the_whole_layers(head, monkeypatch, seqs, rows, rows_alone):
    monkeypatch.setattr(kv_only, "multiplies_rows_alone", lambda linear, x: rows_alone)
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(1)
    per_seq = -(-(rows + 200) // BLOCK_SIZE)
    assert seqs * per_seq <= NUM_BLOCKS  # (a table past the cache wrote out of bounds: the first H200 run's failure)
    table = torch.randperm(seqs * per_seq, device=device, generator=gen).view(seqs, per_seq).to(torch.int32)
    meta = catch_up_metadata([200] * seqs, [rows] * seqs, table, BLOCK_SIZE, BLOCK_SIZE)
    n = seqs * rows
    ids = torch.randint(0, head.vocab_size, (n,), device=device, generator=gen)
    positions = torch.arange(200, 200 + rows, device=device).repeat(seqs)
    aux = [torch.randn(n, 4096, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    cache = head.attention_layers()[0].kv_cache
    cache.normal_(generator=gen)
    before = cache.clone()
    with torch.inference_mode():
        head(ids, positions, head.combine(aux), meta)
        want = cache.clone()
        cache.copy_(before)
        head.cache_kv(ids, positions, head.combine(aux), meta)
    torch.cuda.synchronize()
    assert not torch.equal(want, before)
    if not rows_alone and rows > 1:
        assert torch.equal(cache, want)
    elif not rows_alone:  # one row a sequence: the whole layer rotates its keys in the one-launch decode kernel
        assert torch.equal(cache[1], want[1])  # values: the same projection's bits
        assert_nearly_equal_bf16(cache[0], want[0])  # keys: H200 79f5fed, 27,902 of the 262,144 written one ulp apart
    else:
        assert_nearly_equal_bf16(cache, want)
        same = torch.equal(cache, want)
        print(f"k|v rows alone, {seqs} x {rows}: cache bit for bit equal to the whole layer's: {same}")
