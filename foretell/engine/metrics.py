"""Engine counters (tokens, requests, preemptions, step times) and the periodic stats log line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from foretell.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger("foretell")


@dataclass
class EngineMetrics:
    spec: SpecDecodeStats | None = None
    synthetic_acceptance: bool = False
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    _last_log: float = field(default_factory=time.monotonic)
    _last_generation_tokens: int = 0

    def as_dict(self) -> dict:
        out = {
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_finished": self.num_requests_finished,
            "num_steps": self.num_steps,
            "target_time_s": self.target_time_s,
            "draft_time_s": self.draft_time_s,
        }
        if self.spec is not None:
            out.update(self.spec.as_dict())
        return out

    def log_due(self, interval_s: float) -> bool:
        """Whether the periodic stats line is due (interval_s > 0 seconds since the last)."""
        return interval_s > 0 and time.monotonic() - self._last_log >= interval_s

    def log(self, running: int, waiting: int, kv_usage: float) -> None:
        """Log the stats line: generation rate since the last line, queue, KV usage, acceptance."""
        now = time.monotonic()
        rate = (self.generation_tokens_total - self._last_generation_tokens) / max(now - self._last_log, 1e-9)
        self._last_log, self._last_generation_tokens = now, self.generation_tokens_total
        line = (
            f"generation {rate:.1f} tok/s, running {running}, waiting {waiting}, "
            f"KV usage {100 * kv_usage:.1f}%"
        )
        if self.spec is not None and self.spec.num_drafts:
            per_pos = ", ".join(f"{100 * r:.0f}%" for r in self.spec.per_position_rates())
            line += f"; {self.spec.log_line()}; per position [{per_pos}]"
            if self.synthetic_acceptance:
                line += " (SIMULATED acceptance: synthetic output)"
        logger.info(line)
