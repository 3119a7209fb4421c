"""CudaGraphRunner's persistent inputs, checked on the CPU (where nothing is captured and a replay
recomputes the same forward on the same buffers): prepare_replay leaves a bucket's buffers
describing exactly its own query length, whatever an earlier step of another length left there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foretell.runner.cuda_graph import CudaGraphRunner


class RecordingModel(nn.Module):
    """Stands in for a target: records the metadata of each forward, returns zeros."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, positions, metadata):
        self.seen.append(metadata)
        rows = input_ids.shape[0]
        return torch.zeros(rows, 8), [torch.zeros(rows, 8)]

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], 16)


def make_runner(model):
    return CudaGraphRunner(model, max_num_seqs=4, query_lens=(1, 4), max_blocks_per_seq=8, block_size=4,
                           max_model_len=32, device=torch.device("cpu"))


def test_prepare_replay_describes_the_graphs_own_query_length():
    model = RecordingModel()
    runner = make_runner(model)
    runner.prepare_replay((4, 4), 12)  # a verify bucket leaves 4 rows per sequence behind
    runner.prepare_replay((2, 1), 10)
    runner._forward(2, 1)
    meta = model.seen[-1]
    assert meta.query_start_loc.tolist() == [0, 1, 2]  # one row per sequence, not four
    assert meta.seq_lens.tolist() == [10, 10]
    assert meta.slot_mapping.tolist() == [-1, -1]  # no KV writes
    assert meta.block_table[:, :3].tolist() == [[0, 1, 2], [0, 1, 2]]  # 10 tokens in blocks of 4
    assert meta.max_query_len == 1


@pytest.mark.parametrize("key, context_len, match", [
    ((3, 1), 8, "no graph for"),  # 3 is not a bucket (1, 2, 4)
    ((1, 2), 8, "no graph for"),
    ((1, 4), 3, "must be in"),  # shorter than its own queries
    ((1, 1), 33, "must be in"),  # past max_model_len
])
def test_prepare_replay_refuses_bad_keys_and_lengths(key, context_len, match):
    with pytest.raises(ValueError, match=match):
        make_runner(RecordingModel()).prepare_replay(key, context_len)


def test_advance_verify_uploads_the_block_table_only_when_blocks_change():
    """A verify step queued ahead takes the sequences' block ids; the table is copied to the
    device only when they differ from what the buffers hold (a copy on the stream costs the
    device several microseconds a step)."""
    runner = make_runner(RecordingModel())
    runner.prepare_replay((2, 4), 12)
    accepted, next_token = torch.tensor([1, 3]), torch.tensor([7, 8])
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    runner.advance_verify(2, accepted, next_token, drafts, [[5, 6, 7], [1, 2, 3]])
    assert runner.block_table[:2, :3].tolist() == [[5, 6, 7], [1, 2, 3]]
    runner.block_table[0, 0] = 99  # a marker: the same ids again leave the buffer alone
    runner.advance_verify(2, accepted, next_token, drafts, [[5, 6, 7], [1, 2, 3]])
    assert runner.block_table[0, 0] == 99
    runner.advance_verify(2, accepted, next_token, drafts, [[5, 6, 7, 9], [1, 2, 3]])  # a block added
    assert runner.block_table[:2, :4].tolist()[0] == [5, 6, 7, 9] and runner.block_table[1, :3].tolist() == [1, 2, 3]
    runner.prepare_replay((2, 4), 12)  # rewrites the table: the next advance uploads again
    runner.advance_verify(2, accepted, next_token, drafts, [[5, 6, 7, 9], [1, 2, 3]])
    assert runner.block_table[0, :4].tolist() == [5, 6, 7, 9]
