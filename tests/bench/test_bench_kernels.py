"""foretell.bench.kernels: the timer (calls, arithmetic, bad arguments), the input builders (paged
caches whose metadata agrees with a dense copy), every kernel's tiny cases on the CPU (no path
fails, the independent SDPA agrees with the torch backend), and `foretell bench kernels`."""

from __future__ import annotations

import json

import pytest
import torch

from foretell.bench.kernels import inputs as make
from foretell.bench.kernels.cases import visible_keys
from foretell.bench.kernels.command import KERNEL_NAMES
from foretell.bench.kernels.run import KERNELS, KernelBenchSettings, format_rows, run_kernel_bench
from foretell.bench.kernels.timing import KernelTiming, time_kernel
from foretell.cli import main

CPU = torch.device("cpu")


def test_time_kernel_counts_runs_and_divides_by_calls():
    calls = []
    timing = time_kernel(lambda: calls.append(1), "cpu", warmup=2, iters=5, calls_per_run=4)
    assert len(calls) == 7
    assert timing.timer == "perf_counter" and timing.iters == 5 and timing.calls_per_run == 4
    assert 0 <= timing.min_us <= timing.median_us <= timing.max_us


def test_time_kernel_measures_time_spent():
    import time

    timing = time_kernel(lambda: time.sleep(0.004), "cpu", warmup=0, iters=3, calls_per_run=2)
    assert 1900 <= timing.median_us < 50_000  # 4 ms a run, 2 calls: about 2 ms a call


def test_timing_arithmetic():
    timing = KernelTiming(median_us=2.0, min_us=1.0, max_us=3.0, iters=1, calls_per_run=1, timer="perf_counter")
    assert timing.gb_per_s(4000) == pytest.approx(2.0)  # 4 kB in 2 us
    assert timing.tflops(6e6) == pytest.approx(3.0)
    assert timing.as_dict()["median_us"] == 2.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(iters=0), "iters must be at least 1"),
    (dict(warmup=-1), "warmup must be 0 or more"),
    (dict(calls_per_run=0), "calls_per_run must be at least 1"),
    (dict(cuda_graph=True), "cuda_graph=True needs a CUDA device"),
    (dict(flush_l2_bytes=1 << 20), "flush_l2_bytes needs a CUDA device"),
])
def test_time_kernel_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_kernel(lambda: None, "cpu", **kwargs)


