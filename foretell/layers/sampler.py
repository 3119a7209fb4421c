"""Turning logits into tokens: temperature, top-k, top-p, min-p, greedy, seeds, logprobs.

`SamplingBatch` holds one row of parameters per logits row. Sampling from a distribution uses the
exponential race (argmax of p / E with E ~ Exp(1)), which is exact and needs no cumulative sums.
Rows of a request with a seed draw counter-based noise: each value a hash of (seed, sample index,
token position, column), so a seeded request gives the same tokens whatever it is batched with,
after preemption, and whichever step form draws it: the host step computes the row seeds on the
host (row_seed), the padded verify step on the device from each sequence's key and the positions
in its buffers (row_seeds_on_device, the same arithmetic; the hash and the draws made from it live
in ops/sampling/hashed_noise.py, with Triton kernels on CUDA), with no generator to seed per row (a
CUDA graph could not re-seed one, and a step queued ahead does not know its positions on the host).
Rows without a seed draw from the engine's generator on the host step; on the padded step from a
key per sequence derived from the engine's seed (NoiseSource.unseeded_key).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from foretell.device_util import to_device
from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.sampling.hashed_noise import (  # noqa: F401  (the noise's names, re-exported)
    EXPONENTIAL_STREAM,
    UNIFORM_STREAM,
    hashed_exponential,
    hashed_uniform,
    row_seeds,
    seed_at_position,
)
from foretell.sampling_params import SamplingParams

_MASK63 = (1 << 63) - 1
UNSEEDED_SALT = 0x6A09E667F3BCC909  # keys of sequences without a seed, from the engine's seed


def sequence_key(seed: int, sample_index: int) -> int:
    """A 63-bit key per (request seed, sample): the part of a row's seed the host knows for good."""
    x = seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK63


def row_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit seed that differs for every (request seed, sample, position)."""
    return seed_at_position(sequence_key(seed, sample_index), position)


def row_seeds_on_device(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys [n] int64 (sequence_key), positions [n, r] int64 -> row seeds [n, r] int64, equal to
    row_seed on the host: the padded step's, whose positions live on the device (one kernel on CUDA)."""
    return row_seeds(keys, positions)


