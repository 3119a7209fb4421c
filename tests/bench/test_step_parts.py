"""foretell.bench.step_parts: the timers wrap each part and put it back, the per-step table divides
by the engine's steps, the median and longest step, and a small run of the default target reports
every step's parts."""

from __future__ import annotations

import foretell.engine.scheduler as scheduler_module
from foretell.bench.step_parts import PARTS, PartTimers, format_parts, measure


def test_timers_wrap_and_restore_every_part():
    original = scheduler_module.Scheduler.schedule
    timers = PartTimers()
    with timers.install():
        assert scheduler_module.Scheduler.schedule is not original
    assert scheduler_module.Scheduler.schedule is original
    assert len({(m, o, n) for m, o, n in PARTS}) == len(PARTS)


def test_per_step_divides_by_engine_steps():
    timers = PartTimers()
    timers.seconds.update({"Engine.step": 0.004, "Scheduler.schedule": 0.001})
    timers.calls.update({"Engine.step": 4, "Scheduler.schedule": 4})
    parts = timers.per_step()
    assert list(parts) == ["Engine.step", "Scheduler.schedule"]
    assert parts["Engine.step"] == {"us": 1000.0, "calls": 1.0}
    assert parts["Scheduler.schedule"] == {"us": 250.0, "calls": 1.0}


def test_a_small_plain_run_reports_its_steps():
    result = measure("none", 1, "gsm8k", num_prompts=1, max_tokens=4, batch_size=1, device="cpu")
    assert result["tokens"] == 4 and result["steps"] >= 4
    assert result["parts"]["Engine.step"]["calls"] == 1.0
    assert result["parts"]["ModelRunner.execute"]["us"] <= result["parts"]["Engine.step"]["us"]
    assert "Engine.step" in format_parts(result)
    assert 0.0 < result["median_ms"] <= result["longest_ms"] and result["jit_compiles"] == 0  # (no Triton on the CPU)


def test_step_spread_gives_the_median_and_the_longest_step():
    timers = PartTimers()
    assert timers.step_spread() == {"median_ms": 0.0, "longest_ms": 0.0}
    timers.step_seconds.extend([0.002, 0.001, 0.859, 0.001])
    assert timers.step_spread() == {"median_ms": 2.0, "longest_ms": 859.0}
