"""Host time of the suffix drafter per engine step, without a model: `python -m
foretell.bench.suffix_host_cost [--batch-sizes 1,16]`.

Each simulated sequence has a prompt and a known output the "target" emits (a copy of a piece of
the prompt with a few tokens changed, the shape of "rewrite this with one change"). Every step
the drafter proposes for every sequence, the step accepts the longest prefix of the draft that
matches the known output plus one token (what greedy verification does), and the next step's
history grows by those tokens. What is timed is SuffixProposer.propose over the batch: the
incremental index updates, the matching and the drafts. Finished sequences are forgotten (their
response joins the global cache) and replaced by new ones, so the cache is exercised too.

Each time is taken twice: wall (perf_counter) and this thread's CPU time (thread_time), which a
loaded machine inflates much less than the wall time on a shared 2-core CI box.

`--workload loop` is the hard case for the matching instead: each output repeats a short pattern
(1-4 tokens, one of a few shared by all sequences: a list, a table, a run of one token), so every
gram has many occurrences, in the sequence's own index and in the global cache's earlier responses,
the matches keep running into a response's end, and the walk follows up to MAX_CANDIDATES
occurrences at once (what the stubbed engine's constant tokens give: `--engine --stub-forward`).
`--repeat N` runs the no-model mode N times and prints each figure's median too.

`--paused` holds every sequence in the acceptance gate's pause (no lookup, no draft: what a
sequence whose drafts are not accepted costs between its probes), set between steps, untimed.

`--engine` times whole engine steps instead (measure_engine_steps): the shipped default target with
a host drafter (suffix or n-gram) on the repetitive prompt set, batches of --batch-sizes prompts
at once, the process's CPU time per engine step, and, in a second run of the same prompts, what
each step asks of the device: reads back to the host (Tensor.tolist / item / cpu / numpy), host
lists made into tensors (torch.tensor: to_device's copies), torch calls in all, and those made
while the drafter's batch is built and it proposes (a host drafter should make none). `--method
none` is plain decoding, the yardstick; `--stub-forward` takes the target's arithmetic out and
runs the GPU's step pipeline on the CPU (bench/stub_target.py: steps queued ahead), so the CPU
time per step is the host's work per step; `--repeat N` runs the given methods N times
interleaved and prints each one's median (the shared 2-core box drifts between runs).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_tree import Match

PAUSED = 1 << 62  # a resume_at no sequence reaches


def pause_all(proposer) -> None:
    """Every sequence the suffix drafter (or a hybrid's suffix side) holds, in the gate's pause:
    what the gate does to a sequence whose draft was not accepted, held for good."""
    suffix = getattr(proposer, "suffix", proposer)  # a bench's probe, not engine code
    for state in suffix.states.values():
        if state.resume_at != PAUSED:
            state.resume_at, state.last_draft = PAUSED, []
            state.own_match, state.cache_match = Match(), Match()


WORKLOADS = ("rewrite", "loop")
LOOP_PATTERNS = ([7], [11, 12], [21, 22, 23], [31, 32, 33, 34])  # the loop workload's outputs repeat one


def _workload(rng: random.Random, prompt_len: int, output_len: int, vocab: int,
              workload: str = "rewrite") -> tuple[list[int], list[int]]:
    # A prompt with some internal repetition (code has it), and an output that rewrites a piece
    # of it with a token changed now and then ("rewrite"), or repeats a short pattern ("loop").
    base = [rng.randrange(vocab) for _ in range(prompt_len // 2)]
    prompt = base + [t if rng.random() > 0.1 else rng.randrange(vocab) for t in base]
    if workload == "loop":
        pattern = LOOP_PATTERNS[rng.randrange(len(LOOP_PATTERNS))]
        return prompt, (pattern * (output_len // len(pattern) + 1))[:output_len]
    start = rng.randrange(max(1, len(prompt) - output_len))
    output = [t if rng.random() > 0.03 else rng.randrange(vocab) for t in prompt[start : start + output_len]]
    while len(output) < output_len:
        output.append(rng.randrange(vocab))
    return prompt, output


def _batch(histories: list[list[int]], seq_ids: list[int], max_model_len: int) -> DraftBatch:
    n = len(histories)
    empty = torch.empty(0)
    return DraftBatch(
        start_positions=[len(h) - 2 for h in histories], num_valid_rows=[1] * n,
        next_token_ids=[h[-1] for h in histories], samples=[True] * n, token_ids=empty,
        hidden_states=empty, aux_hidden_states=[], block_table=empty, block_size=16,
        sampling_params=[None] * n, sample_indices=[0] * n, max_model_len=max_model_len,
        histories=histories, seq_ids=seq_ids,
    )


def measure_host_cost(batch_size: int, num_steps: int = 200, k: int = 16, prompt_len: int = 512,
                      output_len: int = 256, vocab: int = 4096, seed: int = 0,
                      settings: SuffixSettings | None = None, paused: bool = False,
                      workload: str = "rewrite") -> dict:
    """Mean microseconds of one decode step's propose() over a batch of batch_size sequences, per
    step and per sequence; the mean tokens each step emitted per sequence (accepted + 1); the
    mean milliseconds of a sequence's first propose (its prompt inserted: the prefill step) and
    of a finished sequence's forget (its response cached). Wall times, and *_cpu the thread's
    CPU times. paused: every sequence held in the gate's pause after its prefill (pause_all).
    workload: "rewrite" or "loop" (module docstring)."""
    if workload not in WORKLOADS:
        raise ValueError(f"suffix_host_cost workload must be one of {WORKLOADS}, got {workload!r}")
    rng = random.Random(seed)
    proposer = SuffixProposer(k, settings)
    max_model_len = prompt_len + output_len + k + 8
    next_id = 0
    seqs = []  # [seq_id, history, output, emitted]

    def new_seq():
        nonlocal next_id
        prompt, output = _workload(rng, prompt_len, output_len, vocab, workload)
        next_id += 1
        return [next_id, prompt + [output[0]], output, 1]

    seqs = [new_seq() for _ in range(batch_size)]
    wall, cpu = time.perf_counter, time.thread_time
    totals = {"step": [0.0, 0.0], "prefill": [0.0, 0.0], "forget": [0.0, 0.0]}

    def timed(part, fn, *args):
        w0, c0 = wall(), cpu()
        result = fn(*args)
        totals[part][0] += wall() - w0
        totals[part][1] += cpu() - c0
        return result

    # the first step of each sequence inserts its whole prompt (a prefill): timed apart
    proposal = timed("prefill", proposer.propose, _batch([s[1] for s in seqs], [s[0] for s in seqs], max_model_len))
    emitted, num_prefills, num_forgets = 0, batch_size, 0
    for _ in range(num_steps):
        for i, seq in enumerate(seqs):
            seq_id, history, output, done = seq
            draft = proposal.token_ids[i]
            accepted = 0
            while accepted < len(draft) and done + accepted < len(output) and draft[accepted] == output[done + accepted]:
                accepted += 1
            new = output[done : done + accepted + 1]
            history.extend(new)
            seq[3] = done + len(new)
            emitted += len(new)
            if seq[3] >= len(output):
                timed("forget", proposer.forget, seq_id)
                num_forgets += 1
                seqs[i] = new_seq()
                # its prefill step inserts the prompt: timed apart from the decode steps
                timed("prefill", proposer.propose, _batch([seqs[i][1]], [seqs[i][0]], max_model_len))
                num_prefills += 1
        if paused:
            pause_all(proposer)
        batch = _batch([s[1] for s in seqs], [s[0] for s in seqs], max_model_len)
        proposal = timed("step", proposer.propose, batch)
    result = {"batch_size": batch_size}
    for column, clock in (("", 0), ("_cpu", 1)):
        step_s = totals["step"][clock]
        result[f"us_per_step{column}"] = 1e6 * step_s / num_steps
        result[f"us_per_sequence{column}"] = 1e6 * step_s / (num_steps * batch_size)
        result[f"prefill_ms{column}"] = 1e3 * totals["prefill"][clock] / num_prefills
        result[f"forget_ms{column}"] = 1e3 * totals["forget"][clock] / max(1, num_forgets)
    result["tokens_per_sequence_step"] = emitted / (num_steps * batch_size)
    result["cached_responses"] = len(proposer.cache)
    return result


READ_BACKS = frozenset({"tolist", "item", "cpu", "numpy"})


class _StepCalls(TorchFunctionMode):
    """Counts the torch calls made under it: reads back to the host, torch.tensor (a host list
    made a tensor: to_device), all, and all while `drafting` is set."""

    def __init__(self):
        super().__init__()
        self.counts = {"read_backs": 0, "tensors_from_lists": 0, "torch_calls": 0, "drafter_torch_calls": 0}
        self.drafting = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        counts = self.counts
        counts["torch_calls"] += 1
        counts["drafter_torch_calls"] += self.drafting
        counts["read_backs"] += name in READ_BACKS
        counts["tensors_from_lists"] += func is torch.tensor
        return func(*args, **(kwargs or {}))


def measure_engine_steps(batch_size: int, method: str = "suffix", num_prompts: int | None = None,
                         max_tokens: int = 48, k: int | None = None, count_calls: bool = True,
                         paused: bool = False, stub_forward: bool = False, stub_tokens: str = "constant",
                         speculative_options: dict | None = None, time_propose: bool = False) -> dict:
    """CPU seconds per engine step (the process's, one intra-op thread) of the default target with
    a host drafter (method "none": plain decoding) on the repetitive prompts, batch_size at once
    (num_prompts, default 2 x batch_size, greedy, max_tokens each), and per step the torch calls it
    makes (count_calls: a second run under _StepCalls, whose own overhead the timed run does not
    carry). paused: every sequence held in the gate's pause (pause_all, between steps);
    stub_forward: the target's arithmetic stubbed, the GPU's step pipeline (bench/stub_target.py,
    its tokens: stub_tokens); speculative_options: more speculative_config fields; time_propose: the
    drafter's propose timed in the timed run too (this thread's CPU microseconds a call, median and
    mean: its host work inside the engine, caches as the engine's step leaves them)."""
    from foretell import LLM, SamplingParams
    from foretell.bench.repetitive import repetitive_prompts
    from foretell.bench.stub_target import stubbed_target
    from foretell.defaults import default_target

    if method == "none":
        spec = None
    else:
        spec = {"method": method, **(speculative_options or {})}
        if k is not None:
            spec["num_speculative_tokens"] = k
    prompts = [p.text for p in repetitive_prompts(num_prompts or 2 * batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    result = {"batch_size": batch_size, "method": method, "num_prompts": len(prompts)}
    for counting in (False, True) if count_calls else (False,):
        # the stub takes the GPU's path: steps queued ahead (async scheduling, off by default on the CPU)
        llm = LLM(default_target(), dtype="float32", num_kv_blocks=1024, max_num_seqs=batch_size,
                  num_cpu_threads=1, speculative_config=spec, log_stats_interval_s=0,
                  async_scheduling="on" if stub_forward else "auto")
        engine = llm.engine
        proposer = engine.runner.proposer
        mode = _StepCalls() if counting else None
        propose_s: list[float] = []
        if time_propose and not counting and proposer is not None:
            untimed = proposer.propose

            def timed_propose(batch, _propose=untimed):
                c0 = time.thread_time()
                try:
                    return _propose(batch)
                finally:
                    propose_s.append(time.thread_time() - c0)

            proposer.propose = timed_propose
        if mode is not None and proposer is not None:
            propose = proposer.propose

            def marked_propose(batch, _propose=propose):
                mode.drafting = True
                try:
                    return _propose(batch)
                finally:
                    mode.drafting = False

            proposer.propose = marked_propose
            host_step = engine.runner.host_step  # the host step builds the drafter's batch there
            host_propose = host_step.propose

            def marked_host_propose(*args, _propose=host_propose):
                mode.drafting = True
                try:
                    return _propose(*args)
                finally:
                    mode.drafting = False

            host_step.propose = marked_host_propose
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        steps, cpu_s, wall_s = 0, 0.0, 0.0
        stub = stubbed_target(llm, stub_tokens) if stub_forward else contextlib.nullcontext()
        with stub:
            if mode is not None:
                mode.__enter__()
            try:
                while engine.has_unfinished_requests():
                    if paused and proposer is not None:
                        pause_all(proposer)
                    c0, w0 = time.process_time(), time.perf_counter()
                    engine.step()
                    cpu_s += time.process_time() - c0
                    wall_s += time.perf_counter() - w0
                    steps += 1
            finally:
                if mode is not None:
                    mode.__exit__(None, None, None)
        stats = llm.get_stats()
        if counting:
            result.update({f"{name}_per_step": n / steps for name, n in mode.counts.items()})
        else:
            runner = engine.runner
            result.update(
                steps=steps, cpu_ms_per_step=1e3 * cpu_s / steps, wall_ms_per_step=1e3 * wall_s / steps,
                mean_acceptance_length=stats.get("mean_acceptance_length", 0.0),
                gate_bar=stats.get("suffix_gate", {}).get("bar"),
                padded_steps=sum(getattr(kind, "num_steps", 0) for kind in runner.pipeline.kinds),
            )
            if propose_s:
                result.update(propose_calls=len(propose_s), propose_us_median=1e6 * statistics.median(propose_s),
                              propose_us_mean=1e6 * statistics.fmean(propose_s))
        del llm, engine, proposer
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--paused", action="store_true", help="every sequence held in the gate's pause")
    parser.add_argument("--engine", action="store_true", help="time whole engine steps (measure_engine_steps)")
    parser.add_argument("--method", default="suffix",
                        help="with --engine: suffix, ngram or none (plain decoding), or several comma-separated "
                             "(run interleaved)")
    parser.add_argument("--max-tokens", type=int, default=48, help="with --engine")
    parser.add_argument("--num-prompts", type=int, default=None, help="with --engine (default: 2 x batch)")
    parser.add_argument("--no-count-calls", action="store_true", help="with --engine: time only")
    parser.add_argument("--stub-forward", action="store_true",
                        help="with --engine: the target's arithmetic stubbed, the GPU's step pipeline")
    parser.add_argument("--stub-tokens", default="constant", choices=["constant", "fresh"],
                        help="with --stub-forward: the stub's tokens (bench/stub_target.py)")
    parser.add_argument("--time-propose", action="store_true",
                        help="with --engine: time the drafter's propose calls too (thread CPU, median and mean)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs (with --engine: of each method, interleaved); medians printed")
    parser.add_argument("--workload", default="rewrite", choices=WORKLOADS, help="without --engine (module docstring)")
    args = parser.parse_args(argv)
    if args.engine:
        methods = args.method.split(",")
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            cpu_ms: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.repeat):
                for method in methods:
                    r = measure_engine_steps(b, method, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                             k=args.k, count_calls=not args.no_count_calls, paused=args.paused,
                                             stub_forward=args.stub_forward, stub_tokens=args.stub_tokens,
                                             time_propose=args.time_propose)
                    cpu_ms[method].append(r["cpu_ms_per_step"])
                    print(" ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                                   for key, value in r.items()), flush=True)
            if args.repeat > 1 or len(methods) > 1:
                medians = {m: statistics.median(v) for m, v in cpu_ms.items()}
                base = medians.get("none")
                print(f"batch {b}: median CPU ms per step " + ", ".join(
                    f"{m} {t:.3f}" + (f" ({t / base:.3f}x none)" if base and m != "none" else "")
                    for m, t in medians.items()), flush=True)
        return
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        runs = [measure_host_cost(b, args.num_steps, args.k, paused=args.paused, workload=args.workload)
                for _ in range(args.repeat)]
        r = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        if args.repeat > 1:
            print(f"batch {b:3d}: us/step (thread CPU) of the {args.repeat} runs: "
                  + ", ".join(f"{run['us_per_step_cpu']:.1f}" for run in runs) + "; medians:")
        print(f"batch {b:3d}: {r['us_per_step']:8.1f} us/step  {r['us_per_sequence']:6.1f} us/sequence  "
              f"prefill {r['prefill_ms']:.2f} ms  forget {r['forget_ms']:.2f} ms  (wall)  |  "
              f"{r['us_per_step_cpu']:8.1f} us/step  {r['us_per_sequence_cpu']:6.1f} us/sequence  "
              f"prefill {r['prefill_ms_cpu']:.2f} ms  forget {r['forget_ms_cpu']:.2f} ms  (thread CPU)  |  "
              f"{r['tokens_per_sequence_step']:.2f} tokens/sequence/step, {r['cached_responses']:.0f} cached responses")


if __name__ == "__main__":
    main()
