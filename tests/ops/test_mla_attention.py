"""The Triton MLA kernels (latent write, absorbed attention with split-K) held against their
plain-torch twins, and a tiny DeepSeek model through the engine with attention_backend="triton".

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (fp16 and fp32; the
interpreter's bf16 tl.dot is wrong, so bf16 is checked in tests/gpu). TRITON_INTERPRET is set
here, by the test harness, only while this module imports and runs: the library never reads it.
Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import causal_attention, gather_context
from foretell.ops.mla.reference import TorchMLABackend

if torch.cuda.is_available():
    pytest.skip("on a GPU the kernels are tested in tests/gpu/test_mla_moe_gpu.py", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.mla.triton_rope")
latent_write = import_interpreted("foretell.ops.mla.triton_latent_write")
import_interpreted("foretell.ops.mla.triton_fused")
mla_triton = import_interpreted("foretell.ops.mla.triton_attention")
mla_backend = import_interpreted("foretell.ops.mla.triton_backend")


TOLERANCE = {torch.float16: 5e-3, torch.float32: 1e-4}
# (cached prefix length, query length) per sequence.
BATCHES = {
    "decode": [(35, 1), (0, 1), (64, 1), (17, 1), (8, 1)],
    "verify": [(17, 3), (40, 5), (9, 2), (30, 6), (0, 4)],
    "prefill": [(0, 13), (20, 7), (0, 1), (5, 20)],
    "mixed": [(0, 11), (35, 1), (17, 3), (3, 0), (64, 1), (40, 5)],
}
LONG = [(129, 1), (200, 3), (60, 6), (7, 1)]


def _seed() -> int:
    return random.randrange(2**31)


class LatentBatch:
    """A random paged batch over an MLA cache. Blocks are handed out in random order; every slot
    outside a context (tails, spare blocks, the block unused table entries point at) holds NaN."""

    def __init__(self, specs, num_heads, rank, rope, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
        num_blocks = sum(blocks_per_seq) + 3
        poison = num_blocks - 1
        order = torch.randperm(num_blocks - 1, generator=gen)
        table = torch.full((len(specs), max(blocks_per_seq + [1]) + 2), poison, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = order[used : used + n].to(torch.int32)
            used += n

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.cache = torch.full((num_blocks, block_size, rank + rope), float("nan")).to(dtype)
        prefix_slots, new_slots, qsl = [], [], [0]
        for i, (prefix, q_len) in enumerate(specs):
            slots = [int(table[i, t // block_size]) * block_size + t % block_size for t in range(prefix + q_len)]
            prefix_slots += slots[:prefix]
            new_slots += slots[prefix:]
            qsl.append(qsl[-1] + q_len)
        prefix_slots = torch.tensor(prefix_slots, dtype=torch.int64)
        self.cache.flatten(0, 1)[prefix_slots] = rand(len(prefix_slots), rank + rope)
        num_tokens = qsl[-1]
        self.latent, self.k_pe = rand(num_tokens, rank), rand(num_tokens, rope)
        self.q_lat, self.q_pe = rand(num_tokens, num_heads, rank) * 0.3, rand(num_tokens, num_heads, rope)
        seq_lens = [p + q for p, q in specs]
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
            block_size=block_size,
            max_query_len=max(q for _, q in specs),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        self.rank, self.scale = rank, 0.7 * (rank + rope) ** -0.5


def reference_o_lat(batch: LatentBatch, cache: torch.Tensor) -> torch.Tensor:
    """The absorbed form's attention part (absorbed_attention in mla.py without the projections)."""
    md, rank = batch.metadata, batch.rank
    out = torch.zeros_like(batch.q_lat)
    for i, seq_len in enumerate(md.seq_lens_cpu):
        lo, hi = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        if hi > lo:
            key = gather_context(cache, md.block_table[i], seq_len).unsqueeze(1)  # [S, 1, rank+rope]
            query = torch.cat([batch.q_lat[lo:hi], batch.q_pe[lo:hi]], -1)
            out[lo:hi] = causal_attention(query, key, key[..., :rank], batch.scale)
    return out


