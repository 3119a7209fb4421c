"""The Triton MLA and fused MoE kernels on a CUDA device: bf16 (and fp16/fp32) at DeepSeek-V2-Lite
and V3 sizes against their torch twins, no host sync in a launch, capture and replay inside a CUDA
graph, and a tiny DeepSeek-V3 through the engine (graphs captured) equal to the torch backend.

Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import causal_attention, gather_context
from foretell.ops.mla.reference import TorchMLABackend
from foretell.ops.mla.triton_attention import mla_attention_triton
from foretell.ops.mla.triton_backend import TritonMLABackend
from foretell.ops.mla.triton_latent_write import write_latent_triton
from foretell.ops.moe.reference import experts_forward_torch
from foretell.ops.moe.triton_experts import fused_experts_triton

DEVICE = torch.device("cuda")
RANK, ROPE = 512, 64
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-4}


def _seed() -> int:
    return random.randrange(2**31)


def latent_batch(specs, num_heads, block_size, dtype, seed, extra_width=0):
    """Random paged MLA batch, specs (cached prefix, query length); unused slots hold NaN.
    Returns q_lat, q_pe, latent, k_pe (this step's new tokens), cache, metadata."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE).to(torch.int32)
    table = torch.full((len(specs), max(blocks_per_seq) + extra_width), num_blocks - 1,
                       dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = order[used : used + n]
        used += n

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    slot_rows = []
    for i, (p, q) in enumerate(specs):
        pos = torch.arange(p + q, device=DEVICE)
        slot_rows.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    all_slots = torch.cat(slot_rows)
    cache.view(-1, RANK + ROPE)[all_slots] = rand(all_slots.numel(), RANK + ROPE)
    new_slots = torch.cat([rows[p:] for rows, (p, _) in zip(slot_rows, specs)])
    qsl = [0]
    for _, q in specs:
        qsl.append(qsl[-1] + q)
    seq_lens = [p + q for p, q in specs]
    n = qsl[-1]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table, slot_mapping=new_slots, block_size=block_size,
        max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return (rand(n, num_heads, RANK, scale=0.1), rand(n, num_heads, ROPE), rand(n, RANK), rand(n, ROPE),
            cache, md)


def reference_o_lat(q_lat, q_pe, cache, md, scale):
    out = torch.zeros_like(q_lat)
    for i, seq_len in enumerate(md.seq_lens_cpu):
        lo, hi = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        if hi > lo:
            key = gather_context(cache, md.block_table[i], seq_len).unsqueeze(1)
            query = torch.cat([q_lat[lo:hi], q_pe[lo:hi]], -1)
            out[lo:hi] = causal_attention(query, key, key[..., :RANK], scale)
    return out


def compare_mla(specs, num_heads, dtype, block_size=16, num_splits=None, extra_width=0, repeats=1):
    seed = _seed()
    q_lat, q_pe, latent, k_pe, cache, md = latent_batch(specs, num_heads, block_size, dtype, seed, extra_width)
    cache_ref = cache.clone()
    TorchMLABackend().write_kv(latent, k_pe, cache_ref, md.slot_mapping)
    write_latent_triton(latent, k_pe, cache, md.slot_mapping)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"latent write (seed {seed}): {m}")
    scale = 192**-0.5
    expected = reference_o_lat(q_lat, q_pe, cache_ref, md, scale)
    outs = []
    for _ in range(repeats):  # repeated launches must agree bit for bit
        out = torch.full_like(q_lat, float("nan"))
        mla_attention_triton(q_lat, q_pe, cache, md.block_table, md.seq_lens, md.query_start_loc,
                             md.max_query_len, scale, out, num_splits=num_splits)
        outs.append(out)
    assert not out.isnan().any(), f"unwritten rows or NaN read (seed {seed})"
    assert all(torch.equal(o, out) for o in outs), f"repeated launches differ (seed {seed})"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"MLA attention (seed {seed}): {m}")


