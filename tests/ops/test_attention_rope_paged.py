"""Decode / verify attention with RoPE and the KV write in one launch
(ops/attention/triton_rope_paged.py) held against the two launches it replaces
(rope_write_kv_triton, then paged_attention_triton) and the torch path (RotaryEmbedding, write_kv_torch,
TorchAttentionBackend), in Triton's interpreter on CPU tensors (the real kernel on CUDA).

The cache must equal the two-launch path's bit for bit (same roundings; within one rounding on a
GPU, whose compiler may fuse a product with its sum in one kernel and not the other); outputs agree
within the dtype's tolerance (the scores sum in another order). Contexts over several tiles, split several
ways (each split writes the new tokens of its tiles), both pairings, Qwen3's q_norm / k_norm,
strided q/k/v views of a fused projection, a padded sequence (slot -1: nothing written).
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.common import kernel_choice
from foretell.layers.attention.layer import Attention
from foretell.ops.attention.reference import TorchAttentionBackend, write_kv_torch
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding
from test_attention_paged import BATCHES, LONG_BATCHES, TOLERANCE, Batch

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
import_interpreted("foretell.ops.pointwise.triton_kernels")
rkv = import_interpreted("foretell.ops.attention.triton_rope_kv")
kernels = import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
fused = import_interpreted("foretell.ops.attention.triton_rope_paged")
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
NORM_TOLERANCE = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}


class Step:
    """A Batch whose q, k, v come before RoPE, as views of one fused projection, with positions."""

    def __init__(self, specs, group, head_dim, dtype, seed, style="neox", with_norm=False, padded=None):
        self.batch = Batch(specs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=16, dtype=dtype,
                           seed=seed)
        b = self.batch
        num_tokens = b.query.shape[0]
        qkv = torch.cat([t.reshape(num_tokens, -1) for t in (b.query, b.key, b.value)], dim=1)
        q_width, kv_width = b.query[0].numel(), b.key[0].numel()
        self.query = qkv[:, :q_width].view(b.query.shape)
        self.key = qkv[:, q_width:q_width + kv_width].view(b.key.shape)
        self.value = qkv[:, q_width + kv_width:].view(b.value.shape)
        self.positions = torch.tensor([p + t for p, q in specs for t in range(q)], device=DEVICE)
        self.rotary = RotaryEmbedding(head_dim, 4096, 10000.0, SCALING, style, device=DEVICE)
        gen = torch.Generator().manual_seed(seed)
        self.qk_norm = None
        if with_norm:
            self.qk_norm = tuple(RMSNorm(head_dim, eps, dtype=dtype, device=DEVICE) for eps in (1e-6, 1e-5))
            for norm in self.qk_norm:
                norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
        self.padded = padded  # a sequence whose rows are padding: slot -1
        self.tree_mask = None  # [num_tokens, W] bool over each sequence's last W keys (test_attention_rope_paged_tree.py)
        if padded is not None:
            starts = b.metadata.query_start_loc_cpu
            b.metadata.slot_mapping[starts[padded]:starts[padded + 1]] = -1

    def run_fused(self, cache, **split):
        md = self.batch.metadata
        return fused.rope_paged_attention_triton(
            self.positions, self.query, self.key, self.value, self.rotary.cos_cache, self.rotary.sin_cache, cache,
            md.slot_mapping, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len, self.batch.scale,
            style=self.rotary.style, qk_norm=self.qk_norm, tree_mask=self.tree_mask, **split)

    def run_two_launches(self, cache, **split):
        md = self.batch.metadata
        q = rkv.rope_write_kv_triton(self.positions, self.query, self.key, self.value, self.rotary.cos_cache,
                                     self.rotary.sin_cache, cache, md.slot_mapping, style=self.rotary.style,
                                     qk_norm=self.qk_norm)
        out = torch.full_like(q, float("nan"))
        return kernels.paged_attention_triton(q, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                              md.max_query_len, self.batch.scale, out, tree_mask=self.tree_mask,
                                              **split)

    def run_torch(self):  # CPU tensors: the torch path of every step
        md = self.batch.metadata
        q, k = self.query, self.key
        if self.qk_norm is not None:
            q, k = self.qk_norm[0](q)[0], self.qk_norm[1](k)[0]
        q, k = self.rotary(self.positions, q, k)
        cache = self.batch.cache.clone()
        real = md.slot_mapping >= 0
        write_kv_torch(k[real], self.value[real], cache, md.slot_mapping[real])
        return TorchAttentionBackend().attend(q, cache, md, self.batch.scale, tree_mask=self.tree_mask)

    def live_rows(self) -> torch.Tensor:  # [num_tokens] bool: rows of sequences that are not padding
        rows = torch.ones(self.query.shape[0], dtype=torch.bool, device=DEVICE)
        if self.padded is not None:
            starts = self.batch.metadata.query_start_loc_cpu
            rows[starts[self.padded]:starts[self.padded + 1]] = False
        return rows


def _check(step: Step, dtype, seed, **split):
    with reports_seed(seed):
        cache = step.batch.cache.clone()
        got = step.run_fused(cache, **split)
        two_cache = step.batch.cache.clone()
        two = step.run_two_launches(two_cache, **split)
        # Same writes, same values; on a GPU the compiler may fuse RoPE's products with their sums
        # differently in the two kernels (test_pointwise_kernels_gpu.py's _check_rope): one rounding.
        exact = DEVICE.type == "cpu"
        torch.testing.assert_close(cache, two_cache, rtol=0 if exact else NORM_TOLERANCE[dtype]["rtol"],
                                   atol=0 if exact else NORM_TOLERANCE[dtype]["atol"], equal_nan=True)
        live = step.live_rows()
        assert not got[live].isnan().any(), "rows left unwritten or NaN read"
        tolerance = NORM_TOLERANCE[dtype] if step.qk_norm is not None else dict(rtol=TOLERANCE[dtype],
                                                                                  atol=TOLERANCE[dtype])
        torch.testing.assert_close(got[live].float(), two[live].float(), **tolerance)
        if DEVICE.type == "cpu":
            expected = step.run_torch()
            torch.testing.assert_close(got[live].float(), expected[live].float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["decode", "verify"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_matches_the_two_launches_and_torch(dtype, kind, style):
    seed = random.randrange(2**31)
    group = 4 if dtype == torch.float16 else 2  # float32 tiles hold 16 rows: 8 tokens of a group of 2
    _check(Step(BATCHES[kind], group, 64, dtype, seed, style), dtype, seed)


@pytest.mark.parametrize("num_splits, min_split_tokens", [(1, 128), (4, 1), (8, 1), (32, 16)])
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_every_split_writes_the_new_tokens_of_its_tiles(kind, num_splits, min_split_tokens):
    """Contexts over several tiles, ending just past a tile edge: a verify's new tokens may lie in
    two splits' tiles, each split writing its own."""
    seed = random.randrange(2**31)
    step = Step(LONG_BATCHES[kind], 4, 64, torch.float16, seed)
    _check(step, torch.float16, seed, num_splits=num_splits, min_split_tokens=min_split_tokens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qwen3_qk_norm_and_a_padded_sequence(dtype):
    seed = random.randrange(2**31)
    step = Step(LONG_BATCHES["verify"], 2, 32, dtype, seed, with_norm=True, padded=1)
    _check(step, dtype, seed, num_splits=4, min_split_tokens=1)


def test_fits_only_decode_and_short_verify():
    query = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 128, dtype=torch.bfloat16)
    assert fused.fits(query, 1, 128, cache) and fused.fits(query, 4, 128, cache) and fused.fits(query, 16, 128, cache)
    assert not fused.fits(query, 17, 128, cache)  # a prefill chunk: several query blocks
    assert not fused.fits(query, 4, 64, cache)  # partial rotary
    assert not fused.fits(query, 4, 128, cache.float())  # the cache in another dtype
    assert not fused.fits(query.float(), 8, 128, cache.float())  # float32 tiles hold 4 tokens of a group of 4


