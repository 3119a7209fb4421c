"""Log-probabilities for the requests that ask: of the prompt tokens a prefill chunk predicts,
and of the tokens a step emits, each with the request's top-n alternatives (raw model
distribution, before temperature and truncation; sampler.compute_logprobs): on the step from
host inputs (add_prompt_logprobs, add_logprobs), and on the padded verify step, where the device
computes them for every verify row and the host keeps the emitted rows' (padded_step_logprobs,
read_padded_logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

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


# ---- the padded verify step (graphed_verify.py) ------------------------------------------------
#
# The padded step computes the same numbers on the device, over fixed shapes and without a host
# read: every verify row of the sequences that ask (q rows each, emitted or not) gets the
# log-softmax of the target's raw logits (the host step's raw_logits: the padded step takes no
# logits processing), its top-n, and the log-prob of the token it emits if it emits one (row j
# emits draft j + 1 while j < accepted, then the next token). The values travel to the host in the
# step's one read-back, packed into int64 (floats as the bits of their float64: exact), and the
# host keeps the rows each sequence emitted.


@dataclass(frozen=True)
class PaddedLogprobs:
    """Which sequences of a padded step want logprobs, and how many alternatives each."""

    wants: tuple[int | None, ...]  # per sequence: the top-n it asked for (None: no logprobs)
    num_top: int  # the most alternatives any of them asked for (what the device computes)
    seq_index: torch.Tensor | None  # [num_wanting] int64 on the device: the sequences that ask (None: all)

    @classmethod
    def for_params(cls, params: list, device: torch.device) -> "PaddedLogprobs | None":
        """For the sequences' SamplingParams in step order; None when none asks for logprobs."""
        wants = tuple(p.logprobs for p in params)
        wanting = [i for i, want in enumerate(wants) if want is not None]
        if not wanting:
            return None
        index = None if len(wanting) == len(wants) else to_device(wanting, torch.int64, device)
        return cls(wants, max(wants[i] for i in wanting), index)

    @property
    def num_wanting(self) -> int:
        return sum(want is not None for want in self.wants)

    @property
    def row_width(self) -> int:
        """int64 values per verify row: the chosen token's log-prob, then num_top log-probs and ids."""
        return 1 + 2 * self.num_top

    def size(self, q: int) -> int:
        """int64 values of a step of q rows per sequence."""
        return self.num_wanting * q * self.row_width


def emitted_row_tokens(drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """The token each verify row emits: drafts [n, q - 1] int64 (the step's verified drafts),
    accepted [n], next_token [n] -> [n, q] int64, row j holding draft j + 1 while j < accepted,
    else the next token (rows past accepted emit nothing: their values are never read)."""
    q = drafts.shape[1] + 1
    rows = torch.arange(q, device=drafts.device)  # [q]
    tokens = torch.cat([drafts, next_token[:, None]], dim=1)  # [n, q]
    return torch.where(rows[None, :] < accepted[:, None], tokens, next_token[:, None])


def padded_step_logprobs(
    want: PaddedLogprobs,
    logits: torch.Tensor,  # [n, q, vocab] float32: the target's raw logits at each verify row
    drafts: torch.Tensor,  # [n, q - 1] int64
    accepted: torch.Tensor,  # [n] int64
    next_token: torch.Tensor,  # [n] int64
    out: torch.Tensor,  # [>= want.size(q)] int64, written
) -> torch.Tensor:
    """The padded step's logprobs, on the device, waiting for nothing: out's first want.size(q)
    values viewed as [num_wanting, q, 1 + 2 * num_top] (per row: the emitted token's log-prob,
    the top num_top log-probs, their token ids; floats as float64 bits) and returned."""
    n, q, vocab = logits.shape
    tokens = emitted_row_tokens(drafts, accepted, next_token)  # [n, q]
    if want.seq_index is not None:
        logits, tokens = logits.index_select(0, want.seq_index), tokens.index_select(0, want.seq_index)
    w, top = tokens.shape[0], want.num_top
    chosen, top_vals, top_ids = compute_logprobs(logits.reshape(w * q, vocab), tokens.reshape(w * q), top)
    packed = out[: want.size(q)].view(w, q, want.row_width)
    packed[..., 0].copy_(chosen.view(w, q).to(torch.float64).view(torch.int64))
    packed[..., 1 : 1 + top].copy_(top_vals.reshape(w, q, top).to(torch.float64).view(torch.int64))
    packed[..., 1 + top :].copy_(top_ids.reshape(w, q, top))
    return packed


def read_padded_logprobs(want: PaddedLogprobs, q: int, host: list[int],
                         new_token_ids: list[list[int]]) -> list[list[Logprob]]:
    """The host side of padded_step_logprobs: host, its packed values as read back (int64s);
    new_token_ids, the tokens each sequence emitted. Per sequence, a Logprob per emitted token
    (each with the top-n its request asked for), or [] for a sequence that did not ask."""
    values = torch.tensor(host, dtype=torch.int64).view(-1, q, want.row_width)  # [num_wanting, q, width]
    floats = values[..., : 1 + want.num_top].contiguous().view(torch.float64).tolist()
    ids = values[..., 1 + want.num_top :].tolist()
    out, flat = [], 0
    for wanted, tokens in zip(want.wants, new_token_ids):
        if wanted is None:
            out.append([])
            continue
        rows_f, rows_i = floats[flat], ids[flat]
        out.append([Logprob(token, rows_f[j][0], dict(zip(rows_i[j][:wanted], rows_f[j][1 : 1 + wanted])))
                    for j, token in enumerate(tokens)])
        flat += 1
    return out
