"""Programmatic dependent launch (PDL, Hopper's griddepcontrol) for the decode step's kernels.

Normally a kernel starts only when the one before it on the stream has finished and its writes are
flushed. A kernel launched with PDL may start earlier, as soon as every program of the kernel
before it has called `launch_dependents` (or exited). It must then `wait` (griddepcontrol.wait:
until that kernel has completed and its memory is visible) before it reads anything that kernel,
or any kernel before it, wrote, and before it writes anything they read. What it may do before the
wait is read memory no kernel of the step writes: its weights (written only while the model loads;
layers/small_m.py's prepare_small_m_linears synchronizes the device before binding the GEMV to the layers).

Rules that keep a whole CUDA graph of such launches ordered:
  - every program of a PDL-launched kernel calls `wait`, whatever path it takes; so each kernel
    still completes after the one before it, and completions stay in stream order;
  - a kernel calls `launch_dependents` only once it is past its own dependency (after its `wait`,
    or anywhere in a kernel launched normally), so at most one kernel runs ahead;
  - a weight-streaming kernel calls it at the end of its work, not the start: its dependents would
    otherwise take multiprocessor slots while its own later programs still wait for them.

Kernels that read their inputs at once (the norms, RoPE + KV write, the attention) are launched
with PDL too and start with `join_dependent_chain`: wait, then release. So each starts as soon as
the kernel before it lets it, and the GEMV after it streams its weights while it runs.

Both instructions are no-ops when the launch did not ask for PDL. Triton's interpreter knows neither:
kernels take a PDL constexpr, False there, on GPUs before Hopper, and with a Triton that lacks them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_HAS_PDL = True
except ImportError:  # a Triton without griddepcontrol: kernels launch plainly, these are never traced
    TRITON_HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def join_dependent_chain(PDL: tl.constexpr):
    """The first step of a kernel whose every read may depend on the kernel before it: wait for
    that kernel, then let the next one launch (which only reads weights until this one is done)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can use PDL: a Hopper (or newer) GPU, not the interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return TRITON_HAS_PDL and t.is_cuda and not interpreted and _capability_at_least_hopper(t.device.index or 0)


@functools.cache
def _capability_at_least_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch that asks for PDL (none otherwise)."""
    return {"launch_pdl": True} if pdl else {}
