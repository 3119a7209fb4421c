"""A CUDA graph's inputs for one step in one host-to-device copy and one launch.

A graph reads its inputs from persistent buffers (runner/cuda_graph.py): input ids, positions,
slot mapping (int64), query starts, sequence lengths and the block table (int32). Filling them
with a copy each (after building each as a device tensor) queued about a dozen tiny operations
between two decode steps, each a few microseconds of the device's time at batch 1 (their H200
total: docs/perf-log.md). Here the host packs every value into one pinned int64
array, one copy moves it to a device staging buffer, and one kernel scatters it into the buffers
(with the dtype casts); input ids already on the device (a decode step queued ahead) are read from
there instead. A greedy decode step queued after one on the same graph skips all of this while the
buffers hold that step's inputs: CudaGraphRunner.advance_decode moves them on, on the device.

Packed layout for a graph of `bucket` sequences x `q` rows (rows = bucket * q), `n` live sequences
of block tables `width` wide:
    positions [rows] (padding rows 0) | slots [rows] (padding -1) | seq_lens [bucket] (padding q)
    | query starts [bucket + 1] | block table [n * width] | input ids [n * q] (when on the host)
Padding sequences (n..bucket-1) get q rows each at positions 0, context q, and write no KV; their
block-table rows keep whatever they held (valid block ids, read, never written).

The unpack is ops/step's (dispatch.unpack_graph_inputs: the Triton kernel on CUDA, its torch twin
elsewhere; tests/ops/test_step_graph_inputs.py holds them together).
"""

from __future__ import annotations

import torch

from foretell.ops.step.inputs import PackedLayout
from foretell.runner.input_batch import InputBatch, padded_block_rows
from foretell.runner.pinned_ring import PinnedRing, RingSlot


def pack(batch: InputBatch, bucket: int, q: int, ring: "PinnedRing | None" = None
         ) -> tuple[torch.Tensor, PackedLayout, "RingSlot | None"]:
    """The batch's inputs for graph (bucket, q), padded to the bucket, as one int64 host array
    (pinned when the batch is on CUDA), its layout, and the ring slot holding it: written into the
    next slot of `ring` when given (no pinned allocation per step; the upload records the slot's
    event), else a new tensor (slot None)."""
    n = batch.num_seqs
    pad = bucket - n
    layout = PackedLayout(bucket, q, n, batch.block_table_width, not isinstance(batch.token_ids, torch.Tensor))
    values = list(batch.position_list) + [0] * (pad * q)
    values += list(batch.slot_list) + [-1] * (pad * q)
    values += list(batch.seq_lens) + [q] * pad
    values += list(batch.query_start) + list(range(batch.num_tokens + q, batch.num_tokens + pad * q + 1, q))
    for row in padded_block_rows(batch.block_ids, layout.width):
        values += row
    if layout.ids_on_host:
        values += batch.token_ids
    if ring is not None:
        host, _, slot = ring.take_filled(values)
        return host, layout, slot
    host = torch.tensor(values, dtype=torch.int64)
    if batch.device.type == "cuda":
        host = host.pin_memory()
    return host, layout, None


