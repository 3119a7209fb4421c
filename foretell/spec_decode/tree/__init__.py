"""Draft trees: the building blocks of a tree speculation step (issue 28).

shape.py     TreeShape (num_speculative_tokens = depth, topk, num_draft_tokens) and DraftTree
build.py     expanding per-depth draft logits into a tree of the best num_draft_tokens nodes
verify.py    greedy longest matching path and multi-draft rejection sampling over a tree
compact.py   the slot moves that place the accepted path's K/V contiguously after the context
simulated.py simulated acceptance along the tree's best path (benchmarks with random weights)
proposer.py  drafting a tree with an EAGLE3 head (catch-up, then per-depth frontier forwards)

The engine's tree step is runner/tree_step.py (speculative_config topk > 1); docs/trees.md says
what runs and what is left.
"""
