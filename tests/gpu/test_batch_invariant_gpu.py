"""The batch-invariant mode on a CUDA device in bf16 (issue 23): for each kernel the mode runs, row r
computed at M = 1 equals row r computed among M = 2..512, bit for bit (the linear at Llama-3.1-8B
shapes with split-K fixed by shape, across row tiles of 16 / 64 / 128 rows, gated and float32
LM-head epilogues; RMSNorm, RoPE, SiLU-and-mul, argmax; the MoE experts at V2-Lite shapes and the
router); the GQA and MLA attention launches (the GQA one also through rope_attend, RoPE + KV write
first) give a row the same bits alone, verified, in chunks and batched in any order; the linear and the MoE experts replay bit-identically in a CUDA graph; and end to end on the default family with graphs, one at a time / batched /
EAGLE3 / n-gram give the same tokens and logprob bits.
"""

from __future__ import annotations

import os

import pytest
import torch

from fixtures.float64_linear import LLAMA8B_SHAPES
from foretell.ops.gemm.batch_invariant import BatchInvariantGemm
from foretell.ops.pointwise import triton_kernels as pointwise
from foretell.ops.sampling.triton_argmax import argmax_triton

DEVICE = torch.device("cuda")
M_VALUES = [2, 3, 4, 5, 8, 16, 17, 31, 33, 64]


def assert_rows_invariant(fn, x: torch.Tensor, m_values=M_VALUES) -> None:
    alone = [fn(x[r : r + 1].clone()) for r in range(max(m_values))]
    for m in m_values:
        together = fn(x[:m].clone())
        for r in range(m):
            assert torch.equal(together[r : r + 1], alone[r]), f"row {r} differs at M={m}"


