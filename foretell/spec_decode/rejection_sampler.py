"""Verification of draft tokens against the target: greedy and rejection sampling.

Every sampling sequence of a step comes here with its k >= 0 drafts and k + 1 target logits rows
(k = 0 is plain sampling). Greedy rows accept the longest prefix of drafts equal to the target's
argmax, then emit the target's argmax (the correction, or the bonus token when all k match): the
same op as the padded device step's (ops/step accept_drafts), on the sequences' rows padded to the
longest draft list with each capped at its own length.
Sampled rows follow Leviathan et al. (2023): accept draft d at row i with probability
min(1, p_i(d) / q_i(d)), where p is the target's distribution after temperature / top-k / top-p /
min-p (the same processing as without speculation) and q the proposer's real draft distribution
(a one-hot at d when the proposer does not sample); at the first rejection, draw from the
residual max(0, p_i - q_i) renormalized; if all k pass, draw the bonus token from p_k.
The output distribution is exactly the target's.

Two input forms, one core (rejection_core): RejectionSampler takes the host step's lists (any
draft counts, draft probabilities per sequence); sample_padded takes the padded verify step's
device tensors of fixed shape ([n, k + 1, vocab] logits, [n, k] drafts, the row seeds computed on
the device from each sequence's key and first position: layers/sampler.py), waits for nothing and
leaves its results on the device. For the same logits, drafts, draft probabilities and seeded rows
both give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.device_util import to_device
from foretell.layers.sampler import (
    UNIFORM_STREAM,
    NoiseSource,
    SamplingBatch,
    argmax_rows,
    hashed_uniform,
    processed_probs,
    row_seeds_on_device,
    sample_from_probs,
    sample_from_probs_seeded,
)
from foretell.ops.step.dispatch import greedy_accepted


@dataclass
class VerifyResult:
    num_accepted: list[int]  # per sequence
    output_token_ids: list[list[int]]  # per sequence: accepted drafts + one target token
    # Rows of the step's logits (per sequence, in order) whose token was emitted, for logprobs.
    emitted_rows: list[list[int]]
    emitted_tokens: torch.Tensor  # [total emitted] int64, matching emitted_rows flattened

    @classmethod
    def from_counts(
        cls,
        draft_token_ids: list[list[int]],
        starts: list[int],  # per sequence: its first logits row
        num_accepted: list[int],
        finals: list[int],  # per sequence: the token after its accepted drafts
        device: torch.device,
    ) -> "VerifyResult":
        outputs, emitted_rows = [], []
        for drafts, start, a, final in zip(draft_token_ids, starts, num_accepted, finals):
            outputs.append(drafts[:a] + [final])
            emitted_rows.append(list(range(start, start + a + 1)))
        flat = [t for out in outputs for t in out]
        return cls(num_accepted, outputs, emitted_rows, to_device(flat, torch.int64, device))


class RejectionSampler:
    def __init__(self, noise: NoiseSource):
        self.noise = noise

    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32: k_i + 1 rows per sequence, in order
        draft_token_ids: list[list[int]],  # per sequence, k_i drafts
        draft_probs: list[torch.Tensor | None],  # per sequence [k_i, vocab] or None (one-hot)
        batch: SamplingBatch,  # one entry per logits row
    ) -> VerifyResult:
        device = logits.device
        num_seqs = len(draft_token_ids)
        lengths = [len(d) for d in draft_token_ids]
        max_k = max(lengths, default=0)
        starts = [0]
        for k in lengths:
            starts.append(starts[-1] + k + 1)

        # Padded views: [num_seqs, max_k + 1] row index into logits (padding repeats a valid row).
        row_index_host = [[starts[s] + min(i, lengths[s]) for i in range(max_k + 1)] for s in range(num_seqs)]
        row_index = to_device(row_index_host, torch.int64, device)
        drafts = to_device(
            [d + [0] * (max_k - len(d)) for d in draft_token_ids], torch.int64, device
        ).view(num_seqs, max_k)
        lengths_t = to_device(lengths, torch.int64, device)  # [num_seqs]

        if batch.all_greedy:
            num_accepted_t, final_tokens = greedy_acceptance(argmax_rows(logits)[row_index], drafts, lengths_t)
        else:
            probs = processed_probs(logits, batch)  # [rows, vocab]
            vocab = probs.shape[-1]
            q = dense_draft_probs(drafts, lengths, draft_probs, vocab)  # [num_seqs, max_k, vocab]
            seeds = [batch.row_seeds[rows[0]] for rows in row_index_host]
            uniform = self.noise.uniform(seeds, max(max_k, 1))[:, :max_k]
            noise = self.noise.exponential(
                [batch.row_seeds[r] for rows in row_index_host for r in rows], vocab
            ).view(num_seqs, max_k + 1, vocab)
            num_accepted_t, final_choice = rejection_core(probs[row_index], drafts, q, lengths_t, uniform, noise)
            final_tokens = final_choice.gather(1, num_accepted_t[:, None]).squeeze(1)
            if batch.any_greedy:
                greedy_seq = batch.greedy_rows[row_index[:, 0]]
                greedy_accepted, greedy_final = greedy_acceptance(argmax_rows(logits)[row_index], drafts, lengths_t)
                num_accepted_t = torch.where(greedy_seq, greedy_accepted, num_accepted_t)
                final_tokens = torch.where(greedy_seq, greedy_final, final_tokens)

        num_accepted, finals = torch.stack([num_accepted_t, final_tokens]).tolist()  # one sync
        return VerifyResult.from_counts(draft_token_ids, starts, num_accepted, finals, device)


def dense_draft_probs(
    drafts: torch.Tensor,  # [num_seqs, max_k] int64 on the device, padded past each sequence's drafts
    lengths: list[int],  # per sequence: its number of drafts
    draft_probs: list[torch.Tensor | None],  # per sequence [>= k_i, vocab], or None: a one-hot at each draft
    vocab: int,
) -> torch.Tensor:
    """The draft distributions q [num_seqs, max_k, vocab] float32 (zero past a sequence's drafts)."""
    num_seqs, max_k = drafts.shape
    q = torch.zeros(num_seqs, max_k, vocab, device=drafts.device)
    for s, dp in enumerate(draft_probs):
        n = lengths[s]
        if n == 0:
            continue
        if dp is None:
            q[s, :n].scatter_(-1, drafts[s, :n, None], 1.0)
        else:
            q[s, :n] = dp[:n].to(device=drafts.device, dtype=torch.float32)
    return q


def rejection_core(
    p: torch.Tensor,  # [num_seqs, max_k + 1, vocab] float32: the target's processed distribution per row
    drafts: torch.Tensor,  # [num_seqs, max_k] int64
    q: torch.Tensor,  # [num_seqs, max_k, vocab] float32: the draft distributions (one-hot: deterministic)
    lengths: torch.Tensor,  # [num_seqs] int64: each sequence's number of drafts
    uniform: torch.Tensor,  # [num_seqs, max_k] float32: the accept tests' draws
    noise: torch.Tensor,  # [num_seqs, max_k + 1, vocab] float32: Exp(1) draws for the race
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [num_seqs] int64, each row's candidate token [num_seqs, max_k + 1] int64): a
    sequence accepts the prefix of drafts that pass u * q(d) < p(d); the token after them is
    candidate[accepted]: drawn from the residual max(0, p - q) renormalized at a rejected row,
    from p at the sequence's bonus row (its own k). Fixed shapes, no host reads."""
    accepted, candidates = rejection_candidates(p, drafts, q, lengths, uniform)
    choice = sample_from_probs(candidates.flatten(0, 1), noise.flatten(0, 1)).view(drafts.shape[0], -1)
    return accepted, choice


def rejection_candidates(
    p: torch.Tensor,  # [num_seqs, max_k + 1, vocab] float32
    drafts: torch.Tensor,  # [num_seqs, max_k] int64
    q: torch.Tensor,  # [num_seqs, max_k, vocab] float32
    lengths: torch.Tensor,  # [num_seqs] int64
    uniform: torch.Tensor,  # [num_seqs, max_k] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_core before its race: (accepted [num_seqs] int64, the distribution each row's
    candidate token is drawn from [num_seqs, max_k + 1, vocab] float32)."""
    num_seqs, max_k = drafts.shape
    device = p.device
    valid = torch.arange(max_k, device=device)[None, :] < lengths[:, None]
    p_draft = p[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)  # [num_seqs, max_k]
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    accept = (uniform * q_draft < p_draft) & valid
    # Residual distribution for the row after the accepted prefix; the bonus row uses p.
    residual = (p[:, :max_k] - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :max_k])
    candidates = torch.cat([residual, p[:, max_k:]], dim=1)  # [num_seqs, max_k + 1, vocab]
    # The bonus row of a sequence with fewer than max_k drafts is its own row k_s.
    seq = torch.arange(num_seqs, device=device)
    candidates[seq, lengths] = p[seq, lengths]
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # the all-accepted prefix's length
    return accepted, candidates


@dataclass
class PaddedSampling:
    """The sampling rows of a padded verify step, for its sequences in order: their parameters and
    where their noise comes from, on the device (a step queued ahead reuses it: the same sequences,
    their positions advanced in the buffers)."""

    sampling: SamplingBatch  # one entry per verify row (k + 1 per sequence); row_seeds unused
    keys: torch.Tensor  # [num_seqs] int64: each sequence's noise key (layers/sampler.py sequence_key)


def sample_padded(
    logits: torch.Tensor,  # [n, k + 1, vocab] float32: the target's logits at each verify row
    drafts: torch.Tensor,  # [n, k] int64
    draft_probs: torch.Tensor | None,  # [n, k, vocab] float32, or None: every draft deterministic (one-hot)
    rows: PaddedSampling,
    first_positions: torch.Tensor,  # [n] int64: each sequence's first verify position (its buffers')
    caps: torch.Tensor | None,  # [n] int64: most drafts each may accept, or None
    lengths: torch.Tensor | None = None,  # [n] int64: each sequence's real drafts (<= k), or None: all k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of the padded step for every row as if sampled (greedy rows get a one-hot
    p: the caller takes greedy acceptance for them): (accepted [n], next token [n]), on the device,
    waiting for nothing. Row r of sequence i draws from the seed of (keys[i], first_positions[i] + r),
    as the host step does for a seeded row at that position. A sequence with fewer real drafts than
    k (lengths: its drafts padded to the step's k) accepts none of the padding and draws its bonus
    token from p at its own row lengths[i], as the host step does for a sequence of that many drafts."""
    n, q_rows, vocab = logits.shape
    k = q_rows - 1
    device = logits.device
    probs = processed_probs(logits.reshape(n * q_rows, vocab), rows.sampling).view(n, q_rows, vocab)
    offsets = torch.arange(q_rows, dtype=torch.int64, device=device)
    seeds = row_seeds_on_device(rows.keys, first_positions[:, None] + offsets[None, :])  # [n, k + 1]
    uniform = hashed_uniform(seeds[:, 0], max(k, 1), UNIFORM_STREAM)[:, :k]
    if draft_probs is None:
        q = torch.zeros(n, k, vocab, device=device).scatter_(-1, drafts[..., None], 1.0)
    else:
        q = draft_probs
    if lengths is None:
        lengths = torch.full((n,), k, dtype=torch.int64, device=device)
    accepted, candidates = rejection_candidates(probs, drafts, q, lengths, uniform)
    # rejection_core's race, its [n * (k + 1), vocab] noise never stored on CUDA (the same tokens).
    choice = sample_from_probs_seeded(candidates.flatten(0, 1), seeds.reshape(-1)).view(n, q_rows)
    next_token = choice.gather(1, accepted[:, None]).squeeze(1)
    if caps is not None:
        # Past its cap a sequence keeps the next (accepted) draft as its last token, as cap_accepted.
        over = accepted > caps
        capped = caps.clamp(0, max(k - 1, 0))
        next_token = torch.where(over, drafts.gather(1, capped[:, None]).squeeze(1), next_token)
        accepted = torch.minimum(accepted, caps)
    return accepted, next_token


def greedy_acceptance(
    target: torch.Tensor,  # [num_seqs, max_k + 1] int64: the target's argmax at each sequence's rows
    drafts: torch.Tensor,  # [num_seqs, max_k] int64, padded past each sequence's own drafts
    lengths: torch.Tensor,  # [num_seqs] int64: each sequence's number of drafts
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [num_seqs], next token [num_seqs]) of greedy verification: the padded step's op,
    each sequence capped at its own number of drafts."""
    if drafts.shape[1] == 0:  # plain sampling rows only: nothing to accept
        return torch.zeros(target.shape[0], dtype=torch.int64, device=target.device), target[:, 0]
    return greedy_accepted(target, drafts, lengths)


def cap_accepted(verify: VerifyResult, limits: list[int | None]) -> VerifyResult:
    """At most limits[i] accepted drafts for sequence i (None: no cap). A sequence that accepted
    more keeps its first limit + 1 tokens: the drafts up to the limit and, as the step's last
    token, the next draft, which verification accepted, so it is a token the target emits there."""
    if all(limit is None or limit >= a for limit, a in zip(limits, verify.num_accepted)):
        return verify
    accepted, outputs, rows = [], [], []
    for limit, a, out, emitted in zip(limits, verify.num_accepted, verify.output_token_ids, verify.emitted_rows):
        if limit is not None and a > limit:
            a, out, emitted = limit, out[: limit + 1], emitted[: limit + 1]
        accepted.append(a)
        outputs.append(out)
        rows.append(emitted)
    flat = [t for out in outputs for t in out]
    return VerifyResult(accepted, outputs, rows, torch.tensor(flat, dtype=torch.int64).to(verify.emitted_tokens.device))