MIXED = [(0, 300), (1000, 1), (517, 4), (2047, 1), (64, 200), (333, 6), (0, 1), (4000, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_mixed_batch(dtype, num_heads):
    compare_mla(MIXED, num_heads, dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 7, 32])
@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_long_context_decode_and_verify(num_splits, q_len, num_heads):
    specs = [(8191 - q_len, q_len), (4095, q_len), (100, q_len)]
    compare_mla(specs, num_heads, torch.bfloat16, num_splits=num_splits, extra_width=64)


def test_mla_split_context_is_deterministic():
    specs = [(2000, 1), (1023, 4), (37, 1), (500, 3)]
    compare_mla(specs, 16, torch.bfloat16, num_splits=64, extra_width=64, repeats=20)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_mla_block_sizes(block_size):
    compare_mla(MIXED[:4], 16, torch.bfloat16, block_size=block_size)


def test_mla_backend_no_sync_and_graph_replay():
    """Capture write + attend for a verify shape; replay with new lengths, blocks and contents."""
    heads, nope, v, block_size = 16, 128, 128, 16
    specs = [(700, 4), (1500, 4), (30, 4), (3000, 4)]
    seed = _seed()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, q_pe, latent, k_pe, cache, md = latent_batch(specs, heads, block_size, torch.bfloat16, seed, 200)
    kv_b = (torch.randn(heads * (nope + v), RANK, generator=gen, device=DEVICE) / RANK**0.5).bfloat16()
    q_nope = torch.randn(q_pe.shape[0], heads, nope, generator=gen, device=DEVICE).bfloat16()
    backend, scale = TritonMLABackend(), 192**-0.5
    static = {"q_nope": q_nope, "q_pe": q_pe.clone(), "latent": latent, "k_pe": k_pe}
    static_cache = torch.full((600, block_size, RANK + ROPE), float("nan"), dtype=cache.dtype, device=DEVICE)
    static_cache[: cache.shape[0]].copy_(cache)
    static_md = AttentionMetadata(
        query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(),
        block_table=md.block_table.clone(), slot_mapping=md.slot_mapping.clone(), block_size=block_size,
        max_query_len=4, max_seq_len=md.max_seq_len, query_start_loc_cpu=md.query_start_loc_cpu,
        seq_lens_cpu=md.seq_lens_cpu,
    )

    def step():
        backend.write_kv(static["latent"], static["k_pe"], static_cache, static_md.slot_mapping)
        return backend.attend(static["q_nope"], static["q_pe"], kv_b, static_cache, static_md, scale, v)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles every kernel before capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for replay in range(2):
        new_specs = [(900 + 150 * replay, 4), (2200, 4), (31, 4), (3100 - replay, 4)]
        _, q_pe2, latent2, k_pe2, c2, md2 = latent_batch(new_specs, heads, block_size, torch.bfloat16,
                                                         seed + 1 + replay)
        q_nope2 = torch.randn_like(q_nope.float()).bfloat16()
        for name, t in (("q_nope", q_nope2), ("q_pe", q_pe2), ("latent", latent2), ("k_pe", k_pe2)):
            static[name].copy_(t)
        static_cache.fill_(float("nan"))
        static_cache[: c2.shape[0]].copy_(c2)
        width = md2.block_table.shape[1]
        static_md.query_start_loc.copy_(md2.query_start_loc)
        static_md.seq_lens.copy_(md2.seq_lens)
        static_md.block_table.zero_()
        static_md.block_table[:, :width].copy_(md2.block_table)
        static_md.slot_mapping.copy_(md2.slot_mapping)
        graph.replay()
        cache_ref = c2.clone()
        reference = TorchMLABackend()
        reference.write_kv(latent2, k_pe2, cache_ref, md2.slot_mapping)
        expected = reference.attend(q_nope2, q_pe2, kv_b, cache_ref, md2, scale, v)
        torch.testing.assert_close(static_out.float(), expected.float(), rtol=3e-2, atol=3e-2,
                                   msg=lambda m, r=replay: f"replay {r} (seed {seed}): {m}")


# ------------------------------------------------------------------------------------- MoE

V2_LITE = dict(num_experts=64, top_k=6, hidden=2048, inter=1408)


def moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed, skip_experts=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=DEVICE) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen, device=DEVICE) / inter**0.5).to(dtype)
    allowed = torch.randperm(num_experts, generator=gen, device=DEVICE)[: num_experts - skip_experts]
    scores = torch.rand(num_tokens, len(allowed), generator=gen, device=DEVICE)
    ids = allowed[scores.topk(top_k, dim=-1).indices]  # distinct experts per token
    weights = torch.rand(num_tokens, top_k, generator=gen, device=DEVICE)
    return x, gate_up, down, weights, ids


