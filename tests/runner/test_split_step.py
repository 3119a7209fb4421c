"""Batches of prompt chunks beside verifies, split (runner/split_step.py): one forward over both,
the verifies' outputs loaded into the padded step's buffers and finished there (verification, the
draft loop), the prompt chunks' rows sampled by the host step, which verifies nothing.

Checked: SplitBatch's partition and merge on their own; for each kind of drafter (EAGLE3, a
draft LM drafting for itself, suffix, a suffix + EAGLE3 hybrid) under chunked prefill, new
requests arriving while others verify (two sequences at a time) and preemption, greedy output
equals plain greedy output (fp32), some batches were split, each with its outputs loaded (no
second forward), no host step saw a draft, no KV block is kept; and a queued-ahead pipeline
queues nothing past a split batch.
"""

from __future__ import annotations

import pytest

from fixtures.padded_step import count_steps
from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.split_step import SplitBatch, verify_shaped

MAX_TOKENS = 16
ARRIVALS = dict(STRESS, max_num_seqs=2)  # chunks, preemption, and prompts arriving beside verifies


def scheduled(num_new_tokens: int, drafts: list[int], samples: bool = True) -> ScheduledSequence:
    return ScheduledSequence(Sequence(0, "r", 0, list(range(10)), SamplingParams()), num_new_tokens, drafts, samples)


def test_split_batch_partitions_and_merges_in_order():
    verify, decode = scheduled(3, [5, 6]), scheduled(1, [])
    chunk, last_chunk = scheduled(4, [], samples=False), scheduled(3, [7])  # a last chunk with a draft
    sched = SchedulerOutput([chunk, verify, last_chunk, decode], num_next_drafts=2)
    assert [verify_shaped(item) for item in sched.scheduled] == [False, True, False, True]
    split = SplitBatch.of(sched)
    assert split.verify.scheduled == [verify, decode] and split.verify_index == [1, 3]
    assert split.prefill.scheduled == [chunk, last_chunk] and split.prefill_index == [0, 2]
    assert split.verify.num_next_drafts == split.prefill.num_next_drafts == 2
    assert split.merge(["v1", "v3"], ["p0", "p2"]) == ["p0", "v1", "p2", "v3"]
    assert SplitBatch.of(SchedulerOutput([verify, decode])) is None  # nothing to split off
    assert SplitBatch.of(SchedulerOutput([chunk])) is None


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(folder, spec=None, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(folder, dtype="float32", speculative_config=spec, **{**ARRIVALS, **options})
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    return generate(qwen3_checkpoint)[1]


def drafter_spec(name: str, qwen3_checkpoint: str, eagle3_head: str) -> dict:
    return {
        "eagle3": {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_min_match_length": 2},
        "hybrid": {"method": "suffix", "hybrid": "eagle3", "model": eagle3_head, "num_speculative_tokens": 6,
                   "hybrid_num_speculative_tokens": 2, "hybrid_min_match_length": 3},
    }[name]


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model", "suffix", "hybrid"])
def test_prompt_chunks_beside_verifies_split_off_the_padded_step(qwen3_checkpoint, eagle3_head, plain, monkeypatch,
                                                                 drafter):
    counts = count_steps(monkeypatch)
    loads = []
    load = CudaGraphRunner.load
    monkeypatch.setattr(CudaGraphRunner, "load", lambda self, *args: loads.append(1) or load(self, *args))
    llm, got = generate(qwen3_checkpoint, drafter_spec(drafter, qwen3_checkpoint, eagle3_head))
    assert got == plain
    runner = llm.engine.runner
    assert runner.num_split_steps > 0 and len(loads) == runner.num_split_steps and counts["padded"] > 0
    assert counts["host_verify"] == 0, counts  # every draft verified on the padded step
    stats = llm.get_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if drafter == "draft_model":  # the target drafting for itself: every draft accepted, split steps too
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]


def test_nothing_is_queued_past_a_split_batch(qwen3_checkpoint, eagle3_head, plain, monkeypatch):
    counts = count_steps(monkeypatch)
    llm, got = generate(qwen3_checkpoint, drafter_spec("eagle3", qwen3_checkpoint, eagle3_head),
                        async_scheduling="on")
    assert got == plain
    runner = llm.engine.runner
    assert runner.pipeline.queue_ahead and runner.pipeline.num_used > 0
    assert runner.num_split_steps > 0 and counts["host_verify"] == 0
    queued = []
    finish = type(runner.pipeline).finish
    monkeypatch.setattr(type(runner.pipeline), "finish", lambda self, step, n=None, queue_next=True: (
        queued.append(queue_next), finish(self, step, n, queue_next))[1])
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert False in queued and True in queued


def test_mtp_on_the_mla_target_splits_prompt_chunks_off(checkpoint_root, tokenizer_dir, monkeypatch):
    """MTP (its layer reads the target's hidden rows, loaded into the buffers) on the DeepSeek-V3
    fixture (MLA + MoE): prompts of unequal length arriving beside verifies, greedy = plain."""
    from fixtures import deepseek as ds

    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": [5 + i, 17, 250, 3, 99, 41, 7][: 7 - i]} for i in range(4)]
    options = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=6)
    plain = LLM(folder, **options).generate(prompts, greedy(), use_tqdm=False)
    counts = count_steps(monkeypatch)
    llm = LLM(folder, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **options)
    got = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.runner.num_split_steps > 0 and counts["host_verify"] == 0, counts
