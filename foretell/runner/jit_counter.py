"""Counting Triton kernel compilations in this process (a new specialization of a @triton.jit
kernel: a new shape class, dtype or constexpr met at run time), so that the server can show
compilations after warm-up as `foretell:jit_compiles_total`.

Triton calls `triton.knobs.runtime.jit_post_compile_hook` after every compilation (cache miss in
a JITFunction's in-memory kernel cache, whether the binary then comes from Triton's disk cache or
from the compiler). That hook is one process-wide slot, and Triton's kernel caches are
process-wide too, so the count is per process: the counter lives in that slot (no state of our
own at module level), installed once and shared by every engine of the process; whatever hook was
there before is still called. The Triton interpreter (TRITON_INTERPRET=1, the CPU path) compiles
nothing and never calls the hook, so on the CPU the count stays 0.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class JitCompileCounter:
    """A jit_post_compile_hook that counts compilations and calls the hook it replaced."""

    def __init__(self, previous_hook: Callable[..., Any] | None = None):
        self.previous_hook = previous_hook
        self._count = 0
        self._lock = threading.Lock()  # kernels may compile on several threads at once

    @property
    def count(self) -> int:
        return self._count

    def __call__(self, **hook_kwargs: Any) -> Any:
        with self._lock:
            self._count += 1
        if self.previous_hook is not None:
            return self.previous_hook(**hook_kwargs)
        return None


def jit_compile_counter(runtime_knobs: Any = None) -> JitCompileCounter:
    """The counter installed in Triton's jit_post_compile_hook, installing it on the first call.
    Install it before the first kernel compiles (the server does, before it builds the engine):
    compilations before that are not counted. Without Triton, a counter that stays at 0.

    runtime_knobs: the object holding the hook slot (default `triton.knobs.runtime`)."""
    if runtime_knobs is None:
        try:
            from triton import knobs
        except ImportError:
            return JitCompileCounter()
        runtime_knobs = knobs.runtime
    current = getattr(runtime_knobs, "jit_post_compile_hook", None)
    if isinstance(current, JitCompileCounter):
        return current
    counter = JitCompileCounter(previous_hook=current)
    runtime_knobs.jit_post_compile_hook = counter
    return counter
