"""Token origins (SamplingParams.return_token_origins) and per-request speculation off
(SamplingParams.use_speculation=False), on the shipped default family with its EAGLE3 head.

The reference is independent of the engine's bookkeeping: a spy on the scheduler records the
drafts each step verified, and the tokens each step appended are read off the sequence; from those
alone the test rebuilds what every token must be (greedy: the accepted drafts are the prefix the
step's tokens share with its drafts; the token after them corrects the next draft, or is a bonus).
"""

from __future__ import annotations

import os

import pytest

from foretell import LLM, SamplingParams
from foretell.defaults import member_path
from foretell.engine.token_origins import ACCEPTED, BONUS, CORRECTED, TARGET, TokenOrigin, step_origins

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef", "import os\nimport", "Question: 2 + 3 =?\nAnswer:"]
needs_default_models = pytest.mark.skipif(
    not os.path.isdir(member_path("target")), reason="no default models"
)


# ------------------------------------------------------------------------------- step_origins


def test_step_without_drafts_is_one_target_token():
    assert step_origins([], 0, [7], 0, step=4) == [TokenOrigin(7, TARGET, 4, 0, 0)]


def test_all_drafts_accepted_ends_with_a_bonus():
    got = step_origins([5, 6, 7], 3, [5, 6, 7, 9], 3, step=2)
    assert [o.kind for o in got] == [ACCEPTED, ACCEPTED, ACCEPTED, BONUS]
    assert [o.position for o in got] == [0, 1, 2, 3]
    assert [o.token_id for o in got] == [5, 6, 7, 9]
    assert all(o.step == 2 and o.num_drafts == 3 and o.replaced_draft is None for o in got)


def test_first_rejected_draft_is_what_the_correction_replaced():
    got = step_origins([5, 6, 7], 3, [5, 8], 1, step=0)
    assert got == [TokenOrigin(5, ACCEPTED, 0, 0, 3), TokenOrigin(8, CORRECTED, 0, 1, 3, replaced_draft=6)]
    rejected_first = step_origins([5, 6, 7], 3, [4], 0, step=1)
    assert rejected_first == [TokenOrigin(4, CORRECTED, 1, 0, 3, replaced_draft=5)]


def test_capped_acceptance_near_max_tokens_ends_with_a_bonus():
    # 3 drafts verified, at most 1 may be accepted (ScheduledSequence.accept_limit)
    got = step_origins([5, 6, 7], 1, [5, 9], 1, step=0)
    assert [o.kind for o in got] == [ACCEPTED, BONUS]
    assert got[1].num_drafts == 1


@pytest.mark.parametrize(
    "drafts, usable, tokens, accepted, message",
    [
        ([5], 1, [5, 6], 2, "accepted 2 of 1"),
        ([5], 2, [5, 6], 1, "usable drafts"),
        ([5, 6], 2, [5, 6], 0, "emits 1 tokens, got 2"),
        ([5, 6], 2, [], 0, "emits 1 tokens, got 0"),
    ],
)
def test_inconsistent_step_is_refused_with_its_numbers(drafts, usable, tokens, accepted, message):
    with pytest.raises(ValueError, match=message):
        step_origins(drafts, usable, tokens, accepted, step=0)


@pytest.mark.parametrize("flag", ["return_token_origins", "use_speculation"])
def test_flags_must_be_booleans(flag):
    with pytest.raises(ValueError, match=f"SamplingParams.{flag} must be True or False, got 1"):
        SamplingParams(**{flag: 1})


# ------------------------------------------------------------------------------------ engine

_LLM: list[LLM] = []


def eagle3_llm() -> LLM:
    if not _LLM:
        spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}
        _LLM.append(LLM(member_path("target"), num_kv_blocks=96, speculative_config=spec))
    return _LLM[0]


class StepSpy:
    """Records, per sequence, each step's scheduled drafts and the tokens the step appended."""

    def __init__(self, llm: LLM):
        self.engine = llm.engine
        self.steps: dict[int, list[tuple[list[int], list[int]]]] = {}

    def __enter__(self):
        engine = self.engine
        original = engine.step

        def step():
            sched = engine.scheduler.schedule  # drafts as scheduled, tokens as appended
            before = {}

            def schedule():
                out = sched()
                for item in out.scheduled:
                    before[item.seq.seq_id] = (item, item.seq, list(item.draft_token_ids), item.seq.num_tokens)
                return out

            engine.scheduler.schedule = schedule
            try:
                outputs = original()
            finally:
                engine.scheduler.schedule = sched
            for seq_id, (item, seq, drafts, num_tokens) in before.items():
                appended = seq.token_ids[num_tokens:]
                if appended:
                    usable = item.num_usable_drafts
                    self.steps.setdefault((seq.request_id, seq.index), []).append((drafts[:usable], appended))
            return outputs

        engine.step = step
        return self

    def __exit__(self, *exc):
        del self.engine.step  # back to the class's method


