"""The scheduler asks adaptive speculation's policy (a DraftLength) for the next step's drafts with
the batch the coming steps will run: every running sequence (those still in prefill included) and
the waiting ones beside them, up to max_num_seqs. While a batch fills under a token budget, the
first sequences to finish their prompts sample alone; a choice for them alone drafted long, and
their drafts padded the next verify of the whole batch."""

from __future__ import annotations

from foretell import SamplingParams
from foretell.config import SchedulerConfig
from foretell.engine.block_manager import BlockManager
from foretell.engine.scheduler import Scheduler
from foretell.engine.sequence import Sequence


class RecordingDraftLength:
    """A DraftLength that drafts 2 and records the batch sizes it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def choose(self, batch_size: int) -> int:
        self.asked.append(batch_size)
        return 2

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass


def filling_scheduler(num_seqs: int, prompt_len: int, budget: int, max_num_seqs: int = 128,
                      num_blocks: int = 256) -> tuple[Scheduler, RecordingDraftLength]:
    manager = BlockManager(num_blocks, 4)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    scheduler = Scheduler(config, manager, max_model_len=128, num_lookahead_tokens=4)
    policy = RecordingDraftLength()
    scheduler.draft_length = policy
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add(Sequence(i, f"r{i}", 0, [3 + i] * prompt_len, params, frozenset({2})))
    return scheduler, policy


def test_choice_is_for_the_whole_batch_while_it_fills():
    # 4 prompts of 6 tokens under a budget of 10: step 1 prefills prompt 0 and 4 tokens of 1
    # (only sequence 0 samples; 2 wait), step 2 the rest of 1 and 2 and part of 3.
    scheduler, policy = filling_scheduler(num_seqs=4, prompt_len=6, budget=10)
    first = scheduler.schedule()
    assert [item.samples for item in first.scheduled] == [True, False]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    assert policy.asked == [4]  # the batch it fills to, not the one sequence that samples
    assert first.num_next_drafts == 2
    for item in first.scheduled:
        scheduler.postprocess(item, [7] if item.samples else [], 0)
    second = scheduler.schedule()
    assert sum(item.samples for item in second.scheduled) < len(scheduler.running)
    assert policy.asked[-1] == 4


def test_the_expected_batch_stops_at_max_num_seqs():
    scheduler, policy = filling_scheduler(num_seqs=6, prompt_len=3, budget=64, max_num_seqs=4)
    scheduler.schedule()
    assert len(scheduler.running) == 4 and len(scheduler.waiting) == 2
    assert policy.asked == [4]


def test_a_step_where_nothing_samples_asks_for_zero():
    """Zero keeps the last choice (AdaptiveDraftLength.choose): no sequence drafts after it."""
    scheduler, policy = filling_scheduler(num_seqs=2, prompt_len=12, budget=8)
    out = scheduler.schedule()
    assert not any(item.samples for item in out.scheduled)
    assert policy.asked == [0]


def test_waiting_sequences_the_cache_keeps_out_are_not_counted():
    """Out of KV blocks, the waiting sequences will not join soon: the choice is for the running
    ones (a server whose cache, not max_num_seqs, bounds the batch)."""
    scheduler, policy = filling_scheduler(num_seqs=6, prompt_len=8, budget=64, num_blocks=8)
    first = scheduler.schedule()
    assert scheduler.waiting and 0 < len(scheduler.running) < 6
    assert any(item.samples for item in first.scheduled)
    assert policy.asked == [len(scheduler.running)]
