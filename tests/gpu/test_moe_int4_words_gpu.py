"""The word_tiles variant of the int4 MoE GEMV (ops/moe/triton_int4_word_tiles.py) on a CUDA device:
bf16 at Kimi-K2.5's shapes and a small odd one against the torch twin and against the nibble_lanes
kernels at the same tiles, captured in a CUDA graph, and timed against them at Kimi-K2.5's shapes
(one token, 8 of 384 experts: ~176 MB of int4 words a MoE layer), printed as % of the H200's 4.8
TB/s. The timing asserts nothing (tests do not judge speed); read it with -s:

    python -m pytest -q -s tests/gpu/test_moe_int4_words_gpu.py

Every candidate_configs() entry is timed, each over several layers' worth of distinct experts so
that no weight is read from L2, replayed in a CUDA graph (launch gaps as in decoding).
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.ops.moe import int4_reference as ref
from foretell.ops.moe.triton_int4_gemv import candidate_configs, fused_int4_experts_gemv_triton

DEVICE = torch.device("cuda")
KIMI_K25 = {"experts": 384, "top_k": 8, "hidden": 7168, "inter": 2048}
SMALL = {"experts": 12, "top_k": 3, "hidden": 328, "inter": 200}  # a partial group and partial tiles
TOLERANCE = 3e-2  # bf16 roundings at the same points, float32 sums in another order
HBM_BYTES_PER_S = 4.8e12
WORDS = {"gate_up": {"variant": "word_tiles", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4},
         "down": {"variant": "word_tiles", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 2}}


def int4_experts(experts, hidden, inter, gen, dtype=torch.bfloat16):
    def linear(n, k):
        packed = torch.randint(-2**31, 2**31 - 1, (experts, n, ref.words(k)), generator=gen, device=DEVICE,
                               dtype=torch.int32)
        scale = (torch.rand(experts, n, ref.groups(k), generator=gen, device=DEVICE) + 0.5) / (4 * k**0.5)
        return packed, scale.to(dtype)

    return (*linear(2 * inter, hidden), *linear(hidden, inter))


def routed_tokens(num_tokens, experts, top_k, hidden, gen, dtype=torch.bfloat16):
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    ids = torch.rand(num_tokens, experts, generator=gen, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen, device=DEVICE) * 2.8  # Kimi's routed scaling
    shared = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    return x, weights, ids, shared


@pytest.mark.parametrize("shape", [KIMI_K25, SMALL], ids=["kimi-k2.5", "small"])
@pytest.mark.parametrize("num_tokens", [1, 2, 8])
def test_word_tiles_match_the_twin(shape, num_tokens):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(num_tokens, shape["experts"], shape["top_k"], shape["hidden"], gen)
    ids[:, -1] = ids[:, 0]  # a token routed to one expert twice
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(x.dtype)
        for down_split in (1, 2, shape["top_k"]):
            config = {"gate_up": WORDS["gate_up"], "down": {**WORDS["down"], "SPLIT": down_split}}
            got = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype,
                                                 config=config)
            torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
            lanes = {name: {**cfg, "variant": "nibble_lanes"} for name, cfg in config.items()}
            same_tiles = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype,
                                                        config=lanes)
            # the same values / 16 in the same order; the compiler may contract the two differently
            torch.testing.assert_close(got, same_tiles, rtol=2e-2, atol=2e-2)


def test_word_tiles_captured_in_a_cuda_graph():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    config = {"gate_up": WORDS["gate_up"], "down": {**WORDS["down"], "SPLIT": 8}}
    with torch.inference_mode():
        fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, config=config)  # compile first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, config=config)
        for _ in range(3):
            new = routed_tokens(1, shape["experts"], shape["top_k"], shape["hidden"], gen)
            for buffer, value in zip((x, weights, ids, shared), new):
                buffer.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared,
                                                                   config=config))


def _time_layers_in_a_graph(layers, x, weights, ids, shared, config, replays=20) -> float:
    """Seconds for one MoE layer: every layer's experts (distinct weights) in one captured graph."""
    def forward():
        for layer in layers:
            fused_int4_experts_gemv_triton(x, *layer, weights, ids, shared, out_dtype=x.dtype, config=config)

    forward()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays / len(layers)


def test_time_word_tiles_against_nibble_lanes_at_kimi_shapes():
    """Prints us a MoE layer and % of 4.8 TB/s for every candidate config at one token (the bytes:
    the 8 routed experts' packed words and scales)."""
    shape = KIMI_K25
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x, weights, ids, shared = routed_tokens(1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    # 8 distinct experts a layer: one layer holds only the routed ones (the rest is never read)
    ids = torch.arange(shape["top_k"], device=DEVICE)[None, :]
    layer_count = 12  # 12 x 187 MB: past the H200's 50 MB L2 many times over
    layers = [int4_experts(shape["top_k"], shape["hidden"], shape["inter"], gen) for _ in range(layer_count)]
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0])
    rows = []
    with torch.inference_mode():
        for config in candidate_configs(1, shape["top_k"]):
            try:
                seconds = _time_layers_in_a_graph(layers, x, weights, ids, shared, config)
            except Exception as e:  # a tile that does not compile or fit: reported, the rest still run
                rows.append((config, None, f"{type(e).__name__}: {e}"[:200]))
                continue
            rows.append((config, seconds, ""))
    print(f"\nint4 MoE GEMV, Kimi-K2.5 shapes, 1 token, {layer_bytes / 1e6:.1f} MB a layer, {layer_count} layers "
          f"in one graph")
    for config, seconds, error in rows:
        label = " | ".join(f"{name} {cfg['variant']} {cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}"
                           + (f" s{cfg['SPLIT']}" if "SPLIT" in cfg else "") for name, cfg in config.items())
        if seconds is None:
            print(f"  {label:90s} failed: {error}")
        else:
            print(f"  {label:90s} {seconds * 1e6:8.1f} us {100 * layer_bytes / seconds / HBM_BYTES_PER_S:6.1f}% "
                  f"of 4.8 TB/s")
    assert any(seconds is not None for _, seconds, _ in rows)
