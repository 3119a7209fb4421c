"""Host time of the suffix drafter per engine step, without a model: `python -m
foretell.bench.suffix_host_cost [--batch-sizes 1,16]`.

Each simulated sequence has a prompt and a known output the "target" emits (a copy of a piece of
the prompt with a few tokens changed, the shape of "rewrite this with one change"). Every step
the drafter proposes for every sequence, the step accepts the longest prefix of the draft that
matches the known output plus one token (what greedy verification does), and the next step's
history grows by those tokens. What is timed is SuffixProposer.propose over the batch: the
incremental trie updates, the matching and the drafts. Finished sequences are forgotten (their
response joins the global cache) and replaced by new ones, so the cache is exercised too.
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
    step and per sequence; the mean tokens each step emitted per sequence (accepted + 1); and the
    mean milliseconds of a sequence's first propose (its prompt inserted: the prefill step)."""
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
    # the first step of each sequence inserts its whole prompt (a prefill): timed apart
    t0 = time.perf_counter()
    proposal = proposer.propose(_batch([s[1] for s in seqs], [s[0] for s in seqs], max_model_len))
    first_step_s = time.perf_counter() - t0
    total_s, emitted = 0.0, 0
    prefill_s, num_prefills = first_step_s, batch_size
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
                proposer.forget(seq_id)
                seqs[i] = new_seq()
                # its prefill step inserts the prompt: timed apart from the decode steps
                t0 = time.perf_counter()
                proposer.propose(_batch([seqs[i][1]], [seqs[i][0]], max_model_len))
                prefill_s += time.perf_counter() - t0
                num_prefills += 1
        batch = _batch([s[1] for s in seqs], [s[0] for s in seqs], max_model_len)
        t0 = time.perf_counter()
        proposal = proposer.propose(batch)
        total_s += time.perf_counter() - t0
    return {
        "batch_size": batch_size,
        "us_per_step": 1e6 * total_s / num_steps,
        "us_per_sequence": 1e6 * total_s / (num_steps * batch_size),
        "tokens_per_sequence_step": emitted / (num_steps * batch_size),
        "prefill_ms": 1e3 * prefill_s / num_prefills,
        "cached_responses": len(proposer.cache),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=16)
    args = parser.parse_args(argv)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        r = measure_host_cost(b, args.num_steps, args.k)
        print(f"batch {b:3d}: {r['us_per_step']:8.1f} us/step  {r['us_per_sequence']:6.1f} us/sequence  "
              f"{r['tokens_per_sequence_step']:.2f} tokens/sequence/step  prefill {r['prefill_ms']:.1f} ms  "
              f"cached responses {r['cached_responses']}")


if __name__ == "__main__":
    main()
