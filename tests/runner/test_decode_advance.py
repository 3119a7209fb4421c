"""Greedy decode steps queued ahead on a graph advance the graph's inputs on the device
(CudaGraphRunner.advance_decode) instead of packing and uploading them: run on the CPU through the
uncaptured graph runner (the same buffers, the real forward over them), the tokens equal the eager
engine's across block boundaries, at max_model_len, with sequences finishing mid-batch (max_tokens
and stop tokens), with a sampled request in the batch, and when something else overwrote the
buffers between two steps; advanced steps upload nothing."""

from __future__ import annotations

import pytest
import torch

from fixtures.padded_step import uncaptured_decode_graphs
from foretell import LLM, SamplingParams
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.decode_ahead import DecodeAhead

PROMPTS = [
    "The cat reads the book. The dog",
    "def add(x):\n    return",
    "Question: what is 3 plus 7? Answer:",
    "a",
]


class GraphCounts:
    """How the graph runner's decode steps got their inputs: uploads (a packed step: runner/graph_inputs.py)
    and device advances; and whether an advance ever uploaded."""

    def __init__(self, graphs: CudaGraphRunner):
        self.uploads = self.advances = self.uploads_in_advances = 0
        upload, advance = graphs.side.upload, graphs.advance_decode

        def counted_upload(*args, **kwargs):
            self.uploads += 1
            return upload(*args, **kwargs)

        def counted_advance(*args, **kwargs):
            self.advances += 1
            before = self.uploads
            out = advance(*args, **kwargs)
            self.uploads_in_advances += self.uploads - before
            return out

        graphs.side.upload, graphs.advance_decode = counted_upload, counted_advance


def eager_tokens(folder, params, prompts=PROMPTS, **options) -> list:
    llm = LLM(folder, dtype="float32", async_scheduling="off", num_kv_blocks=128, **options)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def graphed_llm(folder, **options) -> tuple[LLM, CudaGraphRunner, GraphCounts]:
    """An engine deciding ahead whose plain decode steps run on an uncaptured graph runner over the
    real model (reads_host_lengths: the torch attention reads the buffers' lengths; exact buckets)."""
    llm = LLM(folder, dtype="float32", async_scheduling="on", num_kv_blocks=128, **options)
    runner = llm.engine.runner
    assert any(isinstance(kind, DecodeAhead) for kind in runner.pipeline.kinds) and runner.pipeline.queue_ahead
    graphs = uncaptured_decode_graphs(llm)
    return llm, graphs, GraphCounts(graphs)


def outputs(llm: LLM, params, prompts=PROMPTS) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids
        assert g.finish_reason == e.finish_reason


def assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("block_size", [4, 16])
def test_advanced_steps_equal_eager_across_block_boundaries(qwen3_checkpoint, block_size):
    """Sequences of different lengths (the batch shrinks as they finish at max_tokens) cross block
    boundaries every 4 or 16 positions; the step after a crossing uploads the new table."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 17, 9, 23)]
    expected = eager_tokens(qwen3_checkpoint, params, block_size=block_size)
    llm, _, counts = graphed_llm(qwen3_checkpoint, block_size=block_size)
    assert_same(outputs(llm, params), expected)
    assert counts.advances > 0 and counts.uploads > 0 and counts.uploads_in_advances == 0
    pipeline = llm.engine.runner.pipeline
    assert pipeline.num_used > 0
    stats = llm.get_stats()  # the pipeline's counts, public
    assert stats["steps_queued_ahead"] == pipeline.num_launched >= stats["steps_queued_ahead_used"] == pipeline.num_used
    assert_all_free(llm)


def test_a_lone_sequence_advances_all_but_its_block_crossings(qwen3_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = eager_tokens(qwen3_checkpoint, params, prompts=PROMPTS[:1], block_size=8)
    llm, _, counts = graphed_llm(qwen3_checkpoint, block_size=8)
    assert_same(outputs(llm, params, PROMPTS[:1]), expected)
    # 39 decode steps over positions crossing 5 block boundaries: a step uploads its inputs after
    # each crossing (and the first); every other one advances.
    assert counts.advances >= 39 - 2 * 6 and counts.uploads <= 2 * 6
    assert counts.advances + counts.uploads == 39
    assert_all_free(llm)


def test_advanced_steps_stop_at_max_model_len(qwen3_checkpoint):
    """Generation runs into max_model_len (finish "length" there): no step is advanced past it."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    expected = eager_tokens(qwen3_checkpoint, params, max_model_len=40, block_size=4)
    assert all(e.finish_reason == "length" for e in expected)
    llm, _, counts = graphed_llm(qwen3_checkpoint, max_model_len=40, block_size=4)
    assert_same(outputs(llm, params), expected)
    assert counts.advances > 0
    assert_all_free(llm)


