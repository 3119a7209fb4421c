"""On a CUDA GPU: greedy decode steps queued ahead on the captured graphs advance the graphs' inputs
on the device (CudaGraphRunner.advance_decode, one launch) instead of packing and uploading them.
The tokens equal the eager engine's (no graphs) and the synchronous engine's (every step's inputs
uploaded), in float32 and bf16; an advanced step makes no host-to-device copy at all (counted by the
profiler's CUDA runtime calls inside it), while a step from host inputs makes its one upload."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b", "Question:"]


class GraphCounts:
    """Calls of the graph runner's input paths: uploads (a packed step) and device advances, each
    inside a profiler range of its own name."""

    def __init__(self, graphs):
        self.uploads = self.advances = self.uploads_in_advances = 0
        upload, advance, run = graphs.side.upload, graphs.advance_decode, graphs.run

        def counted_upload(*args, **kwargs):
            self.uploads += 1
            return upload(*args, **kwargs)

        def counted_advance(*args, **kwargs):
            self.advances += 1
            before = self.uploads
            with record_function("test.advance_decode"):
                out = advance(*args, **kwargs)
            self.uploads_in_advances += self.uploads - before
            return out

        def ranged_run(*args, **kwargs):
            with record_function("test.graph_run"):
                return run(*args, **kwargs)

        graphs.side.upload, graphs.advance_decode, graphs.run = counted_upload, counted_advance, ranged_run


def make(folder, dtype="float32", **kwargs) -> LLM:
    return LLM(folder, device="cuda", dtype=dtype, num_kv_blocks=256, max_num_seqs=8, block_size=8, **kwargs)


def token_ids(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_advanced_steps_equal_eager_and_upload_nothing(qwen3_checkpoint, dtype):
    probe = token_ids(make(qwen3_checkpoint, dtype, async_scheduling="off"),
                      SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=45, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[probe[2][6]]),  # a stop mid-batch
        SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
    ]
    synchronous = token_ids(make(qwen3_checkpoint, dtype, async_scheduling="off"), params)
    if dtype == "float32":  # bf16 graphs and eager forwards may round differently
        eager_llm = make(qwen3_checkpoint, dtype, enforce_eager=True)
        assert eager_llm.engine.runner.graphs is None
        assert token_ids(eager_llm, params) == synchronous
    llm = make(qwen3_checkpoint, dtype, async_scheduling="on")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.captures
    counts = GraphCounts(graphs)
    assert token_ids(llm, params) == synchronous
    assert counts.advances > 0 and counts.uploads_in_advances == 0
    assert llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_an_advanced_step_copies_nothing_to_the_device(qwen3_checkpoint):
    """The profiler's CPU-side CUDA runtime calls: none copies memory inside an advance (one kernel
    launch and the graph's launch), while each step from host inputs copies its packed inputs."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = token_ids(make(qwen3_checkpoint, async_scheduling="off"), params, PROMPTS[:1])
    llm = make(qwen3_checkpoint, async_scheduling="on")
    counts = GraphCounts(llm.engine.runner.graphs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        got = token_ids(llm, params, PROMPTS[:1])
        torch.cuda.synchronize()
    assert got == expected
    # 39 decode steps, a block of 8 crossed every 8 positions: most advance.
    assert counts.advances >= 25 and counts.advances + counts.uploads == 39

    events = prof.events()
    # The CPU-side ranges only (with CUDA activity on, a range also shows as a device-side annotation).
    ranges = {name: [e for e in events if e.name == name and e.device_type == torch.autograd.DeviceType.CPU]
              for name in ("test.advance_decode", "test.graph_run")}
    assert len(ranges["test.advance_decode"]) == counts.advances

    def copies_inside(spans) -> list[str]:
        """The memory copies (runtime calls, aten copies) made on a span's thread during it."""
        found = []
        for e in events:
            name = e.name.lower()
            if e.device_type != torch.autograd.DeviceType.CPU or not ("memcpy" in name or name == "aten::copy_"):
                continue
            t = e.time_range
            if any(s.thread == e.thread and s.time_range.start <= t.start and t.end <= s.time_range.end
                   for s in spans):
                found.append(e.name)
        return found

    assert copies_inside(ranges["test.advance_decode"]) == []
    assert len(copies_inside(ranges["test.graph_run"])) >= len(ranges["test.graph_run"])  # the control
