"""VerifyRows: the grammar masks of a step's verify rows, for StructuredOutputs (runtime.py).

A structured sequence that verifies k drafts samples k + 1 rows; row j gets its grammar's mask as if
drafts d_0..d_{j-1} had been accepted. fill() writes every such row of a step into the reusable
"verify" host buffer: the rows filled ahead when they are this step's, else one batched llguidance
call (batched_fill.py).

fill_ahead(): at the end of a step (after the drafts are known) the next step's rows are walked by
llguidance on a worker thread (MaskWorker) while the engine finishes this step, schedules and
launches the next (llguidance holds no GIL meanwhile); the next fill() only finishes them. Rows are
keyed by (sequence, output length, drafts): a sequence whose step turned out other than the one
filled for sends the whole step back to the batched fill. Until the worker is done the matchers are
its own: StructuredOutputs waits (wait_for_worker) before it touches one.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable

import numpy as np

from foretell.engine.errors import SequenceError
from foretell.structured.batched_fill import SequenceGrammarViolation, fill_verify_masks, finish_rows, walk_calls
from foretell.structured.draft_mask import MaskTimer
from foretell.structured.matcher import GrammarViolation, SequenceMatcher


class MaskWorker:
    """One daemon thread that runs llguidance calls handed to it (bound methods with their
    arguments; llguidance drops the GIL inside them). Almost no Python runs on it, so it needs the
    GIL only to enter and leave each call. start() hands one batch over, wait() waits for it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Lock()  # held while a batch runs
        self._failed = False
        self.busy = False
        self._buffer = None  # start()'s buffer, held while its calls run
        threading.Thread(target=self._serve, name="foretell-grammar-masks", daemon=True).start()

    def _serve(self) -> None:
        while True:
            calls = self._queue.get()
            if calls is None:
                return
            try:
                for call, args in calls:
                    call(*args)
            except (ValueError, RuntimeError):
                self._failed = True
            finally:
                self._done.release()

    def stop(self) -> None:
        self._queue.put(None)

    def start(self, calls: list, buffer: object = None) -> None:
        """Run calls on the thread; buffer (the array llguidance writes into, which the calls may
        reach by address only) is held until wait() returns, so nothing frees it mid-write."""
        self.wait()
        self._done.acquire()
        self.busy, self._failed = True, False
        self._buffer = buffer
        self._queue.put(calls)

    def wait(self) -> bool:
        """Wait for the batch handed over last; False when llguidance raised."""
        if self.busy:
            self._done.acquire()
            self._done.release()
            self.busy = False
            self._buffer = None
        return not self._failed


