"""The steps of a host drafter's trees (suffix decoding with topk > 1) that verify no tree: plain
decoding's, queued ahead through the step pipeline, as a chain's steps without drafts are.

The tree step (runner/tree_step.py) takes every step that verifies a tree, and prefill chunks; a
plain decode batch goes to the pipeline (runner/step_pipeline.py), which queues the step after it
on the guess that nobody drafts next. The next trees are drafted from the read tokens
(TreeStep.draft_host_trees). A queued step that is not the scheduler's next decision (it verifies
trees) is dropped by take(): safe, as runner/decode_ahead.py says.
"""

from __future__ import annotations

import torch

from foretell.engine.scheduler import SchedulerOutput
from foretell.runner.input_batch import DeferredInputBatch
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import StepPipeline
from foretell.runner.tree_step import TreeStep


def plain_step_of_host_trees(pipeline: StepPipeline, tree_step: TreeStep, sched: SchedulerOutput,
                             block_size: int, device: torch.device) -> list[SequenceResult] | None:
    """The step's results when the pipeline runs it (no tree to verify, a plain decode batch),
    the next trees drafted; None when the tree step must (or nothing is queued ahead here)."""
    if not pipeline.queue_ahead:
        return None
    step = pipeline.take(sched.scheduled, block_size)  # (drops a queued step that is not this one)
    if step is None:
        if any(item.draft_token_ids for item in sched.scheduled):
            return None
        step = pipeline.launch(sched, DeferredInputBatch(sched.scheduled, block_size, device))
        if step is None:
            return None
    results = pipeline.finish(step, sched.num_next_drafts)
    tree_step.draft_host_trees(sched, results)
    return results
