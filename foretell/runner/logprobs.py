"""Log-probabilities for the requests that ask: of the prompt tokens a prefill chunk predicts,
and of the tokens a step emits, each with the request's top-n alternatives (raw model
distribution, before temperature and truncation; sampler.compute_logprobs)."""

from __future__ import annotations

import torch

from foretell.device_util import to_device
from foretell.engine.sequence import Logprob
from foretell.layers.sampler import compute_logprobs
from foretell.runner.input_batch import InputBatch


def add_prompt_logprobs(model, sched, batch: InputBatch, hidden: torch.Tensor, results: list) -> None:
    """Log-probs of the prompt tokens this step's prefill rows predict (for requests that ask;
    positions already recorded before a preemption are not recorded twice)."""
    rows, targets, owners = [], [], []
    for i, item in enumerate(sched.scheduled):
        seq = item.seq
        if seq.sampling_params.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        for r in range(item.num_new_tokens - len(item.draft_token_ids)):
            position = start + r  # its row predicts prompt token position + 1
            if position + 1 >= seq.num_prompt_tokens:
                break
            if position >= len(seq.prompt_logprobs):
                rows.append(batch.query_start[i] + r)
                targets.append(seq.prompt_token_ids[position + 1])
                owners.append(i)
    if not rows:
        return
    logits = model.compute_logits(hidden[to_device(rows, torch.int64, hidden.device)])
    num_top = max(sched.scheduled[i].seq.sampling_params.prompt_logprobs for i in set(owners))
    chosen, top_vals, top_ids = compute_logprobs(
        logits, to_device(targets, torch.int64, hidden.device), num_top
    )
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    for j, (i, token) in enumerate(zip(owners, targets)):
        want = sched.scheduled[i].seq.sampling_params.prompt_logprobs
        top = dict(zip(top_ids[j][:want], top_vals[j][:want]))
        results[i].prompt_logprobs.append(Logprob(token, chosen[j], top))


def add_logprobs(logits, rows, tokens, sampling, batch: InputBatch, sched, results: list) -> None:
    """Log-probs of the tokens each sampling sequence emitted this step (logits rows `rows`, or
    all rows when None), with the top-n alternatives its request asked for."""
    picked = logits if rows is None else logits[rows]
    chosen, top_vals, top_ids = compute_logprobs(picked, tokens, sampling.max_num_logprobs)
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    flat = 0
    for i in batch.sampling_seq_index:
        want = sched.scheduled[i].seq.sampling_params.logprobs
        for token in results[i].new_token_ids:
            if want is not None:
                top = dict(zip(top_ids[flat][:want], top_vals[flat][:want]))
                results[i].logprobs.append(Logprob(token, chosen[flat], top))
            flat += 1