@dataclass
class SamplingBatch:
    """One row of sampling parameters per logits row. The per-row tensors are built on the device
    at first use: an all-greedy batch (argmax) never copies them there."""

    temperatures: list[float]  # per row, 0 for greedy rows
    top_ks: list[int]  # per row, the vocabulary size when disabled
    top_ps: list[float]
    min_ps: list[float]
    device: torch.device
    row_seeds: list[int | None]  # per row; None draws from the engine's generator
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int  # -1: no row asked for logprobs; 0: only the chosen token's

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        row_seeds: list[int | None],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        temps = [p.temperature for p in params]
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        return cls(
            temperatures=temps,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            device=device,
            row_seeds=row_seeds,
            all_greedy=all(t == 0 for t in temps),
            any_greedy=any(t == 0 for t in temps),
            any_top_k=any(k < vocab_size for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(p > 0 for p in min_ps),
            max_num_logprobs=max((-1 if p.logprobs is None else p.logprobs) for p in params),
        )

    @functools.cached_property
    def temperature(self) -> torch.Tensor:  # [rows] float32
        return to_device(self.temperatures, torch.float32, self.device)

    @functools.cached_property
    def top_k(self) -> torch.Tensor:  # [rows] int64
        return to_device(self.top_ks, torch.int64, self.device)

    @functools.cached_property
    def top_p(self) -> torch.Tensor:  # [rows] float32
        return to_device(self.top_ps, torch.float32, self.device)

    @functools.cached_property
    def min_p(self) -> torch.Tensor:  # [rows] float32
        return to_device(self.min_ps, torch.float32, self.device)

    @property
    def greedy_rows(self) -> torch.Tensor:  # [rows] bool
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by top-k, top-p
    and min-p, renormalized. Greedy rows get a one-hot at their argmax.

    logits [rows, vocab] float32 -> probs [rows, vocab] float32
    """
    temperature = torch.where(batch.greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # [rows, vocab]
    probs = torch.softmax(scaled, dim=-1)
    if batch.any_top_k or batch.any_top_p or batch.any_min_p:
        dropped = torch.zeros_like(probs, dtype=torch.bool)  # [rows, vocab]: what top-k / top-p / min-p remove
        if batch.any_top_k or batch.any_top_p:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
            if batch.any_top_k:
                rank = torch.arange(probs.shape[-1], device=probs.device)
                drop |= rank[None, :] >= batch.top_k[:, None]
            if batch.any_top_p:
                before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
                # top_p 1 keeps every token: the float32 cumsum can pass 1.0 before the tail (by how
                # much depends on the CPU's vector width), which must not cut a row without top-p
                drop |= (before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
            drop[:, 0] = False  # always keep the most likely token
            dropped = dropped.scatter(-1, order, drop)
        if batch.any_min_p:
            dropped |= probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        # Renormalised as a softmax over the kept logits, the row's own kernel: a sum of the row's
        # probabilities (probs / probs.sum) runs on CUDA in an order set by the batch's row count,
        # so a seeded row sampled alone and among others got other bits (issue 23).
        probs = torch.softmax(scaled.masked_fill(dropped, float("-inf")), dim=-1)
    if not batch.all_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax_rows(logits)[:, None], 1.0)
        probs = torch.where(batch.greedy_rows[:, None], one_hot, probs)
    return probs


class NoiseSource:
    """Random draws per row: counter-based from the row's seed (hashed_uniform), or from the
    engine's generator for rows without one."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def unseeded_key(self, seq_id: int) -> int:
        """The padded step's key for a sequence without a seed (it cannot draw from the generator
        on the host): a function of the engine's seed and the sequence, so a run repeats."""
        return sequence_key(self.seed ^ UNSEEDED_SALT, seq_id)

    def _seeded(self, out: torch.Tensor, row_seeds: list[int | None], draw) -> torch.Tensor:
        """out with the rows that have a seed replaced by draw(seeds [m] int64) [m, width]."""
        rows = [i for i, s in enumerate(row_seeds) if s is not None]
        if rows:
            seeds = to_device([row_seeds[i] for i in rows], torch.int64, self.device)
            out[to_device(rows, torch.int64, self.device)] = draw(seeds)
        return out

    def exponential(self, row_seeds: list[int | None], width: int) -> torch.Tensor:
        """[rows, width] draws of Exp(1)."""
        out = torch.empty(len(row_seeds), width, device=self.device)
        out.exponential_(generator=self.generator)
        return self._seeded(out, row_seeds, lambda seeds: hashed_exponential(seeds, width))

    def uniform(self, row_seeds: list[int | None], width: int) -> torch.Tensor:
        """[rows, width] draws of U[0, 1); a seeded row uses a stream apart from exponential()."""
        out = torch.rand(len(row_seeds), width, device=self.device, generator=self.generator)
        return self._seeded(out, row_seeds, lambda seeds: hashed_uniform(seeds, width, UNIFORM_STREAM))


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax p / E. probs [rows, vocab], noise [rows, vocab] -> [rows] int64."""
    return argmax_rows(probs / noise)


def sample_from_probs_seeded(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """sample_from_probs(probs, hashed_exponential(seeds, vocab)), the same tokens bit for bit:
    probs [rows, vocab] float32, seeds [rows] int64 -> [rows] int64. On CUDA, at the vocabularies
    where argmax_rows takes the Triton argmax (whose NaN and tie rules the fused kernel shares), one
    fused race that never stores the [rows, vocab] noise."""
    vocab = probs.shape[-1]
    if (probs.dim() == 2 and vocab >= TRITON_ARGMAX_MIN_VOCAB and probs.dtype == torch.float32
            and probs.stride(-1) == 1 and use_triton(probs, seeds)):
        from foretell.ops.sampling.triton_hashed_noise import exponential_race_triton  # imports triton

        return exponential_race_triton(probs, seeds)
    return sample_from_probs(probs, hashed_exponential(seeds, vocab))


@dataclass
class SampledTokens:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32, log-prob of the chosen token (raw model)
    top_logprobs: torch.Tensor | None  # [rows, n] float32
    top_token_ids: torch.Tensor | None  # [rows, n] int64


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw model distribution (before temperature and truncation)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, token_ids[:, None]).squeeze(-1)
    top_vals, top_ids = logp.topk(max(num_top, 1), dim=-1)
    return chosen, top_vals[:, :num_top], top_ids[:, :num_top]


# Vocabularies from this size take the chunked Triton argmax on CUDA (torch.argmax gives a row one
# thread block: slow for a 100k+ vocabulary on an H200, docs/perf-log.md).
TRITON_ARGMAX_MIN_VOCAB = 8192


def argmax_rows(
    logits: torch.Tensor, id_map: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64: the first column holding each row's maximum, or
    id_map[that column] (id_map [vocab] int64: a draft vocabulary's target ids); written into
    `out` ([rows] int64, any stride) when given, and returned."""
    if logits.dim() == 2 and logits.shape[-1] >= TRITON_ARGMAX_MIN_VOCAB and use_triton(logits):
        from foretell.ops.sampling.triton_argmax import argmax_triton  # imports triton

        return argmax_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), id_map, out)
    columns = logits.argmax(dim=-1)
    ids = columns if id_map is None else id_map[columns]
    return ids if out is None else out.copy_(ids)


class Sampler:
    def __init__(self, noise: NoiseSource):
        self.noise = noise

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """logits [rows, vocab] float32 -> one token per row."""
        if batch.all_greedy:
            tokens = argmax_rows(logits)
        else:
            probs = processed_probs(logits, batch)
            tokens = sample_from_probs(probs, self.noise.exponential(batch.row_seeds, probs.shape[-1]))
        return with_logprobs(logits, tokens, batch)


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
    if batch.max_num_logprobs < 0:
        return SampledTokens(tokens, None, None, None)
    chosen, top_vals, top_ids = compute_logprobs(logits, tokens, batch.max_num_logprobs)
    return SampledTokens(tokens, chosen, top_vals, top_ids)