class SideStream:
    """The copies between host and graph buffers, off the stream the graphs run on.

    Between two decode steps the stream would otherwise run: the copy of the tokens to the host,
    the copy of the next step's packed inputs to the device, the unpack, each after the one before
    (each DMA start costs the device microseconds after the kernel or copy before it on an H200). The
    packed inputs of a step do not depend on the step before, and the tokens can be read from the
    next step's input buffer once it is filled, so both copies run here, ordered by events:
      - upload: waits for the last unpack (which read the staging buffer), then copies; the main
        stream waits for it before its unpack (long done by then);
      - download: waits for the last unpack (which wrote the input buffers), then copies to the
        host; the main stream waits for it before the next write of the input buffers.
    A graphed verify step's results (spec_decode's accepted counts, next tokens and drafts: static
    buffers) leave the same way (download_outputs), so the next step's bookkeeping follows the draft
    loop on the main stream without a concatenation and a DMA between them.
    Off CUDA everything runs in order on the one stream and no event is made.

    Nothing is allocated per step: the host buffers of the uploads and downloads come from rings
    (runner/pinned_ring.py), and an event another stream waits for at once (a wait takes the
    event's latest record, so re-recording it later changes nothing for that wait) is one event
    re-recorded each step; the events the host later waits on are their ring slots'."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        # The device's index, given to every stream lookup: torch.cuda.current_stream() without one
        # finds the current device through availability checks and environment reads, tens of
        # microseconds of host time a step at the eight lookups a graphed decode step makes.
        self.device_index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        self.on_side = _OnStream(self.stream, self.device_index) if cuda else None
        self.inputs_written: "torch.cuda.Event | None" = None  # after the last unpack
        self.inputs_read: "torch.cuda.Event | None" = None  # after the last download of the inputs
        self.outputs_read: "torch.cuda.Event | None" = None  # after the last download_outputs
        self.uploads = PinnedRing(torch.int64, device)  # packed steps (pack's ring)
        self.downloads = PinnedRing(torch.int64, device)  # input ids and outputs to the host
        self.unpacked = torch.cuda.Event() if cuda else None  # recorded after each unpack
        self.uploaded = torch.cuda.Event() if cuda else None  # recorded after each upload
        self.outputs_written = torch.cuda.Event() if cuda else None  # before each download_outputs

    def upload(self, staging: torch.Tensor, host: torch.Tensor, slot: RingSlot | None = None) -> None:
        """Copy host (pinned; in `slot` of self.uploads when given) to the staging buffer beside
        the graphs; the current stream waits for the copy."""
        if self.stream is None:
            staging.copy_(host)
            return
        with self.on_side:
            if self.inputs_written is not None:
                self.stream.wait_event(self.inputs_written)
            staging.copy_(host, non_blocking=True)
            # One event both frees the slot's buffer (once recorded past the copy) and orders the unpack.
            uploaded = slot.ring.events[slot.index] if slot is not None else self.uploaded
            uploaded.record(self.stream)
        self._main().wait_event(uploaded)

    def before_input_write(self) -> None:
        """Order a write of the input buffers (on the current stream) after their downloads."""
        if self.inputs_read is not None:
            self._main().wait_event(self.inputs_read)
            self.inputs_read = None

    def after_input_write(self) -> None:
        if self.stream is not None:
            self.inputs_written = self.unpacked
            self.inputs_written.record(self._main())

    def download(self, source: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """(pinned host copy of source (a view of the input buffers), its ready event), queued
        after the last input write; without a side stream, source itself and no event."""
        if self.stream is None:
            return source.clone(), None
        with self.on_side:
            self.stream.wait_event(self.inputs_written)
            host, self.inputs_read, _ = self._take_download(source)
            host.copy_(source, non_blocking=True)
            self.inputs_read.record(self.stream)
        return host, self.inputs_read

    def _take_download(self, like: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event", RingSlot]:
        """A host buffer shaped like `like` (int64: a ring slot's; else a new pinned tensor and
        event), its event and slot."""
        if like.dtype != torch.int64:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True), torch.cuda.Event(), None
        host, event, slot = self.downloads.take(like.numel())
        return host.view(like.shape), event, slot

    def download_outputs(self, outputs: list[torch.Tensor]) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """(pinned host copy of the outputs flattened and concatenated, its ready event), made here
        once the current stream's work so far is done; the current stream waits for it before it
        next writes them (before_output_write). The outputs must be views of buffers that outlive
        the copy (the graphs' static buffers): any flattening copy is made here, on this stream, so
        no temporary of the current stream is freed (and reused) while this stream still reads it.
        Off CUDA: the concatenation and no event."""
        if self.stream is None:
            return torch.cat([out.reshape(-1) for out in outputs]), None
        self.outputs_written.record(self._main())
        with self.on_side:
            self.stream.wait_event(self.outputs_written)
            packed = torch.cat([out.reshape(-1) for out in outputs])
            host, self.outputs_read, _ = self._take_download(packed)
            host.copy_(packed, non_blocking=True)
            self.outputs_read.record(self.stream)
        return host, self.outputs_read

    def before_output_write(self) -> None:
        """Order a write of the downloaded outputs (on the current stream) after their download."""
        if self.outputs_read is not None:
            self._main().wait_event(self.outputs_read)
            self.outputs_read = None

    def _main(self) -> "torch.cuda.Stream":
        """The current stream of this device (the one the graphs run on)."""
        return torch.cuda.current_stream(self.device_index)


class _OnStream:
    """`with torch.cuda.stream(stream)` for a stream of a known device, without torch's device
    lookups on entry (the same effect: the stream is current inside, the previous one after)."""

    __slots__ = ("stream", "device_index", "previous")

    def __init__(self, stream: "torch.cuda.Stream", device_index: int):
        self.stream = stream
        self.device_index = device_index
        self.previous = None

    def __enter__(self) -> None:
        self.previous = torch.cuda.current_stream(self.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.previous)
        self.previous = None