def check(batch: LatentBatch, dtype, seed, num_splits=None, config=None):
    md = batch.metadata
    cache_ref = batch.cache.clone()
    TorchMLABackend().write_kv(batch.latent, batch.k_pe, cache_ref, md.slot_mapping)
    cache = batch.cache.clone()
    latent_write.write_latent_triton(batch.latent, batch.k_pe, cache, md.slot_mapping)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"latent write mismatch (seed {seed}): {m}")
    expected = reference_o_lat(batch, cache_ref)
    out = torch.full_like(batch.q_lat, float("nan"))
    returned = mla_triton.mla_attention_triton(
        batch.q_lat, batch.q_pe, cache, md.block_table, md.seq_lens, md.query_start_loc,
        md.max_query_len, batch.scale, out, num_splits=num_splits, config=config,
    )
    assert returned is out
    assert not out.isnan().any(), f"rows left unwritten or NaN read (seed {seed})"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"MLA attention mismatch (seed {seed}): {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_attention_matches_torch(kind, dtype):
    seed = _seed()
    check(LatentBatch(BATCHES[kind], 4, 32, 8, 8, dtype, seed), dtype, seed)


@pytest.mark.parametrize("num_heads, rank, rope, block_size", [(16, 64, 16, 16), (3, 32, 8, 4), (20, 16, 8, 16)])
def test_head_counts_and_widths(num_heads, rank, rope, block_size):
    seed = _seed()
    check(LatentBatch(BATCHES["mixed"], num_heads, rank, rope, block_size, torch.float16, seed),
          torch.float16, seed)


@pytest.mark.parametrize("num_splits", [2, 3, 8, 32])
def test_split_context_matches_torch(num_splits):
    seed = _seed()
    check(LatentBatch(LONG, 4, 32, 8, 16, torch.float16, seed), torch.float16, seed, num_splits=num_splits)


def test_wide_row_blocks():
    # Several tokens' heads in one program (BLOCK_M 64 over 4 heads: 16 tokens), larger tiles.
    seed = _seed()
    config = {"BLOCK_M": 64, "TILE_N": 32, "num_warps": 8}
    check(LatentBatch(BATCHES["prefill"], 4, 32, 8, 8, torch.float16, seed), torch.float16, seed, config=config)


def test_backend_matches_torch_backend_and_skips_padding_slots():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    heads, nope, v, rank, rope = 4, 16, 12, 32, 8
    batch = LatentBatch(BATCHES["mixed"], heads, rank, rope, 8, torch.float32, seed)
    md = batch.metadata
    kv_b = torch.randn(heads * (nope + v), rank, generator=gen) / rank**0.5
    q_nope = torch.randn(md.num_tokens, heads, nope, generator=gen)
    backend, reference = mla_backend.TritonMLABackend(), TorchMLABackend()
    assert backend.graph_safe and backend.name == "triton"
    cache, cache_ref = batch.cache.clone(), batch.cache.clone()
    slots = md.slot_mapping.clone()
    slots[[0, 5]] = -1  # CUDA-graph padding rows write nothing
    keep = slots >= 0
    backend.write_kv(batch.latent, batch.k_pe, cache, slots)
    reference.write_kv(batch.latent[keep], batch.k_pe[keep], cache_ref, slots[keep])
    assert torch.equal(cache.isnan(), cache_ref.isnan()) and torch.equal(cache.nan_to_num(), cache_ref.nan_to_num())
    backend.write_kv(batch.latent, batch.k_pe, cache, md.slot_mapping)
    reference.write_kv(batch.latent, batch.k_pe, cache_ref, md.slot_mapping)
    out = backend.attend(q_nope, batch.q_pe, kv_b, cache, md, batch.scale, v)
    expected = reference.attend(q_nope, batch.q_pe, kv_b, cache_ref, md, batch.scale, v)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    with pytest.raises(ValueError, match="block_size"):
        backend.attend(q_nope, batch.q_pe, kv_b, cache.view(-1, 4, rank + rope), md, batch.scale, v)


