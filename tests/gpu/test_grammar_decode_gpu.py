"""On a CUDA GPU: grammar requests of plain decoding (no drafter) decode on DecodeAhead
(runner/decode_ahead.py, issues 27 and 31): the target's captured graph for the forward, the
masks uploaded once and applied after it. fp32, the fixtures: greedy and seeded-sampled output
under a JSON schema, a regex, a choice and a grammar equals the host step's (the same engine with
async_scheduling off) token for token and matches its constraint; a grammar decode step reads the
device at most twice (its tokens, and the mask buffer's last copy event) and replays the
target's graph for its forward (as the host step does; queued ahead, with its inputs moved on the
device). Prints eager ops, syncs, the grammar decode
step's mean time (synchronised, so no overlap) and each form's wall time over the whole set (with
overlap)."""

from __future__ import annotations

import time

import pytest
import torch

from fixtures.grammar_prompts import PROMPTS, constraints
from foretell import LLM, SamplingParams
from foretell.bench.op_counter import OpCounter
from foretell.runner.decode_ahead import DecodeAhead

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


def structured_cases() -> list[dict]:
    return [{"json": SCHEMA, "disable_any_whitespace": True}] + [s for s, _ in constraints()]


def run(llm, temperature: float, steps: list | None = None) -> list:
    """Each constraint's token ids; with `steps`, (decode step with a grammar?, eager ops, seconds)
    per engine step appended."""
    runner = llm.engine.runner
    execute = runner.execute

    def counted(sched):
        counter = OpCounter()
        torch.cuda.synchronize()
        started = time.perf_counter()
        with counter:
            out = execute(sched)
        torch.cuda.synchronize()
        decode = all(item.num_new_tokens == 1 for item in sched.scheduled) and any(
            item.seq.sampling_params.structured_outputs is not None for item in sched.scheduled)
        steps.append((decode, counter.count, time.perf_counter() - started))
        return out

    if steps is not None:
        runner.execute = counted
    try:
        results = []
        for structured in structured_cases():
            params = SamplingParams(temperature=temperature, seed=5 if temperature else None, max_tokens=40,
                                    structured_outputs=structured)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            results.append([(out.outputs[0].token_ids, out.outputs[0].finish_reason) for out in outs])
        return results
    finally:
        if steps is not None:
            del runner.execute


def timed(fn, *args) -> float:
    """Seconds `fn(*args)` took, the device drained at both ends."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def engine(checkpoint, mode):
    return LLM(checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, async_scheduling=mode)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_decode_on_the_graphs_equals_the_host_step(qwen3_checkpoint, temperature):
    host_steps, device_steps = [], []
    walls = {}
    with engine(qwen3_checkpoint, "off") as reference:
        walls["host step"] = timed(run, reference, temperature)  # also the warm-up
        expected = run(reference, temperature, host_steps)
    with engine(qwen3_checkpoint, "auto") as llm:
        (kind,) = [k for k in llm.engine.runner.pipeline.kinds if isinstance(k, DecodeAhead)]
        assert kind.structured is not None and kind.graphs is not None and kind.graphs.captures
        run(llm, temperature)
        walls["DecodeAhead"] = timed(run, llm, temperature)
        before, replays = kind.num_grammar_steps, []
        replay, advance = kind.graphs.run, kind.graphs.advance_decode
        # The forward's replays: from host inputs (run) or, queued ahead, inputs moved on the device.
        kind.graphs.run = lambda *args: (replays.append(args), replay(*args))[1]
        kind.graphs.advance_decode = lambda *args: (replays.append(args), advance(*args))[1]
        try:
            got = run(llm, temperature, device_steps)
        finally:
            del kind.graphs.run, kind.graphs.advance_decode
        assert kind.num_grammar_steps > before
        assert len(replays) >= kind.num_grammar_steps - before  # every grammar decode step replayed the forward
    assert got == expected
    host = [(ops, s) for decode, ops, s in host_steps if decode]
    device = [(ops, s) for decode, ops, s in device_steps if decode]
    assert host and device

    def mean(values):
        return sum(values) / len(values)

    print(f"grammar decode steps (T={temperature}): host step {mean([o for o, _ in host]):.0f} eager ops, "
          f"{1e3 * mean([s for _, s in host]):.2f} ms; DecodeAhead {mean([o for o, _ in device]):.0f} eager ops, "
          f"{1e3 * mean([s for _, s in device]):.2f} ms; whole set: "
          + ", ".join(f"{name} {wall:.2f} s" for name, wall in walls.items()))


def test_a_grammar_decode_step_reads_the_device_at_most_twice(qwen3_checkpoint):
    from foretell.bench.device_syncs import syncs_per_step

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, structured_outputs={"regex": r"(.|\n)*"})
    with engine(qwen3_checkpoint, "auto") as llm:
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
        steps, _ = syncs_per_step(llm, [PROMPTS[0]], params)
    counts = [c for _, c in steps[1:]]  # after the prefill
    print("syncs per grammar decode step:", [c["syncs"] for c in counts])
    assert counts and all(c["syncs"] <= 2 for c in counts), [c["sites"] for c in counts]
