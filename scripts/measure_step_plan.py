"""What the front process sends tensor-parallel ranks each step, before and after the slim plan
(foretell/runner/step_plan.py): pickled bytes per step and median host time per step (front: build and
pickle; rank: unpickle and, for the plan, apply it to the mirrors), for decode steps (with and
without 3 drafts) at batch 1 and 16 and several sequence lengths. CPU only, no model.

  python scripts/measure_step_plan.py [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import sys
import time

sys.path.insert(0, ".")

from foretell import SamplingParams  # noqa: E402
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from foretell.engine.sequence import Sequence  # noqa: E402
from foretell.runner.step_plan import PlanEncoder, SequenceMirrors  # noqa: E402

BLOCK_SIZE = 16
PROTOCOL = pickle.HIGHEST_PROTOCOL


def make_batch(batch: int, length: int) -> list[Sequence]:
    params = SamplingParams(temperature=0.0, max_tokens=100_000)
    seqs = []
    for i in range(batch):
        seq = Sequence(i, f"request-{i}", 0, [(7 * j + i) % 32000 for j in range(length)], params, frozenset({2}))
        seq.num_computed_tokens = length
        seq.block_ids = list(range(i * 10_000, i * 10_000 + -(-(length + 4) // BLOCK_SIZE)))
        seqs.append(seq)
    return seqs


def advance(seqs: list[Sequence], step: int) -> None:
    """One decode step's change on the front: a token, and every BLOCK_SIZE steps a block."""
    for seq in seqs:
        seq.token_ids.append(step % 32000)
        seq.num_computed_tokens += 1
        if step % BLOCK_SIZE == 0:
            seq.block_ids.append(seq.block_ids[-1] + 1)


def median_us(seconds: list[float]) -> float:
    """The median step (a shared machine's other work makes the mean noisy)."""
    return 1e6 * statistics.median(seconds)


def measure(batch: int, length: int, drafts: int, steps: int = 100) -> dict:
    seqs = make_batch(batch, length)
    encoder, mirrors = PlanEncoder(), SequenceMirrors()

    def sched() -> SchedulerOutput:
        return SchedulerOutput([ScheduledSequence(s, 1 + drafts, list(range(5, 5 + drafts)), True) for s in seqs])

    mirrors.apply(pickle.loads(pickle.dumps(encoder.encode(sched()), PROTOCOL)))  # the first plan: whole
    # The collector off, so neither way pays for the other's garbage (refcounting frees it).
    gc.collect()
    gc.disable()
    try:
        whole_bytes = slim_bytes = 0
        whole_front, whole_rank, slim_front, slim_rank = [], [], [], []
        for step in range(steps):
            advance(seqs, step)
            current = sched()
            t0 = time.perf_counter()
            wire = pickle.dumps(current, PROTOCOL)
            t1 = time.perf_counter()
            pickle.loads(wire)
            whole_rank.append(time.perf_counter() - t1)
            whole_front.append(t1 - t0)
            whole_bytes += len(wire)
            t0 = time.perf_counter()
            wire = pickle.dumps(encoder.encode(current), PROTOCOL)
            t1 = time.perf_counter()
            mirrors.apply(pickle.loads(wire))
            slim_rank.append(time.perf_counter() - t1)
            slim_front.append(t1 - t0)
            slim_bytes += len(wire)
    finally:
        gc.enable()
    return {
        "batch": batch, "length": length, "drafts": drafts,
        "whole_bytes": whole_bytes // steps, "slim_bytes": slim_bytes // steps,
        "whole_front_us": median_us(whole_front), "whole_rank_us": median_us(whole_rank),
        "slim_front_us": median_us(slim_front), "slim_rank_us": median_us(slim_rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [measure(batch, length, drafts) for batch in (1, 16) for length in (128, 2048, 32768) for drafts in (0, 3)]
    print(f"{'batch':>5} {'length':>6} {'drafts':>6} | {'bytes/step':>21} | {'front us/step':>15} | {'rank us/step':>15}")
    print(f"{'':>5} {'':>6} {'':>6} | {'whole':>10} {'plan':>10} | {'whole':>7} {'plan':>7} | {'whole':>7} {'plan':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['length']:>6} {r['drafts']:>6} | {r['whole_bytes']:>10} {r['slim_bytes']:>10} | "
              f"{r['whole_front_us']:>7.1f} {r['slim_front_us']:>7.1f} | {r['whole_rank_us']:>7.1f} {r['slim_rank_us']:>7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
