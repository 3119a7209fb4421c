"""The chunked Triton argmax on a CUDA device against torch.argmax: real vocabulary sizes (Llama-3,
DeepSeek-V2, Qwen3, an EAGLE3 draft vocabulary) in float32 and bf16, 1 to 64 rows, captured in a
CUDA graph and replayed on new logits; `argmax_rows` takes the kernel on CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures.seeds import reports_seed
from foretell.ops.sampling.triton_argmax import argmax_triton
from foretell.layers.sampler import argmax_rows

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [128256, 102400, 151936, 32000])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_argmax_matches_torch(rows, vocab, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, device=DEVICE).to(dtype)
    with reports_seed(seed):
        assert torch.equal(argmax_triton(logits), logits.argmax(dim=-1))
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_graph_replay_follows_new_logits():
    logits = torch.randn(4, 128256, device=DEVICE)
    argmax_triton(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_triton(logits)
    for _ in range(3):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1))