def test_padding_rows_are_left_untouched():
    seed = _seed()
    batch = LatentBatch(BATCHES["verify"], 4, 32, 8, 8, torch.float16, seed)
    md = batch.metadata
    cache = batch.cache.clone()
    latent_write.write_latent_triton(batch.latent, batch.k_pe, cache, md.slot_mapping)
    n = md.num_tokens
    q_lat, q_pe = torch.cat([batch.q_lat, batch.q_lat[:3]]), torch.cat([batch.q_pe, batch.q_pe[:3]])
    for num_splits in (1, 2):
        out = torch.full_like(q_lat, float("nan"))
        mla_triton.mla_attention_triton(q_lat, q_pe, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                        md.max_query_len, batch.scale, out, num_splits=num_splits)
        assert not out[:n].isnan().any() and out[n:].isnan().all(), f"seed {seed}"


# --------------------------------------------------------------------------- through the engine


def _greedy(folder, spec=None, **kwargs):
    from foretell import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", num_kv_blocks=32, max_num_seqs=4, skip_tokenizer_init=True,
              speculative_config=spec, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 2, 77, 31, 8, 100], [3] * 20, [42, 7])]
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow  # interpreter-driven: minutes on 2 cores
def test_deepseek_triton_backend_matches_torch(checkpoint_root, tokenizer_dir, monkeypatch):
    """Tiny DeepSeek-V3 (MLA + MoE + an MTP layer) greedy through the graph-safe path: Triton MLA
    for prefill, decode and verify, fused MoE forced on (it dispatches on CUDA only), MTP drafts
    attending through the same kernels; tokens equal the torch backend's."""
    from fixtures import deepseek as ds

    from foretell.ops.moe import dispatch as moe_dispatch

    moe_triton = import_interpreted("foretell.ops.moe.triton_experts")
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    _, want = _greedy(folder, attention_backend="torch")
    monkeypatch.setattr(moe_dispatch, "use_triton", lambda *tensors: True)
    calls = []
    fused = moe_triton.fused_experts_triton
    monkeypatch.setattr(moe_triton, "fused_experts_triton", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    llm, got = _greedy(folder, attention_backend="triton")
    assert got == want
    assert calls and all(isinstance(layer.backend, mla_backend.TritonMLABackend)
                         for layer in llm.engine.runner.model.attention_layers())
    from foretell.runner.cuda_graph import CudaGraphRunner

    keys, replay = [], CudaGraphRunner.replay
    monkeypatch.setattr(CudaGraphRunner, "replay", lambda self, key: keys.append(key) or replay(self, key))
    llm, spec_got = _greedy(folder, {"method": "mtp", "num_speculative_tokens": 2}, attention_backend="triton")
    assert spec_got == want
    assert (4, 3) in keys  # verify batches took the graph-safe path


@pytest.mark.slow  # interpreter-driven: minutes on 2 cores
def test_v2_lite_every_fused_kernel_matches_torch(checkpoint_root, tokenizer_dir, monkeypatch):
    """Tiny DeepSeek-V2-Lite (ungrouped softmax routing, interleaved RoPE) greedy with every GPU
    kernel forced on: Triton MLA (its fused latent write with gptj RoPE), fused norm / SiLU, the
    routing kernel and the fused experts; tokens equal the all-torch path's."""
    from fixtures import deepseek as ds

    from foretell.ops.common import kernel_choice
    from foretell.ops.moe import dispatch as moe_dispatch

    import_interpreted("foretell.ops.pointwise.triton_kernels")
    router = import_interpreted("foretell.ops.moe.triton_router")
    import_interpreted("foretell.ops.moe.triton_experts")
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v2_lite")
    _, want = _greedy(folder, attention_backend="torch")
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(moe_dispatch, "use_triton", lambda *tensors: True)
    rope_styles, routed = [], []
    write, route = latent_write.latent_write_triton, router.route_triton
    # RoPE runs inside the fused MLA kernels: the latent write rotates k_pe with the layer's style.
    monkeypatch.setattr(mla_backend, "latent_write_triton",
                        lambda kv_a, positions, norm, rotary, *a: rope_styles.append(rotary.style)
                        or write(kv_a, positions, norm, rotary, *a))
    monkeypatch.setattr(router, "route_triton", lambda *a: routed.append(1) or route(*a))
    _, got = _greedy(folder, attention_backend="triton")
    assert got == want
    assert rope_styles and set(rope_styles) == {"gptj"} and routed
