"""foretell.bench.step_kinds: each step's kind from the scheduler's decision and the step before, the
tokens each kind emitted, and a real run's kinds adding up to its steps and tokens."""

from __future__ import annotations

from types import SimpleNamespace

import foretell.engine.engine as engine_module
from foretell.bench.step_kinds import StepKinds, format_kinds, step_kind
from foretell.bench.step_parts import measure


def _item(new_tokens: int, drafts: list[int], samples: bool = True):
    return SimpleNamespace(num_new_tokens=new_tokens, draft_token_ids=drafts, samples=samples)


def _sched(*items):
    return SimpleNamespace(scheduled=list(items))


def test_a_step_is_sorted_by_its_rows_and_the_step_before():
    decode, verify = _item(1, []), _item(3, [7, 8])
    assert step_kind(_sched(_item(5, [], samples=False), decode), None) == "prefill"
    assert step_kind(_sched(_item(4, [])), "plain") == "prefill"  # prompt rows that sample: a last chunk
    assert step_kind(_sched(decode, verify), "plain") == "drafting"
    assert step_kind(_sched(decode), "drafting") == "fallback"
    assert step_kind(_sched(decode), "fallback") == "plain"
    assert step_kind(_sched(decode), None) == "plain"


def test_tokens_are_counted_per_sequence_between_its_steps():
    kinds = StepKinds()
    seq = SimpleNamespace(seq_id=3, num_output_tokens=1)
    kinds._sched = _sched(SimpleNamespace(seq=seq, num_new_tokens=1, draft_token_ids=[], samples=True))
    kinds._record(0.001)  # plain: 1 token
    seq.num_output_tokens = 4
    kinds._sched = _sched(SimpleNamespace(seq=seq, num_new_tokens=3, draft_token_ids=[5, 6], samples=True))
    kinds._record(0.002)  # drafting: 3 tokens
    table = kinds.table()
    assert table["plain"] == {"steps": 1, "ms": 1.0, "ms_per_step": 1.0, "tokens": 1, "tokens_per_ms": 1.0}
    assert table["drafting"]["tokens"] == 3 and table["drafting"]["tokens_per_ms"] == 1.5
    assert "fallback" not in table and "| drafting | 1 |" in format_kinds(table)


def test_install_puts_the_engine_back():
    original = engine_module.Engine.step
    with StepKinds().install():
        assert engine_module.Engine.step is not original
    assert engine_module.Engine.step is original


def test_a_suffix_run_accounts_for_every_step_and_token():
    result = measure("suffix", 4, "repetitive", num_prompts=1, max_tokens=24, batch_size=1, device="cpu")
    kinds = result["step_kinds"]
    assert sum(r["steps"] for r in kinds.values()) == result["steps"]
    assert sum(r["tokens"] for r in kinds.values()) == result["tokens"]
    assert "drafting" in kinds  # the measured run re-asks the warm-up's prompt: its answer is cached
