"""The front process's side of tensor parallelism: start one worker per rank, send every call to
all of them, read rank 0's answer, and never hang on a worker that died.

  executor = ParallelExecutor(world_size, build, build_args, device_type="cuda")
  value = executor.call("execute", plan)   # every rank runs target.execute(plan); rank 0's value
  executor.broadcast("forget", seq_id)     # every rank runs it; no answer awaited
  executor.shutdown()                      # or `with ParallelExecutor(...) as executor:`

Workers are spawned processes (worker.py: run_worker), one pipe each; calls reach every rank in
the order they were made. While it waits, the executor watches the workers' process sentinels
beside the pipes, so a worker that exits (killed, out of memory, a crash in a kernel) raises
WorkerDied naming its rank and exit code at once, even while the other ranks sit in a collective
waiting for it.

Start-up: any failure while a worker joins its group or builds its object (a bad checkpoint, heads
that do not divide, out of memory) reaches the caller at once as one error naming the rank and
the cause: the worker's own exception type with "tensor-parallel worker rank r of n could not
start: ..." as its message (the worker's traceback as a note; WorkerFailed when the type cannot
be rebuilt so), never a wait on the ranks still loading or stuck in a collective. A worker that
exits while starting raises WorkerDied ("while starting"). Once every rank is built, their
reports must agree (start_checks.world_mismatch: the group's size and rank, and what
world_facts(obj) says each built): else WorkerFailed naming the rank and the field.

Errors inside a call: when every rank raised (the same check on the same inputs: a bad request,
a SequenceError), rank 0's exception is raised here as itself, with the worker's traceback as a
note, and the executor stays usable, as a one-device runner would. When only some ranks raised,
the ranks no longer agree (and the others may wait in a collective for the one that failed):
WorkerFailed names the ranks and the executor shuts down. After WorkerDied or WorkerFailed every
later call raises.
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from typing import Any, Callable

import torch.multiprocessing as mp

from foretell.distributed.process_group import free_local_port
from foretell.distributed.start_checks import last_line, start_failure, world_mismatch
from foretell.distributed.worker import Call, WorkerSpec, run_worker

# Once a rank has reported an error, how long the others get by default to report theirs (ranks
# raising the same error answer within the step's time; a rank waiting in a collective never does).
ERROR_GRACE_S = 5.0
# After an error, how long to look for a dead worker behind it (a rank in a collective with a
# dead peer fails with a connection error; the death is the cause to report).
DEATH_GRACE_S = 0.5
STOP_TIMEOUT_S = 10.0


class WorkerDied(RuntimeError):
    """A worker process exited while the engine still needed it."""


class WorkerFailed(RuntimeError):
    """A worker raised where the ranks can no longer be trusted to agree (while starting, or on
    some ranks but not all)."""


class ParallelExecutor:
    def __init__(
        self,
        world_size: int,
        build: Callable[..., Any],  # module-level: build(tp, device, *build_args) in each worker
        build_args: tuple = (),
        *,
        device_type: str = "cpu",
        backend: str = "auto",
        start_timeout_s: float = 600.0,
        join_timeout_s: float = 600.0,
        error_grace_s: float = ERROR_GRACE_S,
        world_facts: Callable[[Any], dict] | None = None,  # module-level: what each rank built
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        context = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_local_port()}"
        self.world_size = world_size
        self.error_grace_s = error_grace_s
        self.closed = False
        self.started = False
        self.connections = []
        self.processes = []
        for rank in range(world_size):
            spec = WorkerSpec(rank, world_size, init_method, build, tuple(build_args), device_type, backend,
                              join_timeout_s, world_facts)
            front_end, worker_end = context.Pipe(duplex=True)
            process = context.Process(target=run_worker, args=(spec, worker_end), daemon=True,
                                      name=f"foretell-tp-rank{rank}")
            process.start()
            worker_end.close()  # the worker has its own; ours would keep the pipe open past its death
            self.connections.append(front_end)
            self.processes.append(process)
        try:
            self._wait_ready(time.monotonic() + start_timeout_s)
            self.started = True
        except BaseException:
            self.shutdown(timeout_s=0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    # ------------------------------------------------------------------------------- calls

    def call(self, method: str, *args: Any) -> Any:
        """Every rank runs `method(*args)` on its object; returns rank 0's value."""
        self._send(Call(method, args, reply=True))
        answers: dict[int, tuple] = {}
        first_error_at = None
        while len(answers) < self.world_size:
            deadline = None if first_error_at is None else first_error_at + self.error_grace_s
            messages = self._next_messages(deadline)
            if messages is None:  # some ranks raised, the others never answered
                break
            for rank, message in messages:
                answers[rank] = message
                if message[0] == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
        errors = {rank: m for rank, m in answers.items() if m[0] == "error"}
        if not errors:
            return answers[0][2]
        self._raise_error(errors, every_rank_raised=len(errors) == self.world_size)

    def broadcast(self, method: str, *args: Any) -> None:
        """Every rank runs `method(*args)`; returns at once (an error shows at the next call)."""
        self._send(Call(method, args, reply=False))

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every worker: a stop message, then past timeout_s terminate and kill (timeout 0
        once a worker has died: the others may be stuck in a collective). Safe to call twice."""
        self.closed = True
        for connection in self.connections:
            try:
                connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        for connection in self.connections:
            connection.close()

    def __enter__(self) -> "ParallelExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------------- internals

    def _send(self, call: Call) -> None:
        if self.closed:
            raise RuntimeError("the parallel executor is shut down (a worker died or failed, or shutdown was called)")
        self._check_before_sending()
        for rank, connection in enumerate(self.connections):
            try:
                connection.send(call)
            except (BrokenPipeError, OSError):
                self._raise_died(rank)

    def _wait_ready(self, deadline: float) -> None:
        reports: dict[int, dict] = {}
        while len(reports) < self.world_size:
            messages = self._next_messages(deadline)
            if messages is None:
                waiting = sorted(set(range(self.world_size)) - set(reports))
                raise TimeoutError(f"tensor-parallel workers {waiting} did not start within the time allowed")
            errors = {rank: message for rank, message in messages if message[0] == "error"}
            if errors:
                self._raise_start_error(errors)
            for rank, message in messages:
                reports[rank] = message[2]
        mismatch = world_mismatch(reports, self.world_size)
        if mismatch is not None:
            raise WorkerFailed(mismatch)

    def _raise_start_error(self, errors: dict[int, tuple]) -> None:
        """A worker failed to start: gather what the others report within DEATH_GRACE_S (ranks
        that fail the same check answer at once; a rank loading weights or waiting in a collective
        does not, and is not waited for), report a death behind it first, then the lowest
        failed rank's error."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            others = [rank for rank in range(self.world_size) if rank not in errors]
            pipes = {self.connections[rank]: rank for rank in others}
            sentinels = {self.processes[rank].sentinel: rank for rank in others}
            ready = wait(list(pipes) + list(sentinels), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for item in ready:
                if item in pipes:
                    try:
                        message = item.recv()
                    except (EOFError, OSError):  # its exit shows on its sentinel
                        continue
                    if message[0] == "error":
                        errors[pipes[item]] = message
            for item in ready:
                if item in sentinels and sentinels[item] not in errors:
                    self._raise_died(sentinels[item])
        rank = min(errors)
        _, _, error, text = errors[rank]
        self.shutdown(timeout_s=0.0)
        rebuilt = start_failure(rank, self.world_size, sorted(errors), error, text)
        if rebuilt is not None:
            raise rebuilt from None
        failure = WorkerFailed(f"tensor-parallel worker rank {rank} of {self.world_size} could not start "
                               f"(ranks that failed: {sorted(errors)}): {last_line(text)}")
        failure.add_note(f"the worker's traceback (rank {rank}):\n{text}")
        raise failure

    def _next_messages(self, deadline: float | None) -> list[tuple[int, tuple]] | None:
        """Block until a worker sends something or exits, or until the deadline (then None);
        returns (rank, message) pairs. A worker's exit raises WorkerDied once what it sent
        before exiting has been read."""
        ranks = {connection: rank for rank, connection in enumerate(self.connections)}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(ranks) + list(sentinels), timeout=timeout)
        if not ready:
            return None
        messages = []
        for item in ready:
            if item in ranks:
                try:
                    messages.append((ranks[item], item.recv()))
                except (EOFError, OSError):
                    self._raise_died(ranks[item])
        if not messages:
            self._raise_died(sentinels[ready[0]])
        return messages

    def _check_before_sending(self) -> None:
        """A worker that exited, or an error a rank sent since the last call (a broadcast that
        raised): the ranks may no longer agree."""
        errors = {}
        for rank, connection in enumerate(self.connections):
            while connection.poll():
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    self._raise_died(rank)
                if message[0] == "error":
                    errors.setdefault(rank, message)
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._raise_died(rank)
        if errors:
            self._raise_error(errors, every_rank_raised=False)

    def _raise_died(self, rank: int) -> None:
        process = self.processes[rank]
        process.join(timeout=1.0)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        when = "" if self.started else " while starting"
        self.shutdown(timeout_s=0.0)
        raise WorkerDied(
            f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}{when}; the engine cannot "
            f"continue without it (out of memory, or a crash in that process?)"
        )

    def _raise_error(self, errors: dict[int, tuple], every_rank_raised: bool) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        dead = wait(list(sentinels), timeout=DEATH_GRACE_S)
        if dead:
            self._raise_died(sentinels[dead[0]])
        first = min(errors)
        _, _, error, text = errors[first]
        if every_rank_raised and error is not None:
            error.add_note(f"raised in tensor-parallel worker rank {first} (every rank raised):\n{text}")
            raise error
        self.shutdown(timeout_s=0.0)
        raise WorkerFailed(f"tensor-parallel worker rank {first} raised in a call that the other ranks did "
                           f"not fail (ranks that raised: {sorted(errors)}):\n{text}")