def compare_moe(num_tokens, dtype, align_kernel=None, skip_experts=0, **dims):
    dims = {**V2_LITE, **dims}
    seed = _seed()
    x, gate_up, down, weights, ids = moe_inputs(num_tokens, dtype=dtype, seed=seed, skip_experts=skip_experts,
                                                **dims)
    expected = experts_forward_torch(x, gate_up, down, weights, ids)
    out = fused_experts_triton(x, gate_up, down, weights, ids, align_kernel=align_kernel)
    tol = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-3}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol, msg=lambda m: f"fused MoE (seed {seed}): {m}")
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel < tol / 3, f"relative error {rel} (seed {seed})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 700])
def test_fused_moe_v2_lite_sizes(num_tokens, dtype):
    compare_moe(num_tokens, dtype)


@pytest.mark.parametrize("num_tokens", [1, 4, 300])
def test_fused_moe_with_shared_experts_in_bf16(num_tokens):
    """MoE.forward's GPU path: the combine step adds the shared experts' output in float32 and
    casts to bf16 once, as the torch path does."""
    seed = _seed()
    x, gate_up, down, weights, ids = moe_inputs(num_tokens, dtype=torch.bfloat16, seed=seed, **V2_LITE)
    shared = torch.randn(num_tokens, V2_LITE["hidden"], device=DEVICE).to(torch.bfloat16)
    expected = (experts_forward_torch(x, gate_up, down, weights, ids) + shared).to(torch.bfloat16)
    out = fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2,
                               msg=lambda m: f"fused MoE + shared (seed {seed}): {m}")


@pytest.mark.parametrize("align_kernel", [True, False])
def test_fused_moe_v3_like_and_empty_experts(align_kernel):
    # 256 experts (V3), top-8, smaller hidden to keep the test quick; half the experts unused.
    compare_moe(48, torch.bfloat16, align_kernel=align_kernel, num_experts=256, top_k=8, hidden=1024,
                inter=256, skip_experts=128)
    compare_moe(3000, torch.bfloat16, align_kernel=align_kernel, num_experts=256, top_k=8, hidden=512,
                inter=256)


def test_fused_moe_no_sync_and_graph_replay():
    seed = _seed()
    x, gate_up, down, weights, ids = moe_inputs(16, dtype=torch.bfloat16, seed=seed, **V2_LITE)
    fused_experts_triton(x, gate_up, down, weights, ids)  # compile
    fused_experts_triton(x[:1], gate_up, down, weights[:1], ids[:1])
    fused_experts_triton(x, gate_up, down, weights, ids, align_kernel=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts_triton(x, gate_up, down, weights, ids)
        fused_experts_triton(x[:1], gate_up, down, weights[:1], ids[:1])
        fused_experts_triton(x, gate_up, down, weights, ids, align_kernel=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = [t.clone() for t in (x, weights, ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts_triton(static[0], gate_up, down, static[1], static[2])
    for replay in range(3):
        x2, _, _, w2, ids2 = moe_inputs(16, dtype=torch.bfloat16, seed=seed + 1 + replay, **V2_LITE)
        if replay == 2:
            ids2[:] = ids2[0]  # every token on the same experts: one expert's run spans a block
        for dst, src in zip(static, (x2, w2, ids2)):
            dst.copy_(src)
        graph.replay()
        expected = experts_forward_torch(x2, gate_up, down, w2, ids2)
        torch.testing.assert_close(static_out, expected, rtol=3e-2, atol=3e-2,
                                   msg=lambda m, r=replay: f"replay {r} (seed {seed}): {m}")


# ------------------------------------------------------------------------------ the engine


def test_tiny_deepseek_triton_equals_torch_on_gpu(checkpoint_root, tokenizer_dir):
    """float32, graphs captured (MLA + fused MoE inside), with and without MTP drafting."""
    from fixtures import deepseek as ds

    from foretell import LLM, SamplingParams

    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 2, 77, 31, 8, 100], [3] * 40, [42, 7], list(range(60)))]

    def greedy(backend, spec=None):
        llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, skip_tokenizer_init=True,
                  attention_backend=backend, speculative_config=spec)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    _, want = greedy("torch")
    llm, got = greedy("triton")
    assert llm.engine.runner.graphs is not None and got == want
    llm, got = greedy("triton", {"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.runner.graphs is not None and got == want
