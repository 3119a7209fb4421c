"""Simulated acceptance, for benchmarking speculative decoding at real sizes without real weights.

speculative_config["simulate_acceptance"] = {"rates": [r_1, ..., r_k]}      (unconditional rate of
acceptance at each position: P(accepted >= j) = r_j, non-increasing), or
{"mean_acceptance_length": L} (1 <= L <= k + 1; rates r_j = a^j with a chosen so that
1 + sum_j a^j = L). The drafter and the verify forward run exactly as usual; only the accept
decision is drawn, so the generated text is synthetic. Nothing turns this on but the explicit
key, and get_stats() and the log line say the acceptance is simulated.
"""

from __future__ import annotations

import torch

from foretell.spec_decode.rejection_sampler import VerifyResult


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


class SimulatedAcceptance:
    def __init__(self, rates: list[float], seed: int):
        self.rates = rates
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._device_draws: tuple[torch.Generator, torch.Tensor] | None = None

    def accepted_counts(self, num_seqs: int, device: torch.device) -> torch.Tensor:
        """[num_seqs] int64 draws on the device, with no host sync (the graphed path)."""
        if self._device_draws is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._device_draws = (generator, torch.tensor(self.rates, device=device))
        generator, rates = self._device_draws
        uniform = torch.rand(num_seqs, 1, device=device, generator=generator)
        return (uniform < rates[None, :]).sum(dim=1)

    def apply(
        self, verify: VerifyResult, logits: torch.Tensor, draft_token_ids: list[list[int]]
    ) -> VerifyResult:
        """Redraw how many drafts each sequence accepts; the token after them is the target's
        greedy choice at that row of the verify forward."""
        uniform = torch.rand(len(draft_token_ids), generator=self.generator).tolist()
        accepted = [
            min(len(d), sum(u < r for r in self.rates)) for u, d in zip(uniform, draft_token_ids)
        ]
        starts = [rows[0] for rows in verify.emitted_rows]
        rows = [s + a for s, a in zip(starts, accepted)]
        finals = logits.argmax(dim=-1)[rows].tolist()
        outputs = [d[:a] + [f] for d, a, f in zip(draft_token_ids, accepted, finals)]
        emitted = [list(range(s, s + a + 1)) for s, a in zip(starts, accepted)]
        flat = [t for out in outputs for t in out]
        return VerifyResult(
            accepted, outputs, emitted, torch.tensor(flat, dtype=torch.int64).to(logits.device)
        )