def test_bad_input_is_refused():
    step = Step(BATCHES["decode"], 4, 64, torch.float32, 0)
    md = step.batch.metadata
    args = (step.rotary.cos_cache, step.rotary.sin_cache, step.batch.cache, md.slot_mapping, md.block_table,
            md.seq_lens, md.query_start_loc)
    with pytest.raises(ValueError, match="key and value must be"):
        fused.rope_paged_attention_triton(step.positions, step.query, step.key[:, :1], step.value, *args, 1, 0.1)
    with pytest.raises(ValueError, match="queries in one block of 4 tokens"):
        fused.rope_paged_attention_triton(step.positions, step.query, step.key, step.value, *args, 40, 0.1)
    with pytest.raises(ValueError, match="rope style"):
        fused.rope_paged_attention_triton(step.positions, step.query, step.key, step.value, *args, 1, 0.1,
                                          style="llama")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_forward_rotary_takes_one_launch_for_decode(monkeypatch, kind):
    """Attention.forward_rotary on the Triton backend: one launch for decode, the two for a prefill."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    calls = []
    for module, name in ((fused, "rope_paged_attention_triton"), (rkv, "rope_write_kv_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, kernel=kernel, name=name, **kw: calls.append(name) or kernel(*a, **kw))
    seed = random.randrange(2**31)
    step = Step(BATCHES[kind], 4, 64, torch.float16, seed)
    layer = Attention(8, 64, 2, step.batch.scale, TritonAttentionBackend())
    layer.bind_kv_cache(step.batch.cache.clone())
    with reports_seed(seed):
        got = layer.forward_rotary(step.positions, step.query, step.key, step.value, step.rotary, step.batch.metadata)
        assert calls == (["rope_paged_attention_triton"] if kind == "decode" else ["rope_write_kv_triton"])
        expected = step.run_two_launches(step.batch.cache.clone())
        torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE[torch.float16],
                                   atol=TOLERANCE[torch.float16])
