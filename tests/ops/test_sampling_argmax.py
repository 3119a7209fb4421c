"""The chunked Triton argmax (ops/sampling/triton_argmax.py) against torch.argmax, in Triton's
interpreter on CPU tensors (the real kernels on a CUDA machine): vocabularies of one chunk, several
chunks and a ragged last chunk; the maximum in the first or the last chunk; ties inside a chunk and
across chunks (the first column wins, as torch's); -inf and NaN entries; strided rows; the id map;
strided `out`; bad input.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.layers.sampler import argmax_rows

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernels = import_interpreted("foretell.ops.sampling.triton_argmax")
CHUNK = kernels.CHUNK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 100), (3, CHUNK), (2, 2 * CHUNK + 37), (5, 3 * CHUNK)])
def test_argmax_matches_torch(rows, vocab, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    with reports_seed(seed):
        torch.testing.assert_close(kernels.argmax_triton(logits.to(DEVICE)).cpu(), logits.argmax(dim=-1))


def test_ties_take_the_first_column_within_and_across_chunks():
    vocab = 3 * CHUNK + 5
    logits = torch.full((4, vocab), -1.0)
    logits[0, [7, 9]] = 2.0  # a tie inside chunk 0
    logits[1, [CHUNK + 3, 2 * CHUNK + 1, 3 * CHUNK + 4]] = 5.0  # ties across chunks
    logits[2, :] = float("-inf")  # nothing but -inf: column 0, as torch
    logits[3, [10, CHUNK + 1]] = float("inf")
    got = kernels.argmax_triton(logits.to(DEVICE)).cpu()
    assert got.tolist() == [7, CHUNK + 3, 0, 10]
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_nan_counts_as_the_maximum():
    logits = torch.randn(2, 2 * CHUNK)
    logits[0, CHUNK + 11] = float("nan")
    logits[1, 3] = float("nan")
    assert kernels.argmax_triton(logits.to(DEVICE)).cpu().tolist() == [CHUNK + 11, 3]


def test_strided_rows_and_empty_batch():
    base = torch.randn(3, 2 * CHUNK + 8)
    rows = base[:, 4 : 4 + CHUNK + 100]  # row stride != vocab
    assert kernels.argmax_triton(rows.to(DEVICE)).cpu().tolist() == rows.argmax(dim=-1).tolist()
    assert kernels.argmax_triton(torch.empty(0, 10, device=DEVICE)).shape == (0,)


def test_id_map_is_applied_to_the_argmax():
    """id_map (EAGLE3's d2t as target ids): the pick launch writes id_map[argmax]."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    vocab = 2 * CHUNK + 37
    logits = torch.randn(3, vocab, generator=gen)
    id_map = torch.randperm(5 * vocab, generator=gen)[:vocab]  # a draft vocabulary inside a larger one
    with reports_seed(seed):
        expected = id_map[logits.argmax(dim=-1)].tolist()
        assert kernels.argmax_triton(logits.to(DEVICE), id_map.to(DEVICE)).cpu().tolist() == expected
        assert argmax_rows(logits, id_map).tolist() == expected  # the torch path (CPU)
    on_device = id_map.to(DEVICE)  # the bad maps made there (a copy to a GPU would make them contiguous)
    for bad in (on_device[:-1], on_device.int(), torch.stack([on_device, on_device], 1)[:, 0]):
        with pytest.raises(ValueError, match=r"id_map must be a contiguous \[8229\] int64"):
            kernels.argmax_triton(logits.to(DEVICE), bad)


@pytest.mark.parametrize("bad", [torch.randn(10), torch.randn(2, 0), torch.randn(4, 3).t()])
def test_bad_input_is_refused(bad):
    with pytest.raises(ValueError, match="unit last stride"):
        kernels.argmax_triton(bad.to(DEVICE))


def test_argmax_rows_dispatch_keeps_torch_semantics_on_cpu():
    logits = torch.randn(3, 20000)
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_out_takes_a_strided_column():
    """`out` (a column of a [rows, k] drafts buffer, say) is written in place, nothing else."""
    logits = torch.randn(3, CHUNK + 7)
    expected = logits.argmax(dim=-1).tolist()
    drafts = torch.full((3, 4), -5, dtype=torch.int64, device=DEVICE)
    got = kernels.argmax_triton(logits.to(DEVICE), out=drafts[:, 2])
    assert got.data_ptr() == drafts[:, 2].data_ptr()
    assert drafts[:, 2].cpu().tolist() == expected and (drafts[:, [0, 1, 3]] == -5).all()
    host = torch.zeros(3, 2, dtype=torch.int64)
    assert argmax_rows(logits, out=host[:, 1]).tolist() == expected and host[:, 1].tolist() == expected
    with pytest.raises(ValueError, match=r"out must be a \[3\] int64"):
        kernels.argmax_triton(logits.to(DEVICE), out=drafts[:2, 0])
    with pytest.raises(ValueError, match=r"out must be a \[3\] int64"):
        kernels.argmax_triton(logits.to(DEVICE), out=drafts[:, 0].int())


@pytest.mark.parametrize("where", ["first", "last"])
def test_max_in_the_first_or_last_chunk(where):
    vocab = 4 * CHUNK + 9  # a ragged last chunk
    logits = torch.randn(3, vocab)
    columns = [3, CHUNK - 1, 0] if where == "first" else [vocab - 1, 4 * CHUNK, 4 * CHUNK + 5]
    logits[torch.arange(3), columns] = 100.0
    assert kernels.argmax_triton(logits.to(DEVICE)).cpu().tolist() == columns == logits.argmax(dim=-1).tolist()


def test_ties_across_chunks_take_the_first_chunk():
    vocab = 5 * CHUNK
    logits = torch.randn(3, vocab)
    logits[0, [4 * CHUNK + 1, 2 * CHUNK + 7, CHUNK + 2]] = 9.0  # the first chunk holding it is not the last stored
    logits[1, [5, 4 * CHUNK + 3]] = 9.0
    logits[2, [2 * CHUNK + 8, 2 * CHUNK + 6, 3 * CHUNK]] = float("nan")  # NaN ties with NaN
    assert kernels.argmax_triton(logits.to(DEVICE)).cpu().tolist() == [CHUNK + 2, 5, 2 * CHUNK + 6]


def test_single_chunk_vocab():
    for vocab in (1, 2, 37, CHUNK):
        logits = torch.randn(3, vocab)
        assert kernels.argmax_triton(logits.to(DEVICE)).cpu().tolist() == logits.argmax(dim=-1).tolist()
    id_map = torch.tensor([7, 11, 13], dtype=torch.int64)
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 5.0, 1.0]])
    assert kernels.argmax_triton(logits.to(DEVICE), id_map.to(DEVICE)).cpu().tolist() == [11, 7]


def test_id_map_and_strided_out_with_several_chunks():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    vocab = 4 * CHUNK + 100
    logits = torch.randn(3, vocab, generator=gen)
    logits[1, [CHUNK + 1, 3 * CHUNK]] = 50.0  # a tie across chunks: the map takes the first column
    id_map = torch.randperm(vocab, generator=gen)
    drafts = torch.full((3, 5), -5, dtype=torch.int64, device=DEVICE)
    with reports_seed(seed):
        expected = id_map[logits.argmax(dim=-1)].tolist()
        got = kernels.argmax_triton(logits.to(DEVICE), id_map.to(DEVICE), out=drafts[:, 3])
        assert got.data_ptr() == drafts[:, 3].data_ptr() and drafts[:, 3].cpu().tolist() == expected
        assert (drafts[:, [0, 1, 2, 4]] == -5).all()
        assert expected[1] == id_map[CHUNK + 1].item()
