"""The graphed greedy verify step: target graph, verification on the device, draft-loop graph,
and a single host sync for the whole step.

Used by the runner when every sequence verifies exactly k drafts under greedy decoding (and
asks for no logprobs); everything else takes the general path. A sequence near max_tokens keeps
its k draft rows with its acceptance capped (ScheduledSequence.accept_limit).
"""

from __future__ import annotations

import torch


def graphed_greedy_verify(runner, sched, batch) -> list:
    from foretell.runner.model_runner import SequenceResult

    key = runner.graphs.bucket_for(batch)
    bucket, q = key
    k = q - 1
    n = batch.attn_metadata.num_seqs
    _, _, logits = runner.graphs.run(batch, key)  # [n * q, vocab]; aux stays in the graph's outputs
    target = logits.argmax(dim=-1).view(n, q)  # the target's greedy token after each row
    if runner.simulated is not None:
        accepted = runner.simulated.accepted_counts(n, runner.device)
    else:
        drafts_in = batch.input_ids.view(n, q)[:, 1:]
        accepted = (target[:, :k] == drafts_in).to(torch.int64).cumprod(dim=1).sum(dim=1)
    limits = [item.accept_limit for item in sched.scheduled]
    if any(limit is not None for limit in limits):  # near max_tokens: the rows stay, acceptance is capped
        cap = torch.tensor([k if limit is None else limit for limit in limits], device=accepted.device)
        accepted = torch.minimum(accepted, cap)
    next_token = target.gather(1, accepted[:, None]).squeeze(1)
    drafts = runner.draft_graphs.run(bucket, n, accepted, next_token)  # [n, k]
    host = torch.cat([accepted, next_token, drafts.flatten()]).tolist()  # the step's one sync
    results = []
    for i, item in enumerate(sched.scheduled):
        a = host[i]
        results.append(
            SequenceResult(
                new_token_ids=item.draft_token_ids[:a] + [host[n + i]],
                num_accepted=a,
                num_drafts=item.num_usable_drafts,
                next_drafts=host[2 * n + i * k : 2 * n + (i + 1) * k],
            )
        )
    return results
