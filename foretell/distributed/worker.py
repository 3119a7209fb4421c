"""One tensor-parallel worker process: the side of the engine that runs on each rank.

The front process (executor.py: ParallelExecutor) starts one worker per rank with a WorkerSpec and
one end of a pipe. The worker joins the group (start_tensor_parallel), builds its object with
`spec.build(tp, device, *spec.build_args)` (for the engine: a model runner holding this rank's
slices; in tests, a stand-in), says it is ready, then serves calls until told to stop:

  front -> worker   Call(method, args, reply)   every rank gets every call, in the same order,
                                                and runs getattr(obj, method)(*args)
                    None                        stop: leave the group and exit
  worker -> front   ("ready", rank, report)     once, after building: the world its group
                                                reports and spec.world_facts(obj), which the
                                                front compares across ranks (start_checks.py)
                    ("result", 0, value)        rank 0, for calls with reply=True
                    ("done", rank)              the other ranks, for calls with reply=True
                    ("error", rank, exception, traceback text)
                                                any rank whose call raised (the exception
                                                itself when it pickles, else None)

Only rank 0 sends its value: the ranks compute the same tokens (greedy picks over the split
vocabulary agree on every rank, tensor_parallel.py), so its result is the step's; the others'
few-byte "done" lets the front tell a call every rank finished from one some rank failed. A worker whose pipe closes
(the front process is gone) exits; a worker never waits on anything but its pipe and the
collectives of the calls it runs.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from foretell.distributed.process_group import start_tensor_parallel, stop_tensor_parallel
from foretell.distributed.start_checks import group_facts

DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start; sent to the spawned process, so every field pickles (`build`
    is a module-level function: the worker imports its module)."""

    rank: int
    world_size: int
    init_method: str  # the group's rendezvous, e.g. "tcp://127.0.0.1:29500"
    build: Callable[..., Any]  # build(tp, device, *build_args) -> the object the calls run on
    build_args: tuple = ()
    device_type: str = "cpu"  # "cuda": rank r runs on cuda:r
    backend: str = "auto"  # process_group.BACKENDS
    join_timeout_s: float = 600.0  # for joining the group, and each collective after
    # world_facts(obj) -> dict: what this rank built, which every rank must agree on (None: only
    # the group's own size and rank are compared). Module-level, like build.
    world_facts: Callable[[Any], dict] | None = None

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {self.device_type!r}")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank) if self.device_type == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple = field(default_factory=tuple)
    reply: bool = True  # whether rank 0 sends the return value back


def run_worker(spec: WorkerSpec, conn) -> None:
    """The worker process's main function (conn: its end of the pipe to the front process)."""
    tp = None
    try:
        tp = start_tensor_parallel(spec.rank, spec.world_size, spec.init_method, spec.device,
                                   spec.backend, spec.join_timeout_s)
        report = group_facts(tp, spec.world_size, spec.rank)
        target = spec.build(tp, spec.device, *spec.build_args)
        if spec.world_facts is not None:
            report.update(spec.world_facts(target))
        conn.send(("ready", spec.rank, report))
    except BaseException as error:  # noqa: BLE001 -- reported to the front, then this worker ends
        _send_error(conn, spec.rank, error)
        # Stay in the group until the front stops us: leaving now would fail a peer waiting in a
        # collective with a connection error, a second error that could hide this one.
        _wait_for_stop(conn)
        _stop(tp)
        return
    try:
        serve(target, spec.rank, conn)
    finally:
        _stop(tp)


def serve(target: Any, rank: int, conn) -> None:
    """Run calls on `target` until the stop message or until the front process is gone."""
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # the front process closed its end: nothing more will come
            return
        if call is None:
            return
        try:
            value = getattr(target, call.method)(*call.args)
        except Exception as error:  # noqa: BLE001 -- the front decides what a failed call means
            _send_error(conn, rank, error)
            continue
        if call.reply:
            try:
                conn.send(("result", 0, value) if rank == 0 else ("done", rank))
            except (BrokenPipeError, OSError):
                return


def _wait_for_stop(conn) -> None:
    while True:
        try:
            if conn.recv() is None:
                return
        except (EOFError, OSError):
            return


def _send_error(conn, rank: int, error: BaseException) -> None:
    text = traceback.format_exc()
    try:
        pickle.dumps(error)
        sent: BaseException | None = error
    except Exception:  # noqa: BLE001 -- an exception that does not pickle travels as text only
        sent = None
    try:
        conn.send(("error", rank, sent, text))
    except (BrokenPipeError, OSError):
        pass


def _stop(tp) -> None:
    if tp is not None:
        try:
            stop_tensor_parallel(tp)
        except Exception:  # noqa: BLE001 -- leaving a broken group must not hide the real error
            pass
