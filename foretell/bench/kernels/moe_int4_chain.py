"""The int4 MoE GEMV (ops/moe/triton_int4_gemv.py) timed inside a CUDA graph over several MoE layers,
each with its own experts, so no layer finds its weights in L2 (the in-graph sweep's second
section, scripts/sweep_linears_in_graph_gpu.py --moe-int4).

Kimi-K2.5's routed experts: hidden 7168, expert intermediate 2048, top 8 of 384, one token. Only
the experts a token is routed to are read, so each layer holds just its top_k experts (the kernel
indexes [E, ...] stacks by expert id: the other 376 would change no address it reads); the chain
runs layer l's experts on layer l - 1's output (x [1, H] -> layer 0 -> ... -> layer L-1), each
layer the engine's two launches (gate_up, then down + combine), captured in one graph.

Reported per chain and per layer: microseconds and the share of the H200's peak bandwidth
(H200_BYTES_S) that the routed experts' bytes (packed words and scales) make. Candidates: the launch
config space of each kernel (BLOCK_N, BLOCK_K, num_warps; the down kernel's SPLIT of slots), nearest
the default first, each swapped in with the other kernel at its default, then the whole configs the
kernel module's candidate_configs lists (other kernel variants), each after a check against the
torch twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from foretell.bench.kernels.linear_chain import H200_BYTES_S, SweepSettings, _interleave, _time_chain
from foretell.bench.kernels.linear_kinds import close_error

MOE_KERNELS = ("gate_up", "down")  # swept one at a time; "both": the kernel module's whole configs


@dataclass(frozen=True)
class MoeShapes:
    hidden: int
    intermediate: int  # per expert
    num_experts: int  # in the model (only top_k per layer are allocated: see the module doc)
    top_k: int
    num_layers: int  # MoE layers in the chain


KIMI_K25 = MoeShapes(hidden=7168, intermediate=2048, num_experts=384, top_k=8, num_layers=16)
TINY_MOE = MoeShapes(hidden=256, intermediate=128, num_experts=16, top_k=4, num_layers=2)


def build_layers(shapes: MoeShapes, device: torch.device, seed: int = 0) -> list[dict]:
    """Per layer: packed int4 experts (random words: nibbles uniform in [-8, 7]), bf16 group scales,
    routing ids (a permutation of the layer's experts) [1, top_k] and float32 weights [1, top_k]."""
    from foretell.ops.moe import int4_reference as int4

    gen = torch.Generator(device=device).manual_seed(seed)

    def linear(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(-2**31, 2**31 - 1, (shapes.top_k, n, int4.words(k)), generator=gen, device=device,
                               dtype=torch.int32)  # [E, n, k / 8]
        scale = (torch.rand(shapes.top_k, n, int4.groups(k), generator=gen, device=device) + 0.5) / (4 * k**0.5)
        return packed, scale.to(torch.bfloat16)  # [E, n, k / 32]

    layers = []
    for _ in range(shapes.num_layers):
        gate_up = linear(2 * shapes.intermediate, shapes.hidden)
        down = linear(shapes.hidden, shapes.intermediate)
        ids = torch.randperm(shapes.top_k, generator=gen, device=device).view(1, shapes.top_k)
        weights = torch.rand(1, shapes.top_k, generator=gen, device=device) / shapes.top_k
        layers.append({"tensors": (*gate_up, *down), "ids": ids, "weights": weights})
    return layers


def layer_bytes(layer: dict) -> int:
    """The routed experts' packed words and scales: what one token's MoE layer must read."""
    return sum(t.numel() * t.element_size() for t in layer["tensors"])


def default_config() -> dict:
    from foretell.ops.moe.triton_int4_gemv import int4_launch_config

    return int4_launch_config(1, KIMI_K25.top_k)


def _distance(config: dict, default: dict) -> float:
    return sum(abs(math.log2(config[key] / value)) for key, value in default.items()
               if isinstance(value, int) and not isinstance(value, bool) and key in config)


def candidate_configs(kernel: str) -> list[dict]:
    """One kernel's launch configs (that kernel's dict; other keys of the default, such as a kernel
    variant, kept), nearest the default first: gate_up holds BLOCK_N rows of gate and of up over
    BLOCK_K columns (2..32 packed words a thread a tile); down BLOCK_N columns over BLOCK_K, a
    token's slots spread over SPLIT programs."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"int4 MoE kernel must be one of {list(MOE_KERNELS)}, got {kernel!r}")
    default = default_config()[kernel]
    configs = []
    if kernel == "gate_up":
        for rows in (2, 4, 8, 16, 32):
            for columns in (256, 512, 1024, 2048):
                for warps in (1, 2, 4, 8):
                    if 2 <= 2 * rows * columns // 8 // (32 * warps) <= 32:
                        configs.append({**default, "BLOCK_N": rows, "BLOCK_K": columns, "num_warps": warps})
    else:
        for rows in (4, 8, 16, 32):
            for columns in (128, 256, 512):
                for warps in (1, 2, 4):
                    for split in (2, 4, 8):
                        if 1 <= rows * columns // 8 // (32 * warps) <= 16:
                            configs.append({**default, "BLOCK_N": rows, "BLOCK_K": columns, "num_warps": warps,
                                            "SPLIT": split})
    configs = [c for c in configs if c != default]
    return sorted(configs, key=lambda c: _distance(c, default))


def module_candidates() -> list[dict]:
    """Whole launch configs (both kernels) the kernel module lists for a sweep, if it lists any
    (other kernel variants live there), without the default."""
    from foretell.ops.moe import triton_int4_gemv

    listed = getattr(triton_int4_gemv, "candidate_configs", None)
    if listed is None:
        return []
    default = default_config()
    try:
        return [c for c in listed(1, KIMI_K25.top_k) if c != default]
    except (TypeError, ValueError) as e:  # a module whose list takes other arguments: its own sweep's
        print(f"[int4 moe] the kernel module's candidate_configs were left out: {type(e).__name__}: {e}")
        return []


def moe_layer(x: torch.Tensor, layer: dict, config: dict | None, use_kernels: bool) -> torch.Tensor:  # [1, H]
    if not use_kernels:
        return moe_layer_twin(x, layer)
    from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton

    return fused_int4_experts_gemv_triton(x, *layer["tensors"], layer["weights"], layer["ids"], None,
                                          out_dtype=x.dtype, config=config)


def moe_layer_twin(x: torch.Tensor, layer: dict) -> torch.Tensor:  # [1, H], x's dtype
    from foretell.ops.moe.int4_reference import int4_experts_forward_torch

    return int4_experts_forward_torch(x, *layer["tensors"], layer["weights"], layer["ids"]).to(x.dtype)


def chain_function(layers: list[dict], x: torch.Tensor, config: dict | None,
                   use_kernels: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        h = x  # [1, H]
        for layer in layers:
            h = moe_layer(h, layer, config, use_kernels)
        return h

    return run


def sweep_moe_int4(layers: list[dict], shapes: MoeShapes, device: torch.device, use_kernels: bool,
                   settings: SweepSettings, record: Callable[[dict], None], section: str = "int4 moe") -> None:
    """The default chain, each kernel's candidates swapped in one at a time, the default again."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, shapes.hidden, device=device, generator=gen).to(torch.bfloat16)  # [1, H]
    total_bytes = sum(layer_bytes(layer) for layer in layers)
    want = moe_layer_twin(x, layers[0])
    base = {"section": section, "family": "int4_moe", "m": 1, "layers": shapes.num_layers,
            "bytes_per_layer": layer_bytes(layers[0])}

    def timed(config: dict | None) -> dict:
        row = _time_chain(chain_function(layers, x, config, use_kernels), device, settings)
        row["us_per_layer"] = round(row["chain_us"] / shapes.num_layers, 3)
        row["fraction_of_bandwidth"] = round(total_bytes / (row["chain_us"] * 1e-6) / H200_BYTES_S, 4)
        return row

    def emit(row: dict) -> None:
        record(row)
        print(f"[{section}] {row['variant']} {row.get('layer_kind', '')} {row.get('config', '')}: "
              f"{row.get('chain_us', row.get('error') or row.get('skipped'))} "
              f"{row.get('fraction_of_bandwidth', '')}", flush=True)

    default = default_config()
    baseline = {**base, "variant": "baseline", "layer_kind": "all", "config": str(default), "ok": True, **timed(None)}
    emit(baseline)
    per_kernel = {}
    for kernel in MOE_KERNELS:
        configs = candidate_configs(kernel)
        per_kernel[kernel] = configs[:settings.max_candidates] if settings.max_candidates is not None else configs
    whole = module_candidates()
    per_kernel["both"] = whole[:settings.max_candidates] if settings.max_candidates is not None else whole
    for kernel, config in _interleave(per_kernel):
        row = {**base, "variant": "candidate", "layer_kind": kernel, "config": str(config)}
        if settings.spent:
            emit({**row, "ok": False, "skipped": "budget spent"})
            continue
        swapped = config if kernel == "both" else {kernel: config}
        try:
            error = close_error(moe_layer(x, layers[0], swapped, use_kernels), want, 3e-2)
            if error is not None:
                emit({**row, "ok": False, "error": error})
                continue
            row.update(ok=True, **timed(swapped))
            row["delta_per_layer_us"] = round((row["chain_us"] - baseline["chain_us"]) / shapes.num_layers, 3)
        except Exception as e:  # noqa: BLE001  (a config that fails to compile or launch just loses)
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
        emit(row)
    end = {**base, "variant": "baseline (end)", "layer_kind": "all", "config": str(default), "ok": True, **timed(None)}
    end["drift_us"] = round(end["chain_us"] - baseline["chain_us"], 2)
    emit(end)
