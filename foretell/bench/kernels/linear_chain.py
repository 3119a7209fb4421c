"""One-row linears timed where they run: a whole decode step's chain of linears, every layer with its
own weights, captured in one CUDA graph and replayed (scripts/sweep_linears_in_graph_gpu.py).

Why: a GEMV timed alone (L2 flushed, one launch) is launch- and flush-bound, and kernel changes
that won there lost in the decode graph (docs/perf-log.md, "seventeenth GPU session"). In the
graph the linears run back to back, each streaming its own weights from HBM, each starting early
under programmatic dependent launch (ops/common/pdl.py: the kernels ask for it themselves on
Hopper, as the engine launches them) while the one before finishes.

The chain, per layer (true data dependencies, views only, no extra kernels):

    x [M, H] -> qkv [M, q + 2 kv] -> its first q columns (the attention output's stand-in, a view)
      -> o [M, H] -> gate_up gated (silu(gate) * up) [M, I] -> down [M, H] -> the next layer's x

then the LM head [M, V] (float32 logits). `chain_function` builds it from per-kind configs;
`omit` swaps one kind's output for a fixed tensor of its shape (the kind's marginal cost in the
graph: baseline chain minus this one). `sweep_family` times the defaults, each kind omitted, then
each candidate config of one kind with every other kind at its default (round-robin over the
kinds, so a budget that runs out leaves every kind some candidates; the defaults re-timed every
few candidates, each change measured from the latest), and the defaults again at the end (the
drift between the first and last is the noise floor). Each row goes to `record` as it is measured.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from foretell.bench.kernels.linear_kinds import LAYER_KINDS, close_error
from foretell.bench.kernels.timing import time_kernel

H200_BYTES_S = 4.8e12


@dataclass(frozen=True)
class ChainShapes:
    hidden: int
    q_size: int  # num_heads * head_dim: the attention output's width, o's K
    kv_size: int  # num_kv_heads * head_dim
    intermediate: int
    vocab: int
    num_layers: int

    @classmethod
    def from_hf_config(cls, path: str, num_layers: int | None = None) -> "ChainShapes":
        """From a Hugging Face config.json (or the folder holding one); num_layers overrides its count."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(file) as f:
            config = json.load(f)
        try:
            hidden, heads = config["hidden_size"], config["num_attention_heads"]
            head_dim = config.get("head_dim") or hidden // heads
            shapes = cls(hidden, heads * head_dim, config.get("num_key_value_heads", heads) * head_dim,
                         config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"])
        except KeyError as e:
            raise ValueError(f"{file}: a decoder config needs {e.args[0]!r} (hidden_size, num_attention_heads, "
                             f"intermediate_size, vocab_size, num_hidden_layers)") from None
        if num_layers is not None:
            if num_layers < 1:
                raise ValueError(f"num_layers must be at least 1, got {num_layers}")
            shapes = cls(**{**shapes.__dict__, "num_layers": num_layers})
        return shapes

    def linear_shape(self, kind: str) -> tuple[int, int]:
        """(N, K) of the kind's weight (gate_up: [gate; up], N = 2I)."""
        shapes = {"qkv": (self.q_size + 2 * self.kv_size, self.hidden), "o": (self.hidden, self.q_size),
                  "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate),
                  "lm_head": (self.vocab, self.hidden)}
        if kind not in shapes:
            raise ValueError(f"layer kind must be one of {list(shapes)}, got {kind!r}")
        return shapes[kind]

    def output_width(self, kind: str) -> int:
        n, _ = self.linear_shape(kind)
        return n // 2 if kind == "gate_up" else n

    def calls(self, kind: str) -> int:
        """How many times the chain runs the kind: once per layer, the LM head once."""
        return 1 if kind == "lm_head" else self.num_layers


TINY_SHAPES = ChainShapes(hidden=256, q_size=256, kv_size=128, intermediate=512, vocab=1000, num_layers=2)


@dataclass
class ChainWeights:
    layers: list[dict[str, Any]]  # per layer: kind -> the family's weight
    head: Any


def build_weights(family, shapes: ChainShapes, seed: int = 0) -> ChainWeights:
    """Random weights of every layer (each its own, so the chain streams them all from memory)."""
    gen = torch.Generator(device=family.device).manual_seed(seed)
    layers = [{kind: family.make_weight(kind, *shapes.linear_shape(kind), gen) for kind in LAYER_KINDS[:-1]}
              for _ in range(shapes.num_layers)]
    return ChainWeights(layers, family.make_weight("lm_head", *shapes.linear_shape("lm_head"), gen))


def chain_function(family, weights: ChainWeights, shapes: ChainShapes, x: torch.Tensor, configs: dict[str, Any],
                   omit: str | None = None) -> Callable[[], torch.Tensor]:
    """A callable running the decode chain on x [M, H] with configs[kind]; omit: that kind's
    output is a fixed tensor (its launches left out)."""
    m = x.shape[0]
    stand_in = None
    if omit is not None:
        gen = torch.Generator(device=x.device).manual_seed(0)
        stand_in = torch.randn(m, shapes.output_width(omit), device=x.device, generator=gen).to(
            torch.float32 if omit == "lm_head" else x.dtype)  # [M, the kind's output width]

    def linear(kind: str, h: torch.Tensor, weight) -> torch.Tensor:
        return stand_in if kind == omit else family.launch(kind, h, weight, configs[kind])

    def run() -> torch.Tensor:
        h = x  # [M, H]
        for layer in weights.layers:
            qkv = linear("qkv", h, layer["qkv"])  # [M, q + 2 kv]
            h = linear("o", qkv[:, :shapes.q_size], layer["o"])  # [M, H] from a [M, q] view
            h = linear("down", linear("gate_up", h, layer["gate_up"]), layer["down"])  # [M, I] -> [M, H]
        return linear("lm_head", h, weights.head)  # [M, V] float32

    return run


@dataclass
class SweepSettings:
    warmup: int = 3
    iters: int = 30  # timed replays of the chain per row
    deadline: float = float("inf")  # time.perf_counter() after which candidates are skipped
    max_candidates: int | None = None  # per layer kind, besides the default
    kinds: tuple[str, ...] = LAYER_KINDS  # the layer kinds whose candidates are swept
    omit_rows: bool = True  # time the chain with each kind left out (its marginal cost)
    rebaseline_every: int = 8  # candidates between re-timings of the defaults (deltas use the latest)

    @property
    def spent(self) -> bool:
        return time.perf_counter() > self.deadline


def _time_chain(run: Callable[[], torch.Tensor], device: torch.device, settings: SweepSettings) -> dict:
    timing = time_kernel(run, device, warmup=settings.warmup, iters=settings.iters, cuda_graph=device.type == "cuda")
    return {"chain_us": round(timing.median_us, 2), "chain_min_us": round(timing.min_us, 2),
            "chain_max_us": round(timing.max_us, 2), "timer": timing.timer}


def _with_estimates(row: dict, baseline_us: float | None, marginal_us: dict, shapes: ChainShapes, family) -> dict:
    """Adds the per-call change against the baseline and, where the kind's marginal cost is known,
    its estimated in-graph time per call and share of the H200's peak bandwidth (H200_BYTES_S)."""
    kind = row.get("layer_kind")
    if not row.get("ok") or baseline_us is None or kind not in LAYER_KINDS or row["variant"] != "candidate":
        return row
    delta = (row["chain_us"] - baseline_us) / shapes.calls(kind)
    row["delta_per_call_us"] = round(delta, 3)
    if kind in marginal_us:
        est = marginal_us[kind] + delta
        row["kind_us_est"] = round(est, 3)
        if est > 0:
            row["fraction_of_bandwidth"] = round(family.weight_bytes(kind, *shapes.linear_shape(kind)) / (est * 1e-6)
                                                 / H200_BYTES_S, 4)
    return row


def _interleave(per_kind: dict[str, list]) -> list[tuple[str, Any]]:
    """(kind, config) pairs taking one candidate of each kind in turn."""
    pairs, depth = [], max((len(v) for v in per_kind.values()), default=0)
    for i in range(depth):
        pairs += [(kind, configs[i]) for kind, configs in per_kind.items() if i < len(configs)]
    return pairs


def sweep_family(family, weights: ChainWeights, shapes: ChainShapes, m: int, settings: SweepSettings,
                 record: Callable[[dict], None], section: str, seed: int = 1) -> None:
    """Times the chain at M rows: defaults, each kind omitted, each candidate (see the module doc)."""
    device = family.device
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, shapes.hidden, device=device, generator=gen).to(family.dtype)  # [M, H]
    defaults = {kind: family.default(kind, m, *shapes.linear_shape(kind)) for kind in LAYER_KINDS}
    base = {"section": section, "family": family.name, "m": m}

    def emit(row: dict) -> dict:
        record(row)
        print(f"[{section}] {row.get('variant')} {row.get('layer_kind', '')} {row.get('config', '')}: "
              f"{row.get('chain_us', row.get('error') or row.get('skipped'))}", flush=True)
        return row

    # Layer 0's inputs per kind: what each candidate is checked on before it is timed.
    check_x = {kind: torch.randn(m, shapes.linear_shape(kind)[1], device=device, generator=gen).to(family.dtype)
               for kind in LAYER_KINDS}

    def weight_of(kind: str):
        return weights.head if kind == "lm_head" else weights.layers[0][kind]

    want = {kind: family.twin(kind, check_x[kind], weight_of(kind)) for kind in LAYER_KINDS}
    default_out = {kind: family.launch(kind, check_x[kind], weight_of(kind), defaults[kind]) for kind in LAYER_KINDS}

    def check(kind: str, config) -> str | None:
        got = family.launch(kind, check_x[kind], weight_of(kind), config)
        error = close_error(got, want[kind], family.tolerance * (2.5 if kind == "gate_up" else 1))
        if error is None and getattr(family, "keeps_default_bits", lambda c: False)(config):
            if not torch.equal(got, default_out[kind]):
                error = "not bitwise equal to the default launch (the reduction order changed)"
        return error

    for kind in LAYER_KINDS:
        error = check(kind, defaults[kind])
        if error is not None:
            emit({**base, "variant": "default check", "layer_kind": kind, "config": str(defaults[kind]),
                  "ok": False, "error": error})

    baseline = emit({**base, "variant": "baseline", "layer_kind": "all", "config": "defaults", "ok": True,
                     "defaults": {k: str(v) for k, v in defaults.items()},
                     **_time_chain(chain_function(family, weights, shapes, x, defaults), device, settings)})
    baseline_us = baseline["chain_us"]
    marginal: dict[str, float] = {}
    for kind in LAYER_KINDS if settings.omit_rows else ():
        if settings.spent:
            break
        row = {**base, "variant": "omitted", "layer_kind": kind, "config": "left out", "ok": True,
               **_time_chain(chain_function(family, weights, shapes, x, defaults, omit=kind), device, settings)}
        marginal[kind] = (baseline_us - row["chain_us"]) / shapes.calls(kind)
        row["kind_us_marginal"] = round(marginal[kind], 3)
        n, k = shapes.linear_shape(kind)
        if marginal[kind] > 0:
            row["fraction_of_bandwidth"] = round(family.weight_bytes(kind, n, k) / (marginal[kind] * 1e-6)
                                                 / H200_BYTES_S, 4)
        emit(row)

    per_kind = {}
    for kind in settings.kinds:
        others = [c for c in family.candidates(kind, m, *shapes.linear_shape(kind)) if c != defaults[kind]]
        per_kind[kind] = others[:settings.max_candidates] if settings.max_candidates is not None else others
    for i, (kind, config) in enumerate(_interleave(per_kind)):
        row = {**base, "variant": "candidate", "layer_kind": kind, "config": str(config)}
        if settings.spent:
            emit({**row, "ok": False, "skipped": "budget spent"})
            continue
        if i and i % settings.rebaseline_every == 0:  # clocks drift over minutes: deltas from a recent baseline
            again = {**base, "variant": "baseline (again)", "layer_kind": "all", "config": "defaults", "ok": True,
                     **_time_chain(chain_function(family, weights, shapes, x, defaults), device, settings)}
            baseline_us = emit(again)["chain_us"]
        row["baseline_us"] = baseline_us
        try:
            error = check(kind, config)
            if error is not None:
                emit({**row, "ok": False, "error": error})
                continue
            row.update(ok=True, **_time_chain(
                chain_function(family, weights, shapes, x, {**defaults, kind: config}), device, settings))
        except Exception as e:  # noqa: BLE001  (a config that fails to compile or launch just loses)
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
        emit(_with_estimates(row, baseline_us, marginal, shapes, family))
    end = {**base, "variant": "baseline (end)", "layer_kind": "all", "config": "defaults", "ok": True,
           **_time_chain(chain_function(family, weights, shapes, x, defaults), device, settings)}
    end["drift_us"] = round(end["chain_us"] - baseline["chain_us"], 2)
    emit(end)
