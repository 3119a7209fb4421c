"""TokenBits (structured/bitmask.py): a drafter's forbidden tokens read straight from packed mask
rows of target ids, against the plain unpack (one bit per target token, a Python loop) followed
by the drafter's id map; random rows, an EAGLE3-like map, the same ids without a map, tokens past
the rows' words (never allowed), bit 31 of a word, and the host check for a row that allows none
of the drafter's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foretell.structured.bitmask import TokenBits, TokenBitsCache, num_mask_words


def reference_forbidden(rows: np.ndarray, target_ids: list[int]) -> torch.Tensor:
    """rows [n, words] int32 -> [n, len(target_ids)] bool, bit by bit."""
    bits = rows.view(np.uint32)
    out = torch.zeros(rows.shape[0], len(target_ids), dtype=torch.bool)
    for r in range(rows.shape[0]):
        for j, t in enumerate(target_ids):
            allowed = t < rows.shape[1] * 32 and (int(bits[r, t >> 5]) >> (t & 31)) & 1
            out[r, j] = not allowed
    return out


@pytest.mark.parametrize("mapped", [True, False])
def test_forbidden_matches_the_bitwise_reference(mapped):
    generator = torch.Generator().manual_seed(3)
    target_vocab, num_words = 300, num_mask_words(300)
    rows = torch.randint(-2**31, 2**31 - 1, (5, num_words), dtype=torch.int32, generator=generator).numpy()
    rows[1] = 0  # nothing allowed
    rows[2] = -1  # everything
    if mapped:
        target_ids = torch.randperm(target_vocab, generator=generator)[:64].sort().values
        target_ids[-1] = 31  # bit 31 of word 0
        ids = target_ids.tolist()
        bits = TokenBits(target_ids, len(ids), num_words, torch.device("cpu"))
    else:
        ids = list(range(num_words * 32 + 7))  # a drafter wider than the rows: its last 7 never allowed
        bits = TokenBits(None, len(ids), num_words, torch.device("cpu"))
    got = bits.forbidden(torch.from_numpy(rows))
    assert torch.equal(got, reference_forbidden(rows, ids))
    for r in range(rows.shape[0]):
        assert bits.allows_any(rows[r]) == bool((~reference_forbidden(rows[r: r + 1], ids)).any())
    assert not bits.allows_any(rows[1]) and bits.allows_any(rows[2])


def test_the_cache_keeps_one_entry_per_vocabulary():
    cache = TokenBitsCache()
    target_ids = torch.arange(0, 64, 2)
    first = cache.get(target_ids, 32, 4, torch.device("cpu"))
    assert cache.get(target_ids, 32, 4, torch.device("cpu")) is first
    assert cache.get(target_ids.clone(), 32, 4, torch.device("cpu")) is not first  # another map
    assert cache.get(None, 128, 4, torch.device("cpu")) is not first
