"""Simulated acceptance, for benchmarking speculative decoding at real sizes without real weights.

speculative_config["simulate_acceptance"] = {"rates": [r_1, ..., r_k]}      (unconditional rate of
acceptance at each position: P(accepted >= j) = r_j, non-increasing), or
{"mean_acceptance_length": L} (1 <= L <= k + 1; rates r_j = a^j with a chosen so that
1 + sum_j a^j = L). The drafter and the verify forward run exactly as usual; only the accept
decision is drawn, so the generated text is synthetic. Nothing turns this on but the explicit
key, and get_stats() and the log line say the acceptance is simulated. The runner then verifies
with SimulatedVerifier (spec_decode/verifier.py), chosen when it is built.

A step's accepted count is the number of rates above one uniform draw u (so P(accepted >= j) =
r_j). The draws are low-discrepancy, not independent: the i-th sequence of the engine's t-th
verify step draws u = frac(offset + t * a + i * b), a = (sqrt(5) - 1) / 2, b = sqrt(2) - 1, offset
from the seed. A sequence keeping its place in the batch walks the golden-ratio sequence, the most
evenly spread there is, and the sequences of one step are spread over [0, 1) too. So the rates are
met within about 1 / (number of draws) rather than 1 / sqrt(number of draws), and a benchmark's
realized mean acceptance length is the one asked for even over a short run: independent draws over
one 128-token request at batch 1 realized 2.54 to 3.07 for 2.93 asked.
"""

from __future__ import annotations

import math

import torch

from foretell.ops.step.reference import drawn_counts


def rates_from_config(spec: dict, k: int) -> list[float]:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(
            "simulate_acceptance must be {'rates': [r_1, ..., r_k]} or "
            f"{{'mean_acceptance_length': L}}, got {spec!r}"
        )
    if "rates" in spec:
        rates = [float(r) for r in spec["rates"]]
        if len(rates) != k or any(not 0 <= r <= 1 for r in rates) or rates != sorted(rates, reverse=True):
            raise ValueError(
                f"simulate_acceptance rates must be {k} non-increasing values in [0, 1] (one per "
                f"speculative position), got {spec['rates']}"
            )
        return rates
    if "mean_acceptance_length" in spec:
        length = float(spec["mean_acceptance_length"])
        if not 1 <= length <= k + 1:
            raise ValueError(
                f"simulate_acceptance mean_acceptance_length must be in [1, {k + 1}] for k={k}, "
                f"got {length}"
            )
        lo, hi = 0.0, 1.0
        for _ in range(60):  # bisection: 1 + sum a^j is increasing in a
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if 1 + sum(mid**j for j in range(1, k + 1)) < length else (lo, mid)
        return [lo**j for j in range(1, k + 1)]
    raise ValueError(f"simulate_acceptance needs 'rates' or 'mean_acceptance_length', got {sorted(spec)}")


STEP_STRIDE = (math.sqrt(5.0) - 1.0) / 2.0  # a, between a sequence's consecutive steps
ROW_STRIDE = math.sqrt(2.0) - 1.0  # b, between the sequences of one step


class SimulatedAcceptance:
    def __init__(self, rates: list[float], seed: int):
        self.rates = rates
        self.offset = math.fmod(seed * math.pi, 1.0)  # where the draws start
        self.num_steps = 0  # verify steps drawn for so far (both paths share the count)
        self._device_rates: torch.Tensor | None = None

    def _next_start(self) -> float:
        """frac(offset + t * a) for this step t, and count the step."""
        start = math.fmod(self.offset + self.num_steps * STEP_STRIDE, 1.0)
        self.num_steps += 1
        return start

    def uniforms(self, num_seqs: int) -> list[float]:
        """One verify step's draws in [0, 1), one per sequence, on the host."""
        start = self._next_start()
        return [math.fmod(start + i * ROW_STRIDE, 1.0) for i in range(num_seqs)]

    def device_step(self, device: torch.device) -> tuple[float, torch.Tensor]:
        """This verify step's draws for the padded step, as (start, rates [k] float64 on device):
        sequence i draws frac(start + i * b) (ops/step accept_drawn: one launch on CUDA)."""
        if self._device_rates is None:
            self._device_rates = torch.tensor(self.rates, dtype=torch.float64, device=device)
        return self._next_start(), self._device_rates

    def accepted_counts(self, num_seqs: int, device: torch.device) -> torch.Tensor:
        """[num_seqs] int64 draws on the device, with no host sync."""
        start, rates = self.device_step(device)
        return drawn_counts(start, rates, num_seqs, ROW_STRIDE)
