"""The Triton form of layers/attention/kv_only.write_rotated_kv (rope_write_kv_triton with no query
heads) leaves the cache the full block leaves (Attention.forward_rotary on the Triton backend: RoPE
and the KV write in one launch before a prefill's attention, or the one-launch decode kernel), bit
for bit, in Triton's interpreter on CPU tensors (the real kernels on a CUDA machine): float16 and
float32 caches, an FP8 cache with scales, a padded row (slot -1), GQA, keys and values as strided
columns of a fused projection."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.layers.attention.kv_only import write_rotated_kv
from foretell.layers.attention.layer import Attention
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.common import kernel_choice

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
import_interpreted("foretell.ops.pointwise.triton_kernels")
rkv = import_interpreted("foretell.ops.attention.triton_rope_kv")
import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_rope_paged")
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 4, 24


def _step(rows_per_seq: list[int], seq_lens: list[int], gen: torch.Generator):
    """(metadata, positions [T]) of sequences whose last rows_per_seq[i] rows end at seq_lens[i], over
    a shuffled block table; the second row's slot is -1 (padding)."""
    table = torch.randperm(NUM_BLOCKS, generator=gen).view(len(seq_lens), -1).to(torch.int32)
    positions = [p for n, s in zip(rows_per_seq, seq_lens) for p in range(s - n, s)]
    seq_of = [i for i, n in enumerate(rows_per_seq) for _ in range(n)]
    slots = [int(table[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for i, p in zip(seq_of, positions)]
    slots[1] = -1
    starts = [0]
    for n in rows_per_seq:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_table=table.to(DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE), block_size=BLOCK_SIZE, max_query_len=max(rows_per_seq),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
    )
    return meta, torch.tensor(positions, device=DEVICE)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                               (torch.float16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_triton_write_equals_the_full_blocks(monkeypatch, dtype, cache_dtype, shape):
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rows, lens = ([20, 5], [20, 30]) if shape == "prefill" else ([1, 1, 1], [7, 19, 2])
    meta, positions = _step(rows, lens, gen)
    num_tokens = positions.shape[0]
    rotary = RotaryEmbedding(HEAD_DIM, 256, 10000.0, device=DEVICE)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(DEVICE)
    start = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(cache_dtype).to(DEVICE)
    layers = []
    for _ in range(2):
        layer = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5, TritonAttentionBackend())
        if cache_dtype != dtype:
            layer.kv_scales.k_scale.data.fill_(0.5)
            layer.kv_scales.v_scale.data.fill_(2.0)
        layer.bind_kv_cache(start.clone())
        layers.append(layer)
    q, k, v = (t.view(num_tokens, -1, HEAD_DIM) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    with reports_seed(seed):
        layers[0].forward_rotary(positions, q, k, v, rotary, meta)
        write_rotated_kv(layers[1], qkv[:, q_size:], positions, rotary, meta)
        assert torch.equal(layers[1].kv_cache.view(torch.uint8), layers[0].kv_cache.view(torch.uint8))
        assert not torch.equal(layers[1].kv_cache.view(torch.uint8), start.view(torch.uint8))
