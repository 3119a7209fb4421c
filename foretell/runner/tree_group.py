"""A group of the tree step's trees (runner/tree_step.py): the sequences whose trees have the same
node count, verified, compacted and drafted after together."""

from __future__ import annotations

from dataclasses import dataclass

from foretell.spec_decode.tree.shape import DraftTree


@dataclass
class TreeGroup:
    """The step's trees of one node count, stacked: scheduled indices, trees [n, T], each
    sequence's root row in the batch, the root's position and its nodes' depths (host copies)."""
    index: list[int]
    tree: DraftTree
    root_rows: list[int]
    root_positions: list[int]
    depths: list[list[int]]

