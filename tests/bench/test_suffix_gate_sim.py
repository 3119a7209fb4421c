"""bench/suffix_gate_sim.py: the event model against hand-computed step costs, the simulation with
a scripted drafter against hand-summed clocks, the oracle against brute force over every schedule,
and the drafter with its real gate on synthetic traces (GSM8K-like: copies of the prompt between
random tokens; repetitive: the prompt copied over and over) under the H200 and slow-host costs."""

from __future__ import annotations

import itertools
import random

import pytest

from foretell.bench import suffix_gate_sim as sim
from foretell.spec_decode.suffix_tree import EMPTY_DRAFT, Draft

H200, SLOW = sim.COST_SETS["h200"], sim.COST_SETS["slow-host"]


def test_step_costs_follow_the_last_three_calls():
    c = sim.StepCosts(plain=1.0, draft=5.0, fallback=3.0, draft_first=7.0, after_fallback=2.0)
    assert c.step(True, False, False) == 7.0  # a run's first drafting step: the dropped plain step in it
    assert c.step(True, True, False) == 5.0
    assert c.step(False, True, True) == 3.0  # the fallback
    assert c.step(False, False, True) == 2.0  # the step after it
    assert c.step(False, False, False) == 1.0
    plain = sim.StepCosts(plain=1.0, draft=5.0, fallback=3.0)
    assert plain.step(True, False, False) == 5.0 and plain.step(False, False, True) == 1.0
    assert plain.baseline == 1.0 and sim.StepCosts(1.0, 5.0, 3.0, plain_engine=0.5).baseline == 0.5


def test_cost_sets_parse():
    assert sim.parse_costs("h200") is H200
    assert sim.parse_costs("1,4,2,6") == sim.StepCosts(plain=1.0, draft=4.0, fallback=2.0, draft_first=6.0)
    for bad in ("fast", "1,2", "1,2,3,4,5,6", "1,0,2", "a,b,c"):
        with pytest.raises(ValueError):
            sim.parse_costs(bad)


class ScriptedProposer:
    """Drafts a fixed number of the output's next tokens at the calls the script names."""

    def __init__(self, output: list[int], prompt_length: int, script: dict[int, int], k: int):
        self.output, self.prompt_length, self.script, self.k = output, prompt_length, script, k
        self.calls, self.bar = 0, 0.0

    def drop_cached_responses(self):
        pass

    def forget(self, seq_id):
        pass

    def stats(self):
        return {}

    def propose_drafts(self, batch):
        if batch.seq_ids[0] < 2:  # the bench's warm-up requests: not scripted
            return [EMPTY_DRAFT]
        pos = len(batch.histories[0]) - self.prompt_length
        n = self.script.get(self.calls, 0)
        self.calls += 1
        tokens = self.output[pos : pos + n]
        if n and self.calls == 3:  # one wrong token: accepts 1 of 2
            tokens = tokens[:1] + [-1]
        return [Draft(tokens, 4, float(len(tokens))) if tokens else EMPTY_DRAFT]


def test_the_simulated_clock_sums_the_event_model_by_hand():
    prompt, output = [1, 2, 3], list(range(10, 22))  # 12 tokens: the first from the prefill
    trace = {"prompts": [prompt], "outputs": [output]}
    c = sim.StepCosts(plain=1.0, draft=5.0, fallback=3.0, draft_first=7.0, after_fallback=2.0, request=10.0)
    script = {1: 3, 2: 2, 4: 1}  # call 0 plain, 1 drafts 3 (all taken), 2 drafts 2 (1 taken), 3 falls back
    run = sim.simulate(trace, c, 3, gate=0.0, proposer_factory=lambda k, g, clock: ScriptedProposer(output, 3, script, k))
    # calls: 0 plain (pos 1 -> 2), 1 draft first (-> 6), 2 draft (-> 8), 3 fallback (-> 9),
    # 4 draft first of 1 (-> 11), 5 fallback (-> 12, the end)
    assert run.steps == 6 and run.drafting_steps == 3 and run.drafted_tokens == 4 + 2 + 2
    assert run.seconds == pytest.approx(1e-3 * (10 + 1 + 7 + 5 + 3 + 7 + 3))
    assert run.tokens == 12
    plain = sim.plain_run(trace, c)
    assert plain.seconds == pytest.approx(1e-3 * (10 + 11)) and plain.tok_s == pytest.approx(12 / 21e-3)


def test_the_agreement_leaves_the_last_token_to_the_target():
    assert sim.agreement([5, 6, 7], [4, 5, 6, 7, 8], 1) == 3
    assert sim.agreement([5, 6, 7], [4, 5, 6, 7], 1) == 2  # the output's last token is the verify's own
    assert sim.agreement([5, 9, 7], [4, 5, 6, 7, 8], 1) == 1
    assert sim.agreement([], [4, 5], 1) == 0


def brute_force(rows, n: int, c: sim.StepCosts) -> float:
    """The least ms over every draft / no-draft choice per call."""
    best = float("inf")
    for choices in itertools.product((False, True), repeat=n):
        pos, before, before_2, total, i = 1, False, False, 0.0, 0
        while pos < n:
            length, accepted, _ = rows[pos - 1]
            drafted = choices[i] and length > 0
            total += c.step(drafted, before, before_2)
            pos = min(n, pos + 1 + accepted) if drafted else pos + 1
            before, before_2, i = drafted, before, i + 1
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_oracle_is_the_best_schedule(seed):
    rng = random.Random(seed)
    c = sim.StepCosts(plain=1.0, draft=rng.uniform(1.2, 4), fallback=rng.uniform(1, 3), draft_first=rng.uniform(1.2, 5),
                      after_fallback=rng.uniform(1, 2), request=0.0)
    n = 9
    rows = []
    for pos in range(1, n):
        length = rng.choice([0, 3])
        rows.append((length, rng.randint(0, min(length, n - pos - 1)) if length else 0, 0.0))
    assert sim.oracle_seconds([rows], [list(range(n))], c) == pytest.approx(1e-3 * brute_force(rows, n, c))


