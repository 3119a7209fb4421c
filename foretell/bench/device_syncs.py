"""DeviceSyncCounter: on the CPU, count what a piece of engine code would make a CUDA device do
and wait for: the reads back to the host (each one waits for every kernel queued before it), the
torch ops on device data (each one a kernel launch, or a few), and the host-to-device uploads.

On the CPU every tensor lives in the same memory, so the counter follows which tensors would be
on the device: a tensor is device data when it is a parameter, buffer or KV cache tensor of the
engine's modules (seeded by track_engine), the output of a factory call given an explicit device,
the result of `.to(device)` of host data (what device_util.to_device does), or the output of any
op one of whose inputs is device data (an in-place op marks the tensor it writes too).

A sync is one of these on device data:
  - `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")` (a copy to the host);
  - `.item()`, `bool()`, `int()`, `float()` (aten::_local_scalar_dense);
  - ops whose output shape depends on the data: nonzero (also torch.where with one argument),
    masked_select, boolean indexing (read or write), repeat_interleave without output_size,
    unique, equal.
Each is recorded with its call site (the innermost frame in the foretell package). The counts do
not move with the machine's load, so a test can hold them (tests/structured/test_grammar_syncs.py).
Counting slows the code it watches many times over: never time under it.

    with DeviceSyncCounter() as counter:
        counter.track_engine(llm.engine.runner)
        llm.generate(...)
    counter.num_syncs, counter.sync_sites, counter.num_device_ops, counter.num_uploads
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

# Tensor methods that copy device data to the host (seen at the function level: on the CPU they
# dispatch nothing, on CUDA each is a device-to-host copy that waits for the queue).
HOST_READS = frozenset({"tolist", "numpy", "cpu", "__array__"})
# aten ops that read a device value on the host, or whose output size depends on device data.
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
    "aten::_unique2", "aten::unique_dim", "aten::equal", "aten::is_nonzero",
})
FACTORIES = frozenset({"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn",
                       "randint", "zeros_like", "ones_like", "empty_like", "full_like", "linspace", "eye"})
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../foretell
THIS_FILE = os.path.abspath(__file__)
PASS_THROUGH = (THIS_FILE, os.path.join(PACKAGE_DIR, "device_util.py"))  # sites named by their callers


def _call_site() -> str:
    """file:line of the innermost frame inside the foretell package (not this file, nor to_device's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(PACKAGE_DIR) and name not in PASS_THROUGH:
            return f"{os.path.relpath(name, os.path.dirname(PACKAGE_DIR))}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside foretell>"


def _is_host_device(value) -> bool:
    return value is not None and not isinstance(value, torch.dtype) and torch.device(value).type == "cpu"


def _target_device(args, kwargs):
    """The device a Tensor.to(...) call names (None: none)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "DeviceSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = self.counter
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not any(counter.on_device(a) for a in inputs):
            return out
        counter.num_device_ops += 1
        name = func._schema.name
        if name in SYNC_OPS or _data_dependent(name, args, kwargs):
            counter.record_sync(name.removeprefix("aten::"))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                counter.mark(t)
        for a in inputs:  # an in-place or out= op: the tensor it wrote holds device data now
            counter.mark(a)
        return out


def _data_dependent(name: str, args, kwargs) -> bool:
    """Boolean indexing and repeat_interleave without output_size: sizes known after a sync."""
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None
    return False


class _Function(TorchFunctionMode):
    def __init__(self, counter: "DeviceSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_device = source is not None and counter.on_device(source)
        if on_device and name in HOST_READS:
            counter.record_sync(name)
        out = func(*args, **kwargs)
        if name == "to" and source is not None:
            device = _target_device(args, kwargs)
            if device is not None and not on_device:  # host data sent to the device (on the CPU: itself)
                counter.record_upload()
                counter.mark(out)
            elif on_device and _is_host_device(device):  # device data read back to the host
                counter.record_sync("to(cpu)")
        elif name in FACTORIES and kwargs.get("device") is not None and isinstance(out, torch.Tensor):
            counter.mark(out)
        return out


class DeviceSyncCounter:
    def __init__(self) -> None:
        self._device = WeakTensorKeyDictionary()  # tensor -> True: holds device data
        self.num_syncs = 0
        self.sync_sites: Counter[str] = Counter()  # "what at file:line" -> count
        self.num_device_ops = 0  # aten ops with device data in or out (kernel launches, roughly)
        self.num_uploads = 0  # host data sent to the device with .to(device)
        self.upload_sites: Counter[str] = Counter()  # "file:line" -> count
        self.enabled = True  # paused while False (counts nothing, marks nothing new)
        self._modes: list = []

    # ---- what holds device data ----------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        if self.enabled:
            self._device[tensor] = True

    def on_device(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, torch.nn.Parameter) or tensor in self._device

    def track_modules(self, modules) -> None:
        for module in modules:
            for t in (*module.parameters(), *module.buffers()):
                self.mark(t)

    def track_engine(self, runner) -> None:
        """Seed with a ModelRunner's target and drafter modules and its KV caches."""
        modules = [runner.model]
        if runner.proposer is not None and hasattr(runner.proposer, "draft_modules"):
            modules += list(runner.proposer.draft_modules())
        self.track_modules(modules)
        for cache in (getattr(runner, "kv_cache", None), getattr(runner, "draft_kv_cache", None)):
            for t in getattr(cache, "tensors", None) or []:
                self.mark(t)

    # ---- counting ------------------------------------------------------------------------
    def record_sync(self, what: str) -> None:
        if self.enabled:
            self.num_syncs += 1
            self.sync_sites[f"{what} at {_call_site()}"] += 1

    def record_upload(self) -> None:
        if self.enabled:
            self.num_uploads += 1
            self.upload_sites[_call_site()] += 1

    def snapshot(self) -> dict:
        """The counts so far (subtract two to count a stretch)."""
        return {"syncs": self.num_syncs, "device_ops": self.num_device_ops, "uploads": self.num_uploads,
                "sites": Counter(self.sync_sites)}

    def __enter__(self) -> "DeviceSyncCounter":
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


def difference(after: dict, before: dict) -> dict:
    """snapshot() after minus before."""
    sites = Counter(after["sites"])
    sites.subtract(before["sites"])
    return {"syncs": after["syncs"] - before["syncs"], "device_ops": after["device_ops"] - before["device_ops"],
            "uploads": after["uploads"] - before["uploads"], "sites": +sites}


def syncs_per_step(llm, prompts: list, params) -> tuple[list[tuple[bool, dict]], list]:
    """Run `prompts` through `llm` (an LLM, warmed up by the caller) counting per engine step:
    ([(whether the step verified drafts, its counts as `difference` gives them)], the outputs).
    The runner's execute is wrapped for the run only (an instance attribute, removed after)."""
    runner = llm.engine.runner
    steps: list[tuple[bool, dict]] = []
    execute = runner.execute

    def counted(sched):
        before = counter.snapshot()
        out = execute(sched)
        steps.append((any(item.draft_token_ids for item in sched.scheduled), difference(counter.snapshot(), before)))
        return out

    runner.execute = counted
    try:
        with DeviceSyncCounter() as counter:
            counter.track_engine(runner)
            outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.execute  # the class's method again
    return steps, outputs
