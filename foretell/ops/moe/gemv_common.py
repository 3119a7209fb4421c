"""What the three GEMV MoE paths share: everything but how a weight tile is read.

The paths are triton_gemv.py (weights in the model dtype), fp8_triton_gemv.py (FP8 blocks) and
triton_int4_gemv.py (packed int4); read triton_gemv.py's docstring for the two kernels' grids,
the slot split of the down kernel, its counters and why it is compiled without FMA contraction.
This module owns the steps that do not touch the weights:
  - on the device: the gate_up kernel's zeroing of the down kernel's counters and its rounded
    silu(gate) * up store; the down kernel's split-slot combine (the last program of a column
    block to arrive sums the slots in slot order) and its store of a token's columns;
  - on the host: the launch plan (flat pair ids and weights, the slot split with its scratch and
    counters, the act and out buffers, the grids and the constexprs every format passes alike),
    the output of a forward with no (token, expert) pair, and the FP8 and int4 paths' per-kernel
    config overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The launch config keys of the FP8 and int4 paths, per kernel ("gate_up" / "down"; SPLIT: down).
QUANTIZED_KERNEL_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT")


@triton.jit
def _zero_counters(counters_ptr, num_counters):
    """The first program of the gate_up grid zeroes the down kernel's counters [num_counters] int32:
    the down kernel runs after it on the same stream, so no memset launch is needed."""
    if tl.program_id(0) + tl.program_id(1) == 0:
        lanes = tl.arange(0, 256)
        for start in range(0, num_counters, 256):
            tl.store(counters_ptr + start + lanes, tl.zeros([256], dtype=tl.int32), mask=start + lanes < num_counters)


@triton.jit
def _store_silu_product(gate, up, act_ptr, pair, stride_act, cols, col_valid):
    """act[pair, cols] = silu(gate) * up from the float32 projections gate and up [BLOCK_N], rounded
    where the twin rounds: each projection, silu(gate), then the product (to act's dtype)."""
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + cols, (silu * up).to(dtype), mask=col_valid)


@triton.jit
def _down_program(hidden, BLOCK_N: tl.constexpr):
    """The token, column block and slot group of this program of the down grid
    (num_tokens, cdiv(hidden, BLOCK_N), groups), with its columns [BLOCK_N] and their mask."""
    token = tl.program_id(0).to(tl.int64)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return token, col_block, tl.program_id(2), cols, cols < hidden


@triton.jit
def _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out,
                 HAS_SHARED: tl.constexpr):
    """out[token, cols] = acc (the float32 sum of the token's weighted slots) + shared[token, cols],
    cast to out's dtype once."""
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * stride_shared + cols, mask=col_valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_valid)


@triton.jit
def _combine_split_slots(scratch_ptr, counters_ptr, shared_ptr, out_ptr, token, col_block, cols, col_valid, hidden,
                         stride_shared, stride_out, TOP_K: tl.constexpr, GROUPS: tl.constexpr,
                         HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Called by each of the GROUPS down programs of (token, col_block) once it has stored its
    slots' weighted outputs in scratch [num_pairs, hidden] float32: it counts itself in, and the
    last to arrive sums all TOP_K slots in slot order (the same sum, bit for bit, as one program
    summing them all) and stores the token's columns."""
    # Every thread's scratch stores happen before the (single-thread) release of the count;
    # the last of the GROUPS programs then sees all of them.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + token * tl.num_programs(1) + col_block, 1, sem="acq_rel", scope="gpu")
    if arrived == GROUPS - 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(scratch_ptr + (token * TOP_K + k) * hidden + cols, mask=col_valid, other=0.0,
                           cache_modifier=".cg")
        _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out, HAS_SHARED)


def no_pairs_output(num_tokens: int, hidden_size: int, shared: torch.Tensor | None, out_dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:  # [num_tokens, hidden_size] out_dtype
    """The experts' sum when no (token, expert) pair is routed (top_k 0 or no tokens): zeros, plus
    the shared experts' output when given."""
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device)
    return (out if shared is None else out + shared).to(out_dtype)


def launch_options(cfg: dict) -> dict:
    """A kernel's resolved config as launch keywords: the tiles and Triton's options, not SPLIT
    (the host's slot split of the down kernel)."""
    return {key: value for key, value in cfg.items() if key != "SPLIT"}