def expected_origins(steps: list[tuple[list[int], list[int]]], greedy: bool) -> list[tuple]:
    """(token, kind, step, position, replaced draft) rebuilt from drafts and appended tokens."""
    out = []
    for step, (drafts, tokens) in enumerate(steps):
        accepted = len(tokens) - 1
        if greedy:  # the accepted run is exactly the shared prefix (a stop may cut the step short)
            assert tokens[:accepted] == drafts[:accepted]
        for i, token in enumerate(tokens[:accepted]):
            out.append((token, ACCEPTED, step, i, None))
        last = tokens[-1]
        if not drafts:
            out.append((last, TARGET, step, 0, None))
        elif accepted < len(drafts) and last != drafts[accepted]:
            out.append((last, CORRECTED, step, accepted, drafts[accepted]))
        else:  # every usable draft accepted, or a stop cut the step right after a kept draft
            out.append((last, BONUS if accepted == len(drafts) else ACCEPTED, step, accepted, None))
    return out


def as_tuples(origins: list[TokenOrigin]) -> list[tuple]:
    return [(o.token_id, o.kind, o.step, o.position, o.replaced_draft) for o in origins]


@needs_default_models
def test_origins_match_the_drafts_each_step_verified_and_the_engine_stats():
    llm = eagle3_llm()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_token_origins=True)
    before = llm.get_stats()
    with StepSpy(llm) as spy:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = llm.get_stats()
    kinds = set()
    for out in outs:
        c = out.outputs[0]
        assert [o.token_id for o in c.token_origins] == c.token_ids
        assert as_tuples(c.token_origins) == expected_origins(spy.steps[(out.request_id, 0)], greedy=True)
        kinds |= {o.kind for o in c.token_origins}
    assert {ACCEPTED, CORRECTED, BONUS, TARGET} <= kinds  # the head drafts well enough to show all
    # Nothing was cut (ignore_eos, no stops): the origins count exactly what the stats count.
    origins = [o for out in outs for o in out.outputs[0].token_origins]
    verifies = {(id(out), o.step): o.num_drafts for out in outs for o in out.outputs[0].token_origins
                if o.num_drafts}
    assert after["num_drafts"] - before["num_drafts"] == len(verifies)
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == sum(verifies.values())
    accepted = [o for o in origins if o.kind == ACCEPTED]
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == len(accepted)
    per_position = [sum(o.position == p for o in accepted) for p in range(3)]
    assert [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])] == per_position


@needs_default_models
def test_stop_strings_cut_the_origins_with_the_tokens():
    llm = eagle3_llm()
    params = SamplingParams(temperature=0, max_tokens=48, stop=["\n"], return_token_origins=True)
    with StepSpy(llm) as spy:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == "\n"
        assert [o.token_id for o in c.token_origins] == c.token_ids
        assert as_tuples(c.token_origins) == expected_origins(spy.steps[(out.request_id, 0)], greedy=True)


@needs_default_models
def test_sampled_n2_origins_follow_each_sample():
    llm = eagle3_llm()
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, return_token_origins=True)
    with StepSpy(llm) as spy:
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert [o.token_id for o in c.token_origins] == c.token_ids
        assert as_tuples(c.token_origins) == expected_origins(spy.steps[(out.request_id, c.index)], greedy=False)


@needs_default_models
def test_origins_are_off_by_default():
    out = eagle3_llm().generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_origins is None


@needs_default_models
def test_a_request_without_speculation_gives_the_same_tokens_and_drafts_nothing():
    llm = eagle3_llm()
    spec = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, return_token_origins=True)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, return_token_origins=True,
                           use_speculation=False)
    with_spec = llm.generate(PROMPTS, spec, use_tqdm=False)
    before = llm.get_stats()
    # mixed in one batch: the speculating requests keep drafting beside the plain ones
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [spec] * 3, use_tqdm=False)
    after = llm.get_stats()
    for a, b, c in zip(with_spec, mixed[:3], mixed[3:]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == c.outputs[0].token_ids
        assert {o.kind for o in b.outputs[0].token_origins} == {TARGET}
        assert ACCEPTED in {o.kind for o in c.outputs[0].token_origins}
    drafted_steps = {(i, o.step) for i, out in enumerate(mixed[3:]) for o in out.outputs[0].token_origins
                     if o.num_drafts}
    assert after["num_drafts"] - before["num_drafts"] == len(drafted_steps)