class VerifyRows:
    """The verify rows' fill and the worker thread that fills the next step's rows ahead."""

    def __init__(self, timer: MaskTimer):
        self.timer = timer  # StructuredOutputs.timer: fill_ahead_seconds, rows_filled_ahead
        self._worker: MaskWorker | None = None  # fill_ahead()'s thread, started when first used
        self._ahead: tuple | None = None  # the next step's rows filled ahead: (jobs, rows), valid once waited for

    def wait_for_worker(self) -> None:
        """Wait for the rows being filled ahead (the matchers are the worker's until then)."""
        if self._worker is not None and self._worker.busy and not self._worker.wait():
            self._ahead = None  # llguidance failed: the step's own fill meets it and names the request

    def take_filled_ahead(self) -> tuple | None:
        """The rows the worker filled ahead for this step (None: none), once it is done; every
        step takes them (its own fill then uses them or not), so none outlive the step after."""
        self.wait_for_worker()
        ahead, self._ahead = self._ahead, None
        return ahead

    def fill(self, items: list, matchers: list[SequenceMatcher], ahead: tuple | None, bitmask: np.ndarray,
             executor) -> None:
        """Fill bitmask ([sum(len(drafts) + 1), words] int32) with the verify rows of `items`
        (structured sequences that sample, in row order; matchers[i] is items[i]'s, advanced through
        its output): the rows filled ahead when they are this step's, else one batched llguidance
        fill on `executor` (llguidance.LLExecutor). A grammar error names the request."""
        if self._take_rows_filled_ahead(ahead, items, bitmask):
            return
        try:
            fill_verify_masks(executor, matchers, [list(item.draft_token_ids) for item in items], bitmask)
        except SequenceGrammarViolation as e:
            seq = items[e.index].seq
            raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e

    def fill_ahead(self, scheduled: list, results: list, matchers: dict[int, SequenceMatcher], num_words: int,
                   executor_of: Callable[[], object]) -> None:
        """Start filling the next step's verify rows of every structured sequence of this step
        (its matcher, matchers[seq_id], advanced through the tokens this step emits, the drafts it
        will verify: results[i].next_drafts) on the worker thread; executor_of() gives the
        llguidance executor, asked only when some sequence has rows to fill. The next fill() takes
        the rows of every sequence whose output length and drafts are what they were filled for
        (all of them, or it fills them all itself)."""
        started = time.perf_counter()
        self.wait_for_worker()
        self._ahead = None
        jobs = []
        for item, result in zip(scheduled, results):
            seq = item.seq
            matcher = matchers.get(seq.seq_id)
            if matcher is None or seq.sampling_params.structured_outputs is None or not item.samples:
                continue
            new_tokens = list(result.new_token_ids)
            if not new_tokens or any(t in matcher.eos_token_ids for t in new_tokens):
                continue  # nothing emitted (a failed row) or the output ends here
            outputs = seq.output_token_ids + new_tokens
            try:
                matcher.advance(outputs)
            except GrammarViolation:
                continue  # the next matcher_for() raises it for this request
            drafts = list(result.next_drafts or [])
            jobs.append(((seq.seq_id, len(outputs), tuple(drafts)), matcher, drafts))
        if jobs:
            if self._worker is None:
                self._worker = MaskWorker()
                weakref.finalize(self, self._worker.stop)  # the thread ends with this object
            out = np.empty((sum(len(drafts) + 1 for _, _, drafts in jobs), num_words), dtype=np.int32)
            calls = walk_calls(executor_of(), [m for _, m, _ in jobs], [d for _, _, d in jobs], out)
            self._worker.start(calls, out)
            self._ahead = (jobs, out)
        elapsed = time.perf_counter() - started
        self.timer.fill_ahead_seconds += elapsed
        self.timer.seconds += elapsed

    def close(self) -> None:
        """Wait for the rows being filled ahead, then end the worker thread: llguidance works on
        the matchers and buffers until then (an engine closed mid-fill crashed in CI)."""
        if self._worker is not None:
            self._worker.wait()
            self._worker.stop()
            self._worker = None
        self._ahead = None

    def _take_rows_filled_ahead(self, ahead: tuple | None, items: list, bitmask: np.ndarray) -> bool:
        """Finish the rows filled ahead and copy them into bitmask when every item's were (False:
        fill them all here; a grammar error found is raised there, naming the request)."""
        if ahead is None:
            return False
        jobs, out = ahead
        first_rows, row0 = {}, 0
        for key, _, drafts in jobs:
            first_rows[key] = row0
            row0 += len(drafts) + 1
        starts = []
        for item in items:
            start = first_rows.get((item.seq.seq_id, item.seq.num_output_tokens, tuple(item.draft_token_ids)))
            if start is None:
                return False
            starts.append(start)
        try:
            finish_rows([m for _, m, _ in jobs], [d for _, _, d in jobs], out)
        except GrammarViolation:
            return False
        row = 0
        for item, start in zip(items, starts):
            num_rows = len(item.draft_token_ids) + 1
            bitmask[row: row + num_rows] = out[start: start + num_rows]
            row += num_rows
        self.timer.rows_filled_ahead += row
        return True
