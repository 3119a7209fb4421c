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
loaded machine inflates much less (a shared 2-core CI box can show 10x the wall time).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings


def _workload(rng: random.Random, prompt_len: int, output_len: int, vocab: int) -> tuple[list[int], list[int]]:
    # A prompt with some internal repetition (code has it), and an output that rewrites a piece
    # of it with a token changed now and then.
    base = [rng.randrange(vocab) for _ in range(prompt_len // 2)]
    prompt = base + [t if rng.random() > 0.1 else rng.randrange(vocab) for t in base]
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
                      settings: SuffixSettings | None = None) -> dict:
    """Mean microseconds of one decode step's propose() over a batch of batch_size sequences, per
    step and per sequence; the mean tokens each step emitted per sequence (accepted + 1); the
    mean milliseconds of a sequence's first propose (its prompt inserted: the prefill step) and
    of a finished sequence's forget (its response cached). Wall times, and *_cpu the thread's
    CPU times."""
    rng = random.Random(seed)
    proposer = SuffixProposer(k, settings)
    max_model_len = prompt_len + output_len + k + 8
    next_id = 0
    seqs = []  # [seq_id, history, output, emitted]

    def new_seq():
        nonlocal next_id
        prompt, output = _workload(rng, prompt_len, output_len, vocab)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=16)
    args = parser.parse_args(argv)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        r = measure_host_cost(b, args.num_steps, args.k)
        print(f"batch {b:3d}: {r['us_per_step']:8.1f} us/step  {r['us_per_sequence']:6.1f} us/sequence  "
              f"prefill {r['prefill_ms']:.2f} ms  forget {r['forget_ms']:.2f} ms  (wall)  |  "
              f"{r['us_per_step_cpu']:8.1f} us/step  {r['us_per_sequence_cpu']:6.1f} us/sequence  "
              f"prefill {r['prefill_ms_cpu']:.2f} ms  forget {r['forget_ms_cpu']:.2f} ms  (thread CPU)  |  "
              f"{r['tokens_per_sequence_step']:.2f} tokens/sequence/step, {r['cached_responses']} cached responses")


if __name__ == "__main__":
    main()
