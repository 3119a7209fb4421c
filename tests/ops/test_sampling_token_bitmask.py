"""The one-launch token bitmask (ops/sampling/triton_token_bitmask.py) against its torch twin
(structured/bitmask.apply_token_bitmask on the CPU), in Triton's interpreter: the same bits for
every row selection (all rows, a slice, an index tensor), with and without a fallback, over
vocabularies that are and are not multiples of 32 and masks with fewer words than the vocabulary
needs, with NaN, +inf and -inf logits, rows whose allowed logits are all dead (the fallback's
turn) and rows allowing nothing; bad arguments raise clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: F401
from foretell.structured.bitmask import apply_token_bitmask, num_mask_words

kernels = import_interpreted("foretell.ops.sampling.triton_token_bitmask")


def _case(gen: torch.Generator, rows: int, vocab: int, words: int):
    logits = torch.randn(rows, vocab, generator=gen) * 4
    specials = torch.rand(rows, vocab, generator=gen)
    logits[specials < 0.05] = float("nan")
    logits[(specials >= 0.05) & (specials < 0.1)] = float("inf")
    logits[(specials >= 0.1) & (specials < 0.2)] = float("-inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    fallback = torch.randn(rows, vocab, generator=gen)
    fallback[torch.rand(rows, vocab, generator=gen) < 0.05] = float("nan")
    return logits, bitmask, fallback


def _rows(selection: str, rows: int, m: int, rng: random.Random):
    if selection == "all":
        return None
    if selection == "slice":
        start = rng.randrange(rows - m + 1)
        return slice(start, start + m)
    return torch.tensor(rng.sample(range(rows), m), dtype=torch.int64)


@pytest.mark.parametrize("vocab, words", [(4096, 128), (1000, 32), (77, 2), (300, 5)],
                         ids=["4096", "1000", "77-short-words", "300-short-words"])
@pytest.mark.parametrize("selection", ["all", "slice", "index"])
@pytest.mark.parametrize("with_fallback", [False, True], ids=["plain", "fallback"])
def test_one_launch_equals_the_torch_twin(vocab, words, selection, with_fallback):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = rng.randint(3, 9)
    m = rows if selection == "all" else rng.randint(1, rows)
    logits, bitmask, fallback = _case(gen, rows, vocab, words)
    bitmask = bitmask[:m].contiguous()
    bitmask[0] = 0  # allows nothing: -inf everywhere (the fallback's allowed logits are none either)
    if m > 1:  # every allowed logit dead (NaN or -inf): the fallback's row under the mask
        dead = torch.where(torch.rand(vocab, generator=gen) < 0.5, float("nan"), float("-inf"))
        index = _rows(selection, rows, m, rng)
        target = (list(range(rows)) if index is None else
                  list(range(rows))[index] if isinstance(index, slice) else index.tolist())[1]
        logits[target] = dead
    else:
        index = _rows(selection, rows, m, rng)
    want, got = logits.clone(), logits.clone()
    fb = fallback if with_fallback else None
    with reports_seed(seed):
        apply_token_bitmask(want, index, bitmask, fb)  # the CPU: the torch twin
        kernels.apply_token_bitmask_triton(got, index, bitmask, fb)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(want, nan=0.0))


def test_bad_arguments_raise_clear_errors():
    logits = torch.zeros(4, 64)
    bitmask = torch.zeros(2, num_mask_words(64), dtype=torch.int32)
    with pytest.raises(ValueError, match="give the rows they are for"):
        kernels.apply_token_bitmask_triton(logits, None, bitmask)
    with pytest.raises(ValueError, match="step 1 and 2 rows"):
        kernels.apply_token_bitmask_triton(logits, slice(0, 3), bitmask)
    with pytest.raises(ValueError, match=r"row_index must be \[2\]"):
        kernels.apply_token_bitmask_triton(logits, torch.tensor([0, 1, 2]), bitmask)
    with pytest.raises(ValueError, match="float32"):
        kernels.apply_token_bitmask_triton(logits.half(), slice(0, 2), bitmask)
    with pytest.raises(ValueError, match="int32"):
        kernels.apply_token_bitmask_triton(logits, slice(0, 2), bitmask.long())
    with pytest.raises(ValueError, match="fallback must be"):
        kernels.apply_token_bitmask_triton(logits, slice(0, 2), bitmask, torch.zeros(4, 32))
