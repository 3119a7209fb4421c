"""Calling a small Triton kernel's compiled launcher directly, for the launches on a decode step's
host path (the graph inputs' unpack, the decode advance): after the first launch through
`kernel[grid](...)` the compiled kernel is kept in a dict its caller owns, and later launches call
its launcher with the stream and the arguments, skipping Triton's argument binding, specialization
and cache lookup (tens of microseconds of host time a launch).

Only on the Triton versions whose launcher signature this was written against
(DIRECT_LAUNCH_TRITON_VERSIONS); a launch hook (a profiler) or a launcher that refuses the call
sends every later launch through the normal path. The caller's key must name what the kernel was
specialized on (pointer alignment, any specialized integer), so a key seen again means the same
compiled kernel.
"""

from __future__ import annotations

import logging

import torch
import triton
from triton import knobs

logger = logging.getLogger("foretell")

DIRECT_LAUNCH_TRITON_VERSIONS = ("3.6.",)


def launch_kept(kernel, grid: int, args: tuple, block: int, launches: dict | None, key: tuple,
                device: torch.device, name: str) -> None:
    """kernel[(grid,)](*args, BLOCK=block), the launcher called directly once `launches` holds the
    compiled kernel for `key` (None: always the normal launch)."""
    enter_hook, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    direct = launches is not None and triton.__version__.startswith(DIRECT_LAUNCH_TRITON_VERSIONS)
    if not direct or launches.get("direct_failed") or _has_calls(enter_hook) or _has_calls(exit_hook):
        kernel[(grid,)](*args, BLOCK=block)
        return
    compiled = launches.get(key)
    if compiled is None:
        launches[key] = kernel[(grid,)](*args, BLOCK=block)
        return
    stream = torch.cuda.current_stream(device).cuda_stream
    # What JITFunction.run passes once it holds the kernel (no hook calls: no launch metadata).
    try:
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, enter_hook, exit_hook,
                     *args, block)
    except (AttributeError, TypeError) as e:  # another Triton's launcher: the normal path from now on
        logger.warning("%s: direct launch refused by this Triton (%s); using the normal launch", name, e)
        launches["direct_failed"] = True
        kernel[(grid,)](*args, BLOCK=block)


def _has_calls(hook) -> bool:
    """Whether a Triton launch hook (None, a function, or a HookChain of them) calls anything."""
    return bool(getattr(hook, "calls", hook))