@pytest.mark.parametrize("n,k", LLAMA8B_SHAPES[:4] + [(32000, 4096)])
def test_linear_rows_do_not_depend_on_m(n, k):
    """M = 1..16 run 16-row tiles, 17..64 64-row tiles, more 128-row tiles (64 for qkv's 256-wide K
    steps); the o and down projections split K four ways. Row r is the same bits in every one."""
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    x = torch.randn(512, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(torch.bfloat16)
    gemm = BatchInvariantGemm()
    assert_rows_invariant(lambda rows: gemm(rows, w), x, M_VALUES + [65, 200, 256, 512])
    assert_rows_invariant(lambda rows: gemm(rows, w, float32_out=True), x[:200], [2, 17, 64, 200])
    if n % 2 == 0:
        assert_rows_invariant(lambda rows: gemm(rows, w, gated=True), x[:200], [2, 17, 64, 200])


@pytest.mark.parametrize("n,k", LLAMA8B_SHAPES)
def test_row_tile_size_does_not_change_a_row_on_tensor_cores(n, k):
    """The claim the linear rests on, on this device: with the K step and the dtype fixed, a 16-, 64-
    or 128-row tile gives a row the same bits. If this fails, BatchInvariantGemm(fixed_block_m=16)
    (layers/batch_invariant.py builds the gemm) keeps the mode exact at some cost at large M."""
    from foretell.ops.gemm.triton_batch_invariant import linear_batch_invariant_triton

    gen = torch.Generator(device=DEVICE).manual_seed(n - k)
    x = torch.randn(256, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(torch.bfloat16)
    outs = {bm: linear_batch_invariant_triton(x, w, fixed_block_m=bm) for bm in (16, 32, 64, 128)}
    for bm in (32, 64, 128):
        assert torch.equal(outs[bm], outs[16]), f"row tile {bm} differs from 16 at N={n}, K={k}"


def test_long_prefill_launches_keep_rows():
    """Split-K prefills above MAX_SPLIT_ROWS rows run in several launches: the same bits per row.
    (Marked xfail at 0ca8a8c with 'fails': the test itself called gemm(row) without the weight, a
    TypeError that the non-strict xfail took for the failure; the interpreter test
    test_long_prefills_run_in_launches_of_bounded_rows holds the launch arithmetic.)"""
    x = torch.randn(1300, 4096, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(4096, 4096, device=DEVICE) / 64).to(torch.bfloat16)
    gemm = BatchInvariantGemm()
    whole = gemm(x, w)
    for lo in (0, 3, 1023, 1024, 1025, 1299):
        assert torch.equal(gemm(x[lo : lo + 1].clone(), w), whole[lo : lo + 1]), f"row {lo}"
    for m in (1023, 1024, 1025, 2048 + 5):  # launches of 1024 rows and a remainder
        rows = torch.randn(m, 4096, device=DEVICE).to(torch.bfloat16)
        rows[:1300] = x[:m]
        assert torch.equal(gemm(rows, w)[: min(m, 1300)], whole[:m]), f"M={m}"
    want = torch.nn.functional.linear(x.double(), w.double())
    assert torch.allclose(gemm(x, w, float32_out=True).double(), want, atol=1e-3, rtol=1e-3)


def test_moe_rows_run_the_kernel_and_do_not_depend_on_m():
    """The mode's MoE experts and router call linear_rows_torch, which on CUDA runs the kernel (one
    launch, not a loop of one-row products): rows alone == among others, float32 router included."""
    from foretell.ops.gemm.batch_invariant import linear_rows_torch

    for dtype, n, k in ((torch.bfloat16, 192, 96), (torch.bfloat16, 2 * 1408, 2048), (torch.float32, 256, 7168)):
        x = torch.randn(64, k, device=DEVICE).to(dtype)
        w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
        assert_rows_invariant(lambda rows: linear_rows_torch(rows, w), x)
        want = torch.nn.functional.linear(x.double(), w.double())
        assert torch.allclose(linear_rows_torch(x, w).double(), want, atol=2e-2, rtol=2e-2)


def _moe_world(num_tokens=64, seed=0, dtype=torch.bfloat16, hidden=2048, inter=1408, routed=64, shared=2, top_k=6):
    """DeepSeek-V2-Lite's expert shapes: each token's top_k distinct routed experts, then the shared
    experts as slots of weight 1 (append_shared_experts' layout)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    experts = routed + shared
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=DEVICE, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=DEVICE, generator=gen) / inter**0.5).to(dtype)
    routed_ids = torch.rand(num_tokens, routed, device=DEVICE, generator=gen).argsort(dim=1)[:, :top_k]
    ids = torch.cat([routed_ids, torch.arange(routed, experts, device=DEVICE).expand(num_tokens, shared)], dim=1)
    weights = torch.cat([torch.rand(num_tokens, top_k, device=DEVICE, generator=gen),
                         torch.ones(num_tokens, shared, device=DEVICE)], dim=1)  # float32
    extra = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).to(dtype)
    return x, gate_up, down, weights, ids, extra


def test_moe_experts_rows_do_not_depend_on_m():
    """The mode's MoE (ops/moe/batch_invariant_triton.py through batch_invariant.py's dispatch): a
    token's output alone equals its output among M = 2..64 tokens and in a shuffled batch, bit for
    bit, at V2-Lite expert shapes in bf16 (both align steps); within rounding of float64."""
    from foretell.ops.moe.batch_invariant import experts_forward_batch_invariant
    from foretell.ops.moe.batch_invariant_triton import experts_forward_batch_invariant_triton
    from foretell.ops.moe.reference import experts_forward_torch

    x, gate_up, down, weights, ids, extra = _moe_world()

    def run(rows, align_kernel=None):
        return experts_forward_batch_invariant_triton(x[rows].clone(), gate_up, down, weights[rows].clone(),
                                                      ids[rows].clone(), extra[rows].clone(), align_kernel=align_kernel)

    alone = [run([r]) for r in range(64)]
    for m in M_VALUES:
        for align_kernel in (True, False):
            out = run(list(range(m)), align_kernel)
            for r in range(m):
                assert torch.equal(out[r : r + 1], alone[r]), f"token {r} differs at M={m} (align kernel {align_kernel})"
    order = torch.randperm(64).tolist()
    out = run(order)
    for i, r in enumerate(order):
        assert torch.equal(out[i : i + 1], alone[r]), f"token {r} differs in a shuffled batch"
    dispatched = experts_forward_batch_invariant(x, gate_up, down, weights, ids, extra)
    assert torch.equal(dispatched, torch.cat(alone)), "the mode's dispatch runs the kernel on CUDA"
    want = experts_forward_torch(x.double(), gate_up.double(), down.double(), weights, ids) + extra.double()
    assert torch.allclose(dispatched.double(), want, atol=3e-2, rtol=3e-2)


def test_moe_router_rows_do_not_depend_on_m():
    """The mode's router on CUDA (float32 linear kernel, float64 selection in torch): a token's
    weights and ids alone equal those among M = 2..64 (V2-Lite: softmax, greedy; V3: sigmoid,
    grouped noaux_tc with a correction bias)."""
    from foretell.ops.moe.batch_invariant import route_batch_invariant
    from foretell.ops.moe.reference import RouterConfig

    configs = [
        (RouterConfig(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1,
                      topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, num_shared_experts=2), None),
        (RouterConfig(num_experts=256, top_k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
                      topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, num_shared_experts=1),
         torch.randn(256, device=DEVICE) * 0.01),
    ]
    for config, bias in configs:
        hidden = 2048
        x = torch.randn(64, hidden, device=DEVICE).to(torch.bfloat16)
        w = torch.randn(config.num_experts, hidden, device=DEVICE) / hidden**0.5  # float32, as checkpoints hold it
        assert_rows_invariant(lambda rows: torch.cat([t.double() for t in route_batch_invariant(rows, w, config, bias)],
                                                     dim=1), x)


def test_moe_replays_in_a_graph_bit_for_bit():
    """No host sync: the mode's experts are captured in a CUDA graph and replay the eager bits."""
    from foretell.ops.moe.batch_invariant_triton import experts_forward_batch_invariant_triton

    x, gate_up, down, weights, ids, extra = _moe_world(num_tokens=4, seed=1)
    eager = experts_forward_batch_invariant_triton(x, gate_up, down, weights, ids, extra)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts_forward_batch_invariant_triton(x, gate_up, down, weights, ids, extra)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


V2_LITE_MLA = dict(heads=16, nope=128, rope=64, rank=512, v=128)


def test_mla_rows_do_not_depend_on_their_step():
    """The mode's MLA (ops/mla/batch_invariant_triton.py) at V2-Lite's dims in bf16: a row decoded
    alone, verified, prefilled in chunks and batched in any order gives the same bits, through
    attend and through attend_projections (latent write, absorbed query, attention, W_UV)."""
    from ops.test_batch_invariant_attention import ALONE, FORMATIONS, assert_mla_formations_agree, make_mla_world
    from foretell.ops.mla.batch_invariant_triton import BatchInvariantTritonMLABackend
    from foretell.ops.mla.dispatch import build_mla_backend

    backend = build_mla_backend("triton_batch_invariant")
    assert isinstance(backend, BatchInvariantTritonMLABackend)
    assert_mla_formations_agree(backend, make_mla_world(torch.bfloat16, seed=5, dims=V2_LITE_MLA), FORMATIONS + ALONE)
    world = make_mla_world(torch.bfloat16, seed=6, dims=V2_LITE_MLA)
    assert_mla_formations_agree(backend, world, FORMATIONS + ALONE, projections=True)  # the first writes every row
    # 128 heads (V3 / Kimi): 32-row tiles of one token's heads
    v3 = dict(V2_LITE_MLA, heads=128)
    assert_mla_formations_agree(backend, make_mla_world(torch.bfloat16, seed=7, dims=v3), FORMATIONS[:3] + ALONE[:4])


def test_linear_replays_in_a_graph_bit_for_bit():
    gemm = BatchInvariantGemm()
    for n, k in ((6144, 4096), (4096, 14336)):  # whole K, and split four ways (counters in the graph)
        x = torch.randn(4, k, device=DEVICE).to(torch.bfloat16)
        w = (torch.randn(n, k, device=DEVICE) / 64).to(torch.bfloat16)
        eager = gemm(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemm(x, w)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager)


def test_row_local_kernels_do_not_depend_on_m():
    x = torch.randn(64, 4096, device=DEVICE).to(torch.bfloat16)
    weight = torch.randn(4096, device=DEVICE).to(torch.bfloat16)
    assert_rows_invariant(lambda rows: pointwise.rms_norm_triton(rows, weight, 1e-6)[0], x)
    assert_rows_invariant(lambda rows: pointwise.rms_norm_triton(rows, weight, 1e-6, residual=rows * 2)[0], x)
    # Narrow rows share a program: the default family's k_norm (2 KV heads x 64, 2 rows a token at
    # batch 1) and hidden norm (256); the tile used to shrink with the row count (issue 23).
    for shape in ((64, 2, 64), (64, 4, 64), (64, 8, 128), (64, 256)):
        rows_in = torch.randn(*shape, device=DEVICE).to(torch.bfloat16)
        w = weight[: shape[-1]].contiguous()
        assert_rows_invariant(lambda rows: pointwise.rms_norm_triton(rows, w, 1e-6)[0], rows_in)
    assert_rows_invariant(pointwise.silu_and_mul_triton, x)
    logits = torch.randn(64, 128256, device=DEVICE)
    logits[:, 7] = logits[:, 90000] = 1e4  # a tie: the lowest id wins, whatever the batch
    assert_rows_invariant(argmax_triton, logits)
    assert (argmax_triton(logits) == 7).all()
    angles = torch.rand(4096, 64, device=DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(64, 32, 128, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(64, 8, 128, device=DEVICE).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (64,), device=DEVICE)

    alone = [pointwise.rope_triton(positions[r : r + 1], q[r : r + 1].clone(), k[r : r + 1].clone(), cos, sin)
             for r in range(64)]
    for m in (2, 17, 64):
        q_m, k_m = pointwise.rope_triton(positions[:m], q[:m].clone(), k[:m].clone(), cos, sin)
        for r in range(m):
            assert torch.equal(q_m[r : r + 1], alone[r][0]) and torch.equal(k_m[r : r + 1], alone[r][1])


def test_attention_rows_do_not_depend_on_their_step():
    from ops.test_batch_invariant_attention import ALONE, FORMATIONS, assert_formations_agree, make_world
    from foretell.ops.attention.triton_batch_invariant import BatchInvariantTritonAttention

    world = make_world(torch.bfloat16, seed=4)
    assert_formations_agree(BatchInvariantTritonAttention(), world, FORMATIONS + ALONE)


@pytest.mark.parametrize("with_norms", [False, True], ids=["llama", "qwen3_norms"])
def test_rope_attend_rows_do_not_depend_on_their_step(with_norms):
    """rope_attend (RoPE + KV write in one launch, then the attention: what Attention.forward_rotary
    runs in the mode) gives a row the same bits decoded alone, verified, chunked and batched."""
    from ops.test_batch_invariant_attention import ALONE, FORMATIONS, HEAD_DIM, make_raw_world, run_rope
    from foretell.layers.norm import RMSNorm
    from foretell.layers.rotary import RotaryEmbedding
    from foretell.ops.attention.triton_batch_invariant import BatchInvariantTritonAttention

    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None, "neox", device=DEVICE)
    qk_norm = None
    if with_norms:
        qk_norm = tuple(RMSNorm(HEAD_DIM, eps=1e-6, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        for norm in qk_norm:
            norm.weight.data.copy_(1.0 + 0.1 * torch.randn(HEAD_DIM, device=DEVICE))
    backend, world, seen = BatchInvariantTritonAttention(), make_raw_world(torch.bfloat16, seed=7), {}
    for segments in FORMATIONS + ALONE:  # the first formation writes every row of every sequence
        for row, out in run_rope(backend, world, segments, rotary, qk_norm).items():
            assert torch.equal(seen.setdefault(row, out), out), f"row {row} differs in {segments}"


def test_default_family_exact_on_the_gpu():
    from foretell import LLM, SamplingParams
    from foretell.defaults import default_speculative_config, default_target, member_path

    if not os.path.isdir(member_path("target")):
        pytest.skip("no default models")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 3000 + 5 for j in range(20 + 13 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    engine = dict(device="cuda", dtype="bfloat16", batch_invariant=True, kv_cache_memory_bytes=1 << 30,
                  log_stats_interval_s=0)

    def run(llm, batch):
        outs = llm.generate(batch, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]

    with LLM(default_target("qwen3"), **engine) as llm:
        batched = run(llm, prompts)
        assert [run(llm, [p])[0] for p in prompts] == batched
    for method in ("eagle3", "ngram"):
        with LLM(default_target("qwen3"), speculative_config=default_speculative_config("qwen3", method, 3),
                 **engine) as llm:
            assert [t for t, _ in run(llm, prompts)] == [t for t, _ in batched]
