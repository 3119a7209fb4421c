"""Host cost of a tree step's verification (issue 28): the per-level walk the runner used
(spec_decode/tree/verify.py; sampled trees one at a time) against the depth-independent path
verification (spec_decode/tree/path_verify.py; sampled trees all at once).

For each case it prints the thread CPU time per verification (median of rounds, each round
timing the two alternately) and the top-level torch calls one verification issues (torch
profiler on the CPU: on CUDA each is about one launch). Small vocabularies keep the CPU's compute
out of the figure: what is left is the host's dispatch work, which on the GPU is the part the
device cannot hide.

  python scripts/tree_verify_overhead.py [--tree 6,4,16] [--batches 1,8] [--reps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from foretell.layers.sampler import SamplingBatch, processed_probs  # noqa: E402
from foretell.sampling_params import SamplingParams  # noqa: E402
from foretell.spec_decode.tree.build import build_tree  # noqa: E402
from foretell.spec_decode.tree.path_verify import (  # noqa: E402
    best_path_nodes, last_on_path, result_from_on_path, verify_greedy_paths, verify_sampled_paths,
)
from foretell.spec_decode.tree.shape import DraftTree, TreeShape  # noqa: E402
from foretell.spec_decode.tree.simulated import best_path  # noqa: E402
from foretell.spec_decode.tree.verify import last_node, result_from_path, verify_greedy, verify_sampled  # noqa: E402

VOCAB = 64


def drafted(shape: TreeShape, batch: int) -> DraftTree:
    gen = torch.Generator().manual_seed(0)
    return build_tree(shape, torch.randint(VOCAB, (batch,), generator=gen), torch.randn(batch, VOCAB, generator=gen),
                      lambda f, p, d: torch.randn(batch, shape.topk, VOCAB, generator=gen))


def cases(shape: TreeShape, batch: int) -> dict:
    tree = drafted(shape, batch)
    ids = torch.randint(VOCAB, tree.tokens.shape)
    logits = torch.randn(batch, tree.num_nodes, VOCAB)
    limits = torch.full((batch,), shape.depth - 1)
    drawn = torch.full((batch,), shape.depth - 2)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen = torch.Generator().manual_seed(1)

    def greedy_walk():  # TreeStep._verify's greedy branch before: the walk, then the limit cut
        verify = verify_greedy(tree, ids)
        keep = torch.arange(shape.depth + 1).unsqueeze(0) <= limits.unsqueeze(1)
        path = torch.where(keep, verify.accepted_nodes, -1)
        return result_from_path(tree, path, ids.gather(1, last_node(path).unsqueeze(1)).squeeze(1))

    def simulated_walk():
        keep = torch.arange(shape.depth + 1).unsqueeze(0) <= drawn.unsqueeze(1)
        path = torch.where(keep, best_path(tree), -1)
        return result_from_path(tree, path, ids.gather(1, last_node(path).unsqueeze(1)).squeeze(1))

    def simulated_paths():
        on_path = best_path_nodes(tree, drawn)
        return result_from_on_path(tree, on_path, ids.gather(1, last_on_path(tree, on_path).unsqueeze(1)).squeeze(1))

    def sampled_per_tree():  # TreeStep._verify_one before: each tree's probabilities and walk
        for j in range(batch):
            one = DraftTree(shape, *(getattr(tree, f)[j: j + 1] for f in
                                     ("tokens", "parents", "depths", "ancestor_mask", "scores")))
            rows = tree.num_nodes
            sampling = SamplingBatch.build([params] * rows, [None] * rows, VOCAB, torch.device("cpu"))
            verify_sampled(one, processed_probs(logits[j], sampling).unsqueeze(0), None, gen)

    def sampled_paths():  # TreeStep._verify_sampled now: every tree at once
        rows = batch * tree.num_nodes
        sampling = SamplingBatch.build([params] * rows, [None] * rows, VOCAB, torch.device("cpu"))
        probs = processed_probs(logits.flatten(0, 1), sampling).view(batch, tree.num_nodes, VOCAB)
        uniforms = torch.rand(batch, tree.num_nodes, generator=gen)
        noise = torch.empty(batch, VOCAB).exponential_(generator=gen)
        return verify_sampled_paths(tree, probs, uniforms, noise)

    return {
        "greedy": (greedy_walk, lambda: verify_greedy_paths(tree, ids, limits)),
        "simulated": (simulated_walk, simulated_paths),
        "sampled": (sampled_per_tree, sampled_paths),
    }


VIEWS = {"view", "unsqueeze", "squeeze", "expand", "slice", "select", "as_strided", "reshape", "flatten",
         "alias", "t", "transpose", "permute", "detach", "expand_as", "lift_fresh", "_unsafe_view"}


def torch_calls(fn) -> tuple[int, int]:
    """(top-level aten calls, those that are not views: on CUDA about one launch each)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    top = [e.name[len("aten::"):] for e in prof.events() if e.name.startswith("aten::") and
           (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(top), sum(1 for name in top if name not in VIEWS)


def thread_us(fn, reps: int) -> float:
    start = time.thread_time_ns()
    for _ in range(reps):
        fn()
    return (time.thread_time_ns() - start) / reps / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default="6,4,16", help="depth,topk,num_draft_tokens")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = TreeShape(*(int(x) for x in args.tree.split(",")))
    print(f"tree {args.tree}, vocab {VOCAB}, torch {torch.__version__}, thread CPU us per verification (median of "
          f"{args.rounds} alternating rounds of {args.reps})")
    print(f"{'case':<10} {'batch':>5} {'walk us':>9} {'paths us':>9} {'walk calls (not views)':>22} "
          f"{'paths calls (not views)':>23}")
    for batch in (int(b) for b in args.batches.split(",")):
        for name, (before, after) in cases(shape, batch).items():
            before(), after()  # warm
            times = {before: [], after: []}
            for _ in range(args.rounds):
                for fn in (before, after):
                    times[fn].append(thread_us(fn, args.reps))
            calls = ["%d (%d)" % torch_calls(fn) for fn in (before, after)]
            print(f"{name:<10} {batch:>5} {statistics.median(times[before]):>9.1f} "
                  f"{statistics.median(times[after]):>9.1f} {calls[0]:>22} {calls[1]:>23}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