def test_sequences_finishing_mid_batch_on_stop_tokens(qwen3_checkpoint):
    """A stop token ends a sequence at a step the host learns of only after the next step was
    advanced for the whole batch: that step is dropped, and the survivors continue from the host."""
    probe = eager_tokens(qwen3_checkpoint, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[probe[0].token_ids[5]]),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[probe[2].token_ids[8]]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    expected = eager_tokens(qwen3_checkpoint, params, block_size=4)
    assert expected[0].finish_reason == "stop" and expected[2].finish_reason == "stop"
    llm, _, counts = graphed_llm(qwen3_checkpoint, block_size=4)
    assert_same(outputs(llm, params), expected)
    assert counts.advances > 0
    assert_all_free(llm)


def test_a_sampled_request_keeps_the_batch_off_the_advance(qwen3_checkpoint):
    """Seeded sampling in the batch: the step samples on the host path (no graph argmax), so nothing
    advances while it runs; the tokens are those of the eager engine."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    expected = eager_tokens(qwen3_checkpoint, params, prompts=PROMPTS[:2], block_size=4)
    llm, _, counts = graphed_llm(qwen3_checkpoint, block_size=4)
    assert_same(outputs(llm, params, PROMPTS[:2]), expected)
    # Only the greedy sequence's last steps, alone once the sampled one finished, may advance.
    assert counts.advances <= 4
    assert_all_free(llm)


def test_buffers_overwritten_between_steps_take_the_host_path(qwen3_checkpoint):
    """Anything else that writes the graph buffers (here prepare_replay, as a benchmark would)
    between two steps makes the next step upload its inputs instead of advancing stale ones."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = eager_tokens(qwen3_checkpoint, params, prompts=PROMPTS[:1], block_size=16)
    llm, graphs, counts = graphed_llm(qwen3_checkpoint, block_size=16)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], params)
    got, step = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got = out.outputs[0]
        step += 1
        if step in (6, 11):
            before = counts.uploads
            graphs.prepare_replay((1, 1), 8)  # positions, lengths and the table's first blocks: garbage
    assert got.token_ids == expected[0].token_ids
    assert counts.advances > 0 and counts.uploads >= 3 and before >= 1
    assert_all_free(llm)


class ArgmaxIsPositionModel(torch.nn.Module):
    """Stands in for a target: each row's logits pick (position + 5) % 16 as its token."""

    def forward(self, input_ids, positions, metadata):
        self.positions = positions.clone()
        return torch.zeros(input_ids.shape[0], 4), []

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot((self.positions + 5) % 16, 16).float()


def test_advance_decode_moves_the_buffers_one_position_on():
    """The runner's advance at the buffer level, a padded bucket (3 sequences in bucket 4): input
    ids become the last replay's argmax, positions and lengths move one on, slots follow the table
    rows; query starts, the padding sequence and the table are left alone, and the version moves."""
    from foretell.runner.input_batch import InputBatch

    graphs = CudaGraphRunner(ArgmaxIsPositionModel(), max_num_seqs=4, query_lens=(1,), max_blocks_per_seq=4,
                             block_size=4, max_model_len=16, device=torch.device("cpu"), capture_graphs=False)
    blocks = [[7, 2], [5], [9, 3, 1, 6]]
    positions = [4, 2, 11]  # 4 -> 5 in block 2; 2 -> 3 in block 5; 11 -> 12 in block 6
    batch = InputBatch(token_ids=[10, 11, 12], position_list=positions,
                       slot_list=[b[p // 4] * 4 + p % 4 for b, p in zip(blocks, positions)], block_ids=blocks,
                       query_start=[0, 1, 2, 3], seq_lens=[p + 1 for p in positions], block_size=4,
                       device=torch.device("cpu"), logits_row_ids=[0, 1, 2], sampling_seq_index=[0, 1, 2],
                       row_positions=[p + 1 for p in positions])
    key = graphs.bucket_for(batch)
    assert key == (4, 1)
    first = graphs.run(batch, key)
    assert first.greedy[:3].tolist() == [9, 7, 0]  # (position + 5) % 16
    version, table = graphs.inputs_version, graphs.block_table.clone()
    second = graphs.advance_decode(key, 3, first.greedy[:3])
    assert graphs.input_ids[:3].tolist() == [9, 7, 0]
    assert graphs.positions[:4].tolist() == [5, 3, 12, 0]
    assert graphs.slot_mapping[:4].tolist() == [2 * 4 + 1, 5 * 4 + 3, 6 * 4 + 0, -1]
    assert graphs.seq_lens[:4].tolist() == [6, 4, 13, 1]
    assert graphs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(graphs.block_table, table)
    assert graphs.inputs_version == version + 1
    assert second.greedy[:3].tolist() == [10, 8, 1]