@dataclass(frozen=True)
class GemvPlan:
    """The buffers, grids and format-independent arguments of one GEMV MoE forward."""

    flat_ids: torch.Tensor  # [num_pairs] expert of each (token, k) pair
    pair_weights: torch.Tensor  # [num_pairs] float32 routing weights
    act: torch.Tensor  # [num_pairs, inter] gate_up's output
    out: torch.Tensor  # [num_tokens, hidden] out_dtype
    shared_or_out: torch.Tensor  # [num_tokens, hidden] the shared experts' output, or out (not read)
    stride_shared: int
    scratch: torch.Tensor  # [num_pairs, hidden] float32 weighted slot outputs (groups > 1; else not read)
    counters: torch.Tensor  # [num_tokens * column_blocks] int32 (groups > 1; else not read)
    top_k: int
    slots: int  # slots per down program
    groups: int  # down programs per (token, column block): cdiv(top_k, slots)
    column_blocks: int  # cdiv(hidden, down BLOCK_N)
    has_shared: bool

    def gate_up_grid(self, block_n: int) -> tuple[int, int]:
        return self.flat_ids.numel(), triton.cdiv(self.act.shape[1], block_n)

    @property
    def down_grid(self) -> tuple[int, int, int]:
        return self.out.shape[0], self.column_blocks, self.groups

    @property
    def num_counters(self) -> int:
        """Counters the gate_up kernel zeroes: all of them when the down kernel splits, else none."""
        return self.counters.numel() if self.groups > 1 else 0

    @property
    def gate_up_constexprs(self) -> dict:
        return {"TOP_K": self.top_k, "ZERO_COUNTERS": self.groups > 1}

    @property
    def down_constexprs(self) -> dict:
        return {"TOP_K": self.top_k, "SLOTS": self.slots, "GROUPS": self.groups, "HAS_SHARED": self.has_shared}


def plan_gemv(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    weights: torch.Tensor,  # [num_tokens, top_k]
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None,  # [num_tokens, hidden]
    inter: int,
    act_dtype: torch.dtype,  # the model dtype gate_up rounds to
    out_dtype: torch.dtype,
    split: int,  # the down kernel's SPLIT: programs a column block's slots are spread over
    down_block_n: int,
) -> GemvPlan:
    """The plan of a forward with at least one (token, expert) pair; inputs already checked."""
    num_tokens, top_k = ids.shape
    hidden_size = hidden.shape[1]
    num_pairs = num_tokens * top_k
    device = hidden.device
    pair_weights = weights.reshape(num_pairs).float().contiguous()  # [num_pairs]
    slots = min(top_k, triton.cdiv(top_k, split))
    groups = triton.cdiv(top_k, slots)
    column_blocks = triton.cdiv(hidden_size, down_block_n)
    if groups > 1:
        scratch = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=device)
        counters = torch.empty(num_tokens * column_blocks, dtype=torch.int32, device=device)
    else:
        scratch = counters = pair_weights  # not read
    out = torch.empty(num_tokens, hidden_size, dtype=out_dtype, device=device)  # [T, H]
    return GemvPlan(
        flat_ids=ids.reshape(num_pairs).contiguous(),
        pair_weights=pair_weights,
        act=torch.empty(num_pairs, inter, dtype=act_dtype, device=device),  # [num_pairs, I]
        out=out,
        shared_or_out=shared if shared is not None else out,
        stride_shared=shared.stride(0) if shared is not None else 0,
        scratch=scratch,
        counters=counters,
        top_k=top_k,
        slots=slots,
        groups=groups,
        column_blocks=column_blocks,
        has_shared=shared is not None,
    )


def override_kernel_configs(defaults: dict, config: dict | None, label: str, extra_keys: tuple = ()) -> dict:
    """defaults {"gate_up": {...}, "down": {...}} updated by config's per-kernel dicts of
    QUANTIZED_KERNEL_KEYS (and the path's extra_keys); ValueError naming an unknown kernel or key.
    label names the path in errors ("FP8 MoE", "int4 MoE"); the caller checks the values its
    kernels need."""
    keys = QUANTIZED_KERNEL_KEYS + tuple(extra_keys)
    resolved = {name: dict(cfg) for name, cfg in defaults.items()}
    for name, overrides in (config or {}).items():
        if name not in resolved or not isinstance(overrides, dict):
            raise ValueError(f"{label} config keys are 'gate_up' and 'down' (dicts), got {name!r}")
        unknown = sorted(set(overrides) - set(keys))
        if unknown:
            raise ValueError(f"unknown {label} {name} config keys {unknown}; expected {list(keys)}")
        resolved[name].update(overrides)
    return resolved