def test_paged_inputs_place_each_token_where_the_block_table_says():
    data = make.paged_attention_inputs(3, 37, 4, num_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                                       dtype=torch.float32, device=CPU)
    md = data.metadata
    assert md.block_table.shape == (3, 3) and sorted(md.block_table.flatten().tolist()) == list(range(9))
    assert data.query.shape == (12, 4, 8) and data.kv_cache.shape == (2, 9, 16, 2, 8)
    for seq in range(3):
        for i, position in enumerate(range(33, 37)):
            block = md.block_table[seq, position // 16].item()
            assert md.slot_mapping[seq * 4 + i].item() == block * 16 + position % 16
    assert md.query_start_loc.tolist() == [0, 4, 8, 12] and md.seq_lens.tolist() == [37] * 3
    with pytest.raises(ValueError, match="query_len must be in"):
        make.paged_attention_inputs(1, 4, 5, 4, 2, 8, 16, torch.float32, CPU)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make.paged_attention_inputs(1, 4, 1, 4, 3, 8, 16, torch.float32, CPU)


def test_expert_inputs_route_distinct_experts():
    data = make.expert_inputs(5, num_experts=8, top_k=3, hidden=16, intermediate=8, dtype=torch.float32, device=CPU)
    assert data.ids.shape == (5, 3) and all(len(set(row)) == 3 for row in data.ids.tolist())
    assert data.gate_up.shape == (8, 16, 16) and data.down.shape == (8, 16, 8)
    with pytest.raises(ValueError, match="top_k must be in"):
        make.expert_inputs(1, num_experts=2, top_k=3, hidden=4, intermediate=4, dtype=torch.float32, device=CPU)


def test_visible_keys_counts_the_causal_triangle():
    assert visible_keys(10, 1) == 10
    assert visible_keys(4, 4) == 1 + 2 + 3 + 4
    assert visible_keys(10, 3) == 8 + 9 + 10


def test_command_names_every_kernel():
    assert tuple(KERNELS) == KERNEL_NAMES


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_every_kernel_runs_its_tiny_cases_on_the_cpu(kernel):
    settings = KernelBenchSettings([kernel], device="cpu", dtype="float32", preset="tiny", warmup=0, iters=1)
    report = run_kernel_bench(settings)
    assert report["device"] == "cpu" and report["preset"] == "tiny" and report["rows"]
    for row in report["rows"]:
        assert row["kernel"] == kernel and row["bytes_per_call"] > 0 and row["flops_per_call"] > 0
        assert row["reference"] in row["paths"] and "foretell" in row["paths"]
        for name, path in row["paths"].items():
            assert "error" not in path, (name, path)
            assert path["us"] > 0 and path["gb_per_s"] > 0
            assert "graph_us" not in path  # no graphs on the CPU
        # On the CPU the entry point runs the torch twin: the same numbers.
        assert row["paths"]["foretell"]["max_abs_err"] < 1e-5
    assert kernel in format_rows(report["rows"])


def test_attention_cases_agree_with_dense_sdpa_and_count_bytes():
    """SDPA on a dense copy of the paged cache is an independent check of the cases' inputs."""
    settings = KernelBenchSettings(["attention_verify"], device="cpu", dtype="float32", preset="tiny",
                                   warmup=0, iters=1)
    rows = run_kernel_bench(settings)["rows"]
    for row in rows:
        shape = row["shape"]
        assert row["paths"]["sdpa_dense"]["max_abs_err"] < 1e-4
        kv = 2 * shape["batch"] * shape["context"] * shape["num_kv_heads"] * shape["head_dim"] * 4
        q_and_out = 2 * shape["batch"] * shape["query_len"] * shape["num_heads"] * shape["head_dim"] * 4
        assert row["bytes_per_call"] == kv + q_and_out


@pytest.mark.parametrize("kwargs, message", [
    (dict(kernels=["flash"]), "unknown kernels"),
    (dict(kernels=["rope"], dtype="int8"), "dtype must be one of"),
    (dict(kernels=["rope"], preset="huge"), "preset must be one of"),
    (dict(kernels=["rope"], device="tpu"), "device must be auto, cpu or cuda"),
    (dict(kernels=["rope"], iters=0), "iters must be >= 1"),
])
def test_settings_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelBenchSettings(**kwargs)


def test_bench_kernels_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = main(["bench", "kernels", "--kernels", "silu_and_mul,rms_norm", "--device", "cpu", "--preset", "tiny",
               "--warmup", "0", "--iters", "2", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| kernel" in text and "silu_and_mul" in text and "rms_norm" in text
    report = json.loads(out.read_text())
    assert report["benchmark"] == "kernels" and report["dtype"] == "bfloat16" and report["commit"]
    assert {row["kernel"] for row in report["rows"]} == {"silu_and_mul", "rms_norm"}
    assert all(row["paths"]["foretell"]["eager"]["iters"] == 2 for row in report["rows"])


def test_bench_kernels_command_names_an_unknown_kernel(capsys):
    assert main(["bench", "kernels", "--kernels", "rope,flash", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "flash" in err and "attention_decode" in err


def test_a_non_finite_difference_is_reported_as_none():
    from foretell.bench.kernels.run import max_abs_diff

    ones = torch.ones(3)
    assert max_abs_diff((ones, ones * 2), (ones, ones)) == 1.0
    assert max_abs_diff(torch.tensor([float("nan"), 1.0]), ones[:2]) is None
    assert max_abs_diff((ones, torch.full((3,), float("inf"))), (ones, ones)) is None  # in a later output too
