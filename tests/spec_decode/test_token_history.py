"""TokenHistory (a host drafter's view of a sequence's tokens and the step's new ones, no copy)
against the concatenated list it stands for: length, every index and slice, iteration, equality,
numpy; the stored list is read in place (not copied); bad indices raise like a list's; the n-gram
drafter drafts from it what it drafts from the list."""

from __future__ import annotations

import random

import numpy as np
import pytest

from foretell.spec_decode.ngram import lookup as ngram_lookup
from foretell.spec_decode.token_history import TokenHistory


@pytest.mark.parametrize("stored_len,appended_len", [(0, 0), (0, 3), (5, 0), (7, 1), (12, 17)])
def test_reads_like_the_concatenated_list(stored_len, appended_len):
    rng = random.Random(stored_len * 31 + appended_len)
    stored = [rng.randrange(50) for _ in range(stored_len)]
    appended = [rng.randrange(50) for _ in range(appended_len)]
    view, ref = TokenHistory(stored, appended), stored + appended
    assert len(view) == len(ref) and list(view) == ref and view == ref and view.to_list() == ref
    for i in range(-len(ref), len(ref)):
        assert view[i] == ref[i]
    bounds = list(range(-len(ref) - 2, len(ref) + 3)) + [None]
    for start in bounds:
        for stop in bounds:
            assert view[start:stop] == ref[start:stop], (start, stop)
    assert view[::2] == ref[::2] and view[::-1] == ref[::-1]
    assert np.asarray(view, dtype=np.int64).tolist() == ref
    assert view != ref + [1]


def test_reads_the_stored_list_in_place_and_rejects_bad_indices():
    stored = [1, 2, 3]
    view = TokenHistory(stored, [4])
    assert view.stored is stored  # no copy
    assert view[-1] == 4 and view[2] == 3
    for bad in (4, -5):
        with pytest.raises(IndexError, match="length 4"):
            view[bad]
    with pytest.raises(TypeError):
        hash(view)


def test_ngram_drafts_the_same_from_the_view():
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(80)]
    for cut in range(10, 80, 9):
        ref = tokens[:cut]
        view = TokenHistory(ref[:-3], ref[-3:])
        assert ngram_lookup(view, 5, 1, 4) == ngram_lookup(ref, 5, 1, 4)
