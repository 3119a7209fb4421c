"""TokenHistory: a sequence's tokens through its newest one, as a host drafter (n-gram, suffix)
reads them in a step, without copying the whole history: the sequence's stored token list and
the tokens the step appends after it (the verify's emitted tokens), read in place.

A step's DraftBatch.histories used to be `seq.token_ids + new_token_ids`, a copy of the whole
history every step (growing with the sequence) of which the suffix drafter reads only the new
tokens and a few before them. A TokenHistory reads like that list (len, indexing, slices,
iteration, ==, numpy.asarray) and costs O(1) to make; a slice inside one of the two parts
copies only that slice.

Valid for the step that made it: the stored list is the sequence's own, which the scheduler's
postprocess appends to after the step. A drafter that keeps tokens copies them (to_list() or a
slice), as the suffix drafter's index does.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain


class TokenHistory(Sequence):
    __slots__ = ("stored", "appended", "_stored_len", "_len")

    def __init__(self, stored: list[int], appended: list[int]):
        self.stored = stored  # the sequence's token list (not copied)
        self.appended = appended  # this step's tokens after it
        self._stored_len = len(stored)
        self._len = self._stored_len + len(appended)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        s = self._stored_len
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return self.to_list()[index]
            if stop <= start:
                return []
            if start >= s:
                return self.appended[start - s : stop - s]
            if stop <= s:
                return self.stored[start:stop]
            return self.stored[start:s] + self.appended[: stop - s]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"token history index out of range (length {self._len})")
        return self.stored[index] if index < s else self.appended[index - s]

    def __iter__(self):
        return chain(self.stored[: self._stored_len], self.appended)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, TokenHistory)):
            return len(other) == self._len and self.to_list() == list(other)
        return NotImplemented

    __hash__ = None  # a view of mutable lists

    def __repr__(self) -> str:
        return f"TokenHistory({self.to_list()!r})"

    def to_list(self) -> list[int]:
        """The tokens as a new list (a copy)."""
        return self.stored[: self._stored_len] + self.appended

    def __array__(self, dtype=None, copy=None):
        import numpy

        return numpy.asarray(self.to_list(), dtype=dtype)
