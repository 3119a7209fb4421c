"""On a CUDA GPU: the draft-tree step on CUDA graphs (runner/tree_graphs.py: the verify forward per
(bucket, num_draft_tokens); spec_decode/tree/draft_graphs.py: the drafter's expansion per bucket,
and after a graphed verify its catch-up padded to depth + 1 rows with it)
is captured and replayed, and its greedy output equals plain greedy decoding and the eager tree
step's (enforce_eager), in float32 on the Qwen3 and Llama-3.1 fixtures, at batches 1 and 3 (padded
to the bucket of 4) and with trees cut near max_model_len (eager verify for those steps);
seeded sampled trees equal the eager tree step's tokens; a draft LM's trees likewise. A bf16
16-node tree at batch 1 binds the few-row MMA for its 16 verify rows. The K/V compaction's one launch over
every layer (ops/step/kv_moves.py) at Llama-8B's cache shape in bf16 and FP8 against the per-layer
gather/scatter, launched directly and replayed from a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

from fixtures.eagle3 import write_eagle3_head
from foretell import LLM, SamplingParams
from foretell.ops.step.kv_moves import KVMoveTargets, move_kv_slots
from foretell.spec_decode.tree.compact import apply_slot_moves

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "def add(x):\n    return x + 1\ndef",
           "Question: what is 3 plus 7? Answer:"]
TREE = {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 10}


@pytest.fixture(scope="module")
def llama31_head(checkpoint_root, llama31_checkpoint) -> str:
    folder = os.path.join(checkpoint_root, "eagle3_llama31_tree_gpu")
    if not os.path.isdir(folder):
        write_eagle3_head(folder, llama31_checkpoint, "specforge", seed=5)
    return folder


def engine(target: str, head: str | None, **kwargs) -> LLM:
    spec = None if head is None else {"method": "eagle3", "model": head, **TREE}
    return LLM(target, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4, speculative_config=spec,
               **kwargs)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_captured_tree_step_equals_plain_and_eager(qwen3_checkpoint, eagle3_head, llama31_checkpoint, llama31_head,
                                                   family):
    target, head = (qwen3_checkpoint, eagle3_head) if family == "qwen3" else (llama31_checkpoint, llama31_head)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = ids(engine(target, None).generate(PROMPTS, greedy, use_tqdm=False))
    eager = engine(target, head, enforce_eager=True)
    assert eager.engine.runner.tree_step.verify_graphs is None
    llm = engine(target, head)
    step = llm.engine.runner.tree_step
    assert step.verify_graphs is not None and step.verify_graphs.captures and step.verify_graphs.graphs
    assert step.drafter.graphs is not None and step.drafter.graphs.graphs  # captured per bucket
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1, batch 3 padded to the bucket of 4
        got = ids(llm.generate(prompts, greedy, use_tqdm=False))
        assert got == want[: len(prompts)]
        assert got == ids(eager.generate(prompts, greedy, use_tqdm=False))
    assert step.num_graphed_verifies > 0 and step.drafter.graphs.num_runs > 0
    # the catch-up after a graphed verify: padded to depth + 1 rows, replayed with the expansion
    assert step.drafter.graphs.after_verify_graphs and step.drafter.graphs.num_caught_up > 0
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2, 3)]
    assert ids(llm.generate(PROMPTS, sampled, use_tqdm=False)) == ids(eager.generate(PROMPTS, sampled, use_tqdm=False))


def test_tree_verify_takes_the_few_row_mma_for_its_16_rows(llama31_checkpoint, llama31_head):
    """bf16, batch 1, a 16-node tree (issue 28's shape): the few-row GEMMs are bound for the verify's
    16 rows (runner/tree_graphs.tree_step_gemm_rows), every 16-row key on the tensor-core MMA (mode
    "on"), before the capture; the captured step runs (verify and catch-up on graphs)."""
    from foretell.ops.gemm.triton_mma import MmaConfig

    spec = {"method": "eagle3", "model": llama31_head, "num_speculative_tokens": 6, "topk": 4, "num_draft_tokens": 16}
    llm = LLM(llama31_checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=1,
              speculative_config=spec)
    gemm = llm.engine.runner.small_m_gemm
    assert gemm is not None and gemm.max_m == 16
    sixteen = [key for key in gemm.choices if key.m_bucket == 16]
    assert sixteen and all(isinstance(gemm.choices[key], MmaConfig) for key in sixteen), gemm.summary()
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 24
    step = llm.engine.runner.tree_step
    assert step.num_graphed_verifies > 0 and step.drafter.graphs.num_caught_up > 0


def test_cut_trees_near_max_model_len_on_the_gpu(qwen3_checkpoint, eagle3_head):
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = ids(engine(qwen3_checkpoint, None, max_model_len=48).generate(PROMPTS, params, use_tqdm=False))
    llm = engine(qwen3_checkpoint, eagle3_head, max_model_len=48)
    assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    assert llm.engine.runner.tree_step.num_graphed_verifies > 0


@pytest.mark.parametrize("drafter", ["other_lm", "itself"])
def test_draft_model_trees_on_the_gpu_equal_plain(qwen3_checkpoint, qwen3_tied_checkpoint, drafter):
    """A draft LM's trees (its catch-up and depth forwards eager, the target's verify captured):
    greedy fp32 output equals plain greedy decoding at batches 1 and 3, and the eager tree step's
    sampled tokens with seeds."""
    draft = qwen3_checkpoint if drafter == "itself" else qwen3_tied_checkpoint
    spec = {"method": "draft_model", "model": draft, **TREE}
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = ids(engine(qwen3_checkpoint, None).generate(PROMPTS, greedy, use_tqdm=False))

    def tree_engine(**kwargs) -> LLM:
        return LLM(qwen3_checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4,
                   speculative_config=spec, **kwargs)

    llm = tree_engine()
    step = llm.engine.runner.tree_step
    assert step.verify_graphs is not None and step.verify_graphs.captures
    for prompts in (PROMPTS[:1], PROMPTS):
        assert ids(llm.generate(prompts, greedy, use_tqdm=False)) == want[: len(prompts)]
    assert step.num_graphed_verifies > 0 and llm.get_stats()["num_drafts"] > 0
    if drafter == "itself":
        assert llm.get_stats()["acceptance_per_position"][0] == 1.0
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2, 3)]
    eager = tree_engine(enforce_eager=True)
    assert ids(llm.generate(PROMPTS, sampled, use_tqdm=False)) == ids(eager.generate(PROMPTS, sampled, use_tqdm=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_one_launch_compaction_at_llama8b_shape(dtype):
    """32 layers of [2, 64 blocks, 16, 8 heads, 128]: the Triton launch (direct and in a CUDA graph)
    leaves every layer as the per-layer gather/scatter does, for 3 sequences' depth-6 paths."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(2, 64, 16, 8, 128, device="cuda", generator=gen).to(dtype) for _ in range(32)]
    paths = [[0, 1, 4, 7, 9, 12, 15], [0, 2, 5, 8, -1, -1, -1], [0, 1, 2, 3, 4, 5, 6]]
    src, dst = [], []
    for seq, path in enumerate(paths):
        prefix = 100 + 300 * seq  # slots of a contiguous block range per sequence
        for depth, node in enumerate(path):
            moves = node >= 0 and node != depth
            src.append(prefix + (node if moves else 0))
            dst.append(prefix + (depth if moves else 0))
    src = torch.tensor(src, dtype=torch.int64, device="cuda")
    dst = torch.tensor(dst, dtype=torch.int64, device="cuda")
    expected = [c.clone() for c in caches]
    for c in expected:
        apply_slot_moves(c, src, dst)
    direct = [c.clone() for c in caches]
    move_kv_slots(KVMoveTargets(direct), src, dst, 7)
    graphed = [c.clone() for c in caches]
    targets = KVMoveTargets(graphed)
    scratch = [c.clone() for c in caches]
    move_kv_slots(KVMoveTargets(scratch), src, dst, 7)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_kv_slots(targets, src, dst, 7)
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(32):
        assert torch.equal(direct[layer].view(torch.uint8), expected[layer].view(torch.uint8)), layer
        assert torch.equal(graphed[layer].view(torch.uint8), expected[layer].view(torch.uint8)), layer
