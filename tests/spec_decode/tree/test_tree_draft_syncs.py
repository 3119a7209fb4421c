"""What a tree step's draft phase (runner/tree_step.TreeStep._draft: HostStep.draft_batch, the
EAGLE3 head's catch-up over the accepted path, the expansion) makes a CUDA device do, counted on
the CPU by bench/device_syncs.DeviceSyncCounter (issue 28), so that CI holds it.

Before (1af7a6b) the phase uploaded host lists 8 times a step: the path's rows (draft_batch), the
catch-up's host ints, its query starts and its context lengths (two uploads), the drafting rows'
ends, the drafting sequences' table rows, root tokens and roots. Now 4: the path's rows, the
catch-up's host ints, the lengths in one upload, and root tokens + roots in one (the ends are the
query starts less one, on the device; the table is taken whole when every sequence drafts). The
only device read is the drafted trees' (one a step); the CPU's attention reference reads lengths
back (ops/attention/reference.py), which a CUDA backend does not, so those are not held here.
"""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
from foretell.bench.device_syncs import DeviceSyncCounter, difference

TREE = {"num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 8}
PROMPTS = ["The cat reads the book. The cat", "Question: what is 3 plus 7? Answer:"]
CPU_ONLY_SITES = ("foretell/ops/attention/reference.py",)  # the CPU attention reference's reads


def _device_syncs(sites) -> int:
    return sum(n for site, n in sites.items() if not any(s in site for s in CPU_ONLY_SITES))


@pytest.fixture(scope="module")
def tree_llm(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, **TREE}
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec) as llm:
        yield llm


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_tree_draft_phase_uploads_four_times_and_reads_once(tree_llm, num_prompts):
    tree_step = tree_llm.engine.runner.tree_step
    eagle = tree_step.drafter.proposer
    phases, catch_ups = [], []
    draft, catch_up = tree_step._draft, eagle.catch_up

    def counted_draft(sched, batch, hidden, aux, results, path_rows):
        before = counter.snapshot()
        out = draft(sched, batch, hidden, aux, results, path_rows)
        if path_rows:  # a tree verify's draft phase (not a prefill's)
            phases.append(difference(counter.snapshot(), before))
        return out

    def counted_catch_up(*args, **kwargs):
        before = counter.snapshot()
        out = catch_up(*args, **kwargs)
        catch_ups.append(difference(counter.snapshot(), before))
        return out

    tree_step._draft, eagle.catch_up = counted_draft, counted_catch_up
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        with DeviceSyncCounter() as counter:
            counter.track_engine(tree_llm.engine.runner)
            outs = tree_llm.generate(PROMPTS[:num_prompts], params, use_tqdm=False)
    finally:
        del tree_step._draft, eagle.catch_up  # the class's methods again
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert phases, "no tree step drafted"
    for phase in phases:
        assert phase["uploads"] <= 4, phase
        assert _device_syncs(phase["sites"]) <= 1, phase["sites"]  # the drafted trees' one read
    for step in catch_ups:
        assert step["uploads"] <= 2 and step["syncs"] == 0, step