def mixed_trace(seed: int = 0, vocab: int = 8, n: int = 12, length: int = 128) -> dict:
    """GSM8K-like: 12-token copies of the prompt between stretches of random tokens of a small
    vocabulary (short chance matches whose drafts accept little)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompt = [100 + rng.randrange(400) for _ in range(48)]
        out: list[int] = []
        while len(out) < length:
            if rng.random() < 0.5:
                start = rng.randrange(32)
                out += prompt[start : start + 12]
            else:
                out += [rng.randrange(vocab) for _ in range(12)]
        prompts.append(prompt)
        outputs.append(out[:length])
    return {"prompts": prompts, "outputs": outputs}


def repeating_trace(n: int = 8, length: int = 128) -> dict:
    rng = random.Random(1)
    prompts = [[100 + rng.randrange(400) for _ in range(40)] for _ in range(n)]
    return {"prompts": prompts, "outputs": [(p * 4)[:length] for p in prompts]}


def test_gsm8k_like_drafts_stop_where_they_lose_under_h200_costs():
    rows = sim.compare(mixed_trace(), H200, 3, ("auto", 1.0))
    auto, fixed = rows["suffix auto"], rows["suffix 1.0"]
    assert fixed["vs_plain"] < 0.9  # drafting loses at these costs
    assert auto["vs_plain"] >= 0.97 and auto["drafting_share"] < 0.02


def test_gsm8k_like_drafts_go_on_where_they_pay_on_a_slow_host():
    auto = sim.compare(mixed_trace(), SLOW, 3, ("auto",))["suffix auto"]
    assert auto["vs_plain"] > 1.05 and auto["drafting_share"] > 0.1


@pytest.mark.parametrize("costs", [H200, SLOW])
def test_repetitive_traces_keep_drafting(costs):
    rows = sim.compare(repeating_trace(), costs, 16, ("auto",))
    assert rows["suffix auto"]["vs_plain"] > 1.5 and rows["suffix auto"]["vs_oracle"] > 0.85


def test_the_cli_prints_a_table(tmp_path, capsys):
    import json

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(mixed_trace(n=3)))
    sim.main(["--trace", str(path), "--costs", "h200;1,2,1.5", "--gates", "auto,1.0", "--jitter", "0.1"])
    out = capsys.readouterr().out
    assert "costs h200" in out and "costs 1,2,1.5" in out and out.count("suffix auto") == 2


def test_the_noise_keeps_each_interval_s_mean():
    n = 20000
    for costs, mean in [(sim.StepCosts(1.0, 2.0, 1.5, jitter=0.4, spell=0.9), 1.0),
                        (sim.StepCosts(1.0, 2.0, 1.5, tail_share=0.25, tail_ms=0.4), 1.1)]:
        noise = sim.IntervalNoise(costs, 0)
        assert sum(noise.apply(1.0) for _ in range(n)) / n == pytest.approx(mean, rel=0.05)
    tail = sim.IntervalNoise(sim.StepCosts(1.0, 2.0, 1.5, tail_share=0.5, tail_ms=3.0), 1)
    assert {tail.apply(1.0) for _ in range(50)} == {1.0, 4.0}  # additive, the same extra for any step
    assert sim.StepCosts(1.0, 2.0, 1.5, tail_share=0.25, tail_ms=0.4).baseline == pytest.approx(1.1)
    assert sim.IntervalNoise(sim.StepCosts(1.0, 2.0, 1.5), 0).apply(0.7) == 0.7
    for bad in (dict(spell=1.0), dict(tail_share=1.5), dict(tail_ms=-1.0), dict(jitter=-0.1)):
        with pytest.raises(ValueError):
            sim.IntervalNoise(sim.StepCosts(1.0, 2.0, 1.5, **bad), 0)


def test_a_correlated_jitter_drifts_in_spells():
    noise = sim.IntervalNoise(sim.StepCosts(1.0, 2.0, 1.5, jitter=0.3, spell=0.95), 2)
    logs = [__import__("math").log(noise.apply(1.0)) for _ in range(5000)]
    mean = sum(logs) / len(logs)
    lag1 = sum((a - mean) * (b - mean) for a, b in zip(logs, logs[1:])) / sum((a - mean) ** 2 for a in logs)
    assert lag1 == pytest.approx(0.95, abs=0.03)


def test_slow_steps_on_a_cheap_plain_step_leave_the_gate_off_gsm8k_like_drafts():
    c = sim.StepCosts(plain=0.14, draft=0.72, fallback=0.50, jitter=0.2, tail_share=0.3, tail_ms=0.3)
    auto = sim.compare(mixed_trace(), c, 3, ("auto",))["suffix auto"]
    assert auto["vs_plain"] >= 0.98


def test_the_cli_takes_the_noise(tmp_path, capsys):
    import json

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(mixed_trace(n=2)))
    sim.main(["--trace", str(path), "--costs", "h200", "--gates", "auto", "--jitter", "0.2", "--spell", "0.9",
              "--tail", "0.3,0.3"])
    out = capsys.readouterr().out
    assert "spell=0.9" in out and "tail_share=0.3" in out and "tail_ms=0.3" in out
