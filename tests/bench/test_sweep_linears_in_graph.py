"""scripts/sweep_linears_in_graph_gpu.py and its modules (foretell/bench/kernels/linear_chain.py,
linear_kinds.py, moe_int4_chain.py) on the CPU:

  - the decode chain the sweep times computes what a decoder's linears compute, layer by layer,
    against an independent F.linear reference (and leaving a kind out really cuts its input off);
  - every family's candidates are launchable configs: a non-default candidate of each family runs
    through the kernel module's public launch (Triton's interpreter) and matches the torch twin;
    batch-invariant candidates keep the mode's bits;
  - the script runs end to end with --tiny and writes the rows the lead reads;
  - bad input is refused with a message naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

from fixtures.triton_interpreter import import_fp8_few_rows, import_interpreted, interpreter_mode  # noqa: F401
from foretell.bench.kernels import linear_chain, moe_int4_chain
from foretell.bench.kernels.linear_kinds import (
    LAYER_KINDS, BatchInvariantLinears, Bf16Linears, Fp8Linears, InvariantLaunch,
)

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sweep_linears_in_graph_gpu.py")
LLAMA = os.path.join(os.path.dirname(__file__), "..", "..", "foretell", "configs", "llama-3.1-8b")
CPU = torch.device("cpu")
SMALL = linear_chain.ChainShapes(hidden=128, q_size=128, kv_size=64, intermediate=256, vocab=200, num_layers=2)


@pytest.fixture(scope="module")
def sweep_script():
    spec = importlib.util.spec_from_file_location("sweep_linears_in_graph_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chain_computes_a_decoders_linears():
    family = Bf16Linears(torch.float32, CPU, use_kernels=False)
    weights = linear_chain.build_weights(family, SMALL, seed=3)
    x = torch.randn(2, SMALL.hidden)  # [M, H]
    configs = {kind: None for kind in LAYER_KINDS}
    got = linear_chain.chain_function(family, weights, SMALL, x, configs)()

    h = x.double()
    for layer in weights.layers:
        qkv = h @ layer["qkv"].double().T  # [M, q + 2 kv]
        h = qkv[:, :SMALL.q_size] @ layer["o"].double().T
        gate, up = (h @ layer["gate_up"].double().T).chunk(2, dim=-1)
        h = (F.silu(gate) * up) @ layer["down"].double().T
    want = h @ weights.head.double().T  # [M, V]
    assert got.dtype == torch.float32 and got.shape == (2, SMALL.vocab)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)

    # Leaving qkv out cuts the chain from x: the logits no longer depend on it.
    cut = [linear_chain.chain_function(family, weights, SMALL, xi, configs, omit="qkv") for xi in (x, 2 * x)]
    first = cut[0]()
    assert torch.equal(first, cut[1]()) and not torch.allclose(first, got)


def test_sweep_rows_order_rebaselines_and_budget():
    family = Bf16Linears(torch.float32, CPU, use_kernels=False)
    weights = linear_chain.build_weights(family, SMALL)
    rows = []
    settings = linear_chain.SweepSettings(warmup=0, iters=1, max_candidates=2, kinds=("qkv", "o"), rebaseline_every=2)
    linear_chain.sweep_family(family, weights, SMALL, 1, settings, rows.append, "s")
    variants = [r["variant"] for r in rows]
    assert variants == ["baseline"] + ["omitted"] * 5 + ["candidate"] * 2 + ["baseline (again)"] + \
        ["candidate"] * 2 + ["baseline (end)"]
    candidates = [r for r in rows if r["variant"] == "candidate"]
    assert [r["layer_kind"] for r in candidates] == ["qkv", "o", "qkv", "o"]  # kinds in turn
    assert [r["baseline_us"] for r in candidates] == [rows[0]["chain_us"]] * 2 + [rows[8]["chain_us"]] * 2
    for r in candidates:
        assert r["delta_per_call_us"] == pytest.approx((r["chain_us"] - r["baseline_us"]) / SMALL.num_layers, abs=1e-3)
    spent = []
    linear_chain.sweep_family(family, weights, SMALL, 1, linear_chain.SweepSettings(
        warmup=0, iters=1, deadline=0.0, max_candidates=1), spent.append, "spent")
    assert [r["variant"] for r in spent] == ["baseline"] + ["candidate"] * 5 + ["baseline (end)"]
    assert all(r.get("skipped") == "budget spent" for r in spent[1:-1])


def test_shapes_from_the_shipped_llama_config():
    shapes = linear_chain.ChainShapes.from_hf_config(LLAMA)
    assert [shapes.linear_shape(k) for k in LAYER_KINDS] == [(6144, 4096), (4096, 4096), (28672, 4096),
                                                           (4096, 14336), (128256, 4096)]
    assert shapes.num_layers == 32 and shapes.calls("lm_head") == 1 and shapes.output_width("gate_up") == 14336
    assert linear_chain.ChainShapes.from_hf_config(LLAMA, num_layers=4).num_layers == 4
    # FP8 bytes of a layer (weights + 128x128 block scales): ~218 MB, ~7 GB over 32 layers.
    family = Fp8Linears(torch.bfloat16, CPU, use_kernels=False)
    layer = sum(family.weight_bytes(k, *shapes.linear_shape(k)) for k in LAYER_KINDS[:-1])
    assert 6.9e9 < 32 * layer < 7.1e9


def test_candidates_are_valid_and_the_default_comes_first():
    from foretell.ops.gemm import triton_batch_invariant as bi
    from foretell.ops.gemm import triton_fp8_few_rows as few
    from foretell.ops.gemm import triton_fp8_gemv as fp8_gemv

    shapes = linear_chain.ChainShapes.from_hf_config(LLAMA)
    fp8 = Fp8Linears(torch.bfloat16, CPU, use_kernels=False)
    for kind in LAYER_KINDS[:-1]:
        n, k = shapes.linear_shape(kind)
        configs = fp8.candidates(kind, 1, n, k)
        assert configs[0] == fp8.default(kind, 1, n, k) and len(set(configs)) == len(configs) > 10
        for c in configs:
            if isinstance(c, fp8_gemv.Fp8GemvConfig):
                assert few.gemv_rows_fit_blocks(c.block_n, n, (128, 128), kind == "gate_up")
                assert kind != "gate_up" or c.block_n % 2 == 0
    bf16 = Bf16Linears(torch.bfloat16, CPU, use_kernels=False)
    gate_up = bf16.candidates("gate_up", 1, *shapes.linear_shape("gate_up"))
    assert gate_up[0] == bf16.default("gate_up", 1, *shapes.linear_shape("gate_up")) and len(gate_up) > 8
    assert all(c.block_n % 2 == 0 for c in gate_up)

    invariant = BatchInvariantLinears(torch.bfloat16, CPU, use_kernels=True)
    n, k = shapes.linear_shape("down")
    one_row = invariant.candidates("down", 1, n, k)
    assert one_row[0] == InvariantLaunch() and all(c.shape is None and c.fixed_block_m is None for c in one_row)
    assert all(invariant.keeps_default_bits(c) for c in one_row)
    assert any(c.fixed_block_m == 16 for c in invariant.candidates("down", 64, n, k))
    reordering = BatchInvariantLinears(torch.bfloat16, CPU, use_kernels=True, reorder=True)
    reordered = reordering.candidates("down", 1, n, k)
    other = [c.shape for c in reordered if c.shape is not None]
    mode = bi.pick_shape_config(n, k, torch.bfloat16, CPU)
    assert other and mode not in other and len(set(other)) == len(other)
    # rows of W per program: 32, 16 and 128 at the mode's (BLOCK_K, SPLIT) come first, never bitwise-checked
    assert other[:3] == [bi.ShapeConfig(mode.block_k, mode.split, block_n) for block_n in (32, 16, 128)]
    assert not any(reordering.keeps_default_bits(c) for c in reordered if c.shape is not None)
    assert all(k // c.split >= c.block_k for c in other)
    assert {c.block_n for c in other} == {16, 32, 64, 128}

    for kernel in moe_int4_chain.MOE_KERNELS:
        configs = moe_int4_chain.candidate_configs(kernel)
        assert configs and moe_int4_chain.default_config()[kernel] not in configs
        assert len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs)


def _launch_matches_twin(family, kinds, pick, shapes=linear_chain.TINY_SHAPES):
    """A non-default candidate of each kind (pick(list) chooses it) through the kernel module matches the twin."""
    gen = torch.Generator().manual_seed(5)
    chosen = {}
    for kind in kinds:
        n, k = shapes.linear_shape(kind)
        weight = family.make_weight(kind, n, k, gen)
        x = torch.randn(1, k, generator=gen).to(family.dtype)
        config = pick(family.candidates(kind, 1, n, k)[1:])
        got = family.launch(kind, x, weight, config)
        want = family.twin(kind, x, weight)
        assert got.dtype == want.dtype and got.shape == want.shape, (kind, config)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
        chosen[kind] = (config, x, weight, got)
    return chosen


def test_candidates_run_through_the_public_launch():
    # fp16 here: Triton's interpreter keeps bf16 as integers.
    few = import_fp8_few_rows()  # with the kernel modules it calls into, dependencies first
    import_interpreted("foretell.ops.gemm.triton_batch_invariant")
    fp8 = Fp8Linears(torch.float16, CPU, use_kernels=True)
    chosen = _launch_matches_twin(fp8, ("gate_up", "down"),
                                  lambda cs: [c for c in cs if isinstance(c, few.Fp8MmaConfig)][-1])
    assert chosen["down"][0].split > 1  # the split-K partials and their counters run too
    bf16 = Bf16Linears(torch.float16, CPU, use_kernels=True)
    few_programs = linear_chain.ChainShapes(hidden=256, q_size=256, kv_size=128, intermediate=64, vocab=48,
                                            num_layers=1)  # (the interpreter's time goes by programs)
    _launch_matches_twin(bf16, ("gate_up", "lm_head"), lambda cs: cs[-1], few_programs)
    invariant = BatchInvariantLinears(torch.float16, CPU, use_kernels=True)
    for kind, (config, x, weight, got) in _launch_matches_twin(invariant, ("o", "gate_up"), lambda cs: cs[0]).items():
        assert config.num_stages is not None and invariant.keeps_default_bits(config)
        assert torch.equal(got, invariant.launch(kind, x, weight, InvariantLaunch()))
    reordering = BatchInvariantLinears(torch.float16, CPU, use_kernels=True, reorder=True)  # a 16-row tile of W
    chosen = _launch_matches_twin(reordering, ("gate_up",),
                                  lambda cs: next(c for c in cs if c.shape and c.shape.block_n == 16))
    assert chosen["gate_up"][0].shape.block_n == 16


def test_tiny_run_end_to_end(sweep_script, tmp_path):
    sweep_script.main(["--tiny", "--out", str(tmp_path), "--max-candidates", "1", "--batch-invariant-rows", "1", "4",
                       "--moe-int4", "--kinds", "gate_up", "lm_head"])
    data = json.loads((tmp_path / "sweep_linears_in_graph.json").read_text())
    rows = data["rows"]
    assert data["provenance"]["device"] == "cpu"
    assert not [r for r in rows if not r.get("ok") and "skipped" not in r], [r for r in rows if not r.get("ok")]
    sections = list(dict.fromkeys(r["section"] for r in rows))
    assert sections == ["fp8 M=1", "bf16 M=1", "default path M=1", "batch_invariant M=1", "default path M=4",
                        "batch_invariant M=4", "int4 moe"]
    for section in sections:
        mine = [r for r in rows if r["section"] == section]
        assert mine[0]["variant"] == "baseline" and mine[-1]["variant"] == "baseline (end)"
        assert all(r["chain_us"] > 0 for r in mine if r.get("ok"))
    fp8 = [r for r in rows if r["section"] == "fp8 M=1"]
    assert {r["layer_kind"] for r in fp8 if r["variant"] == "omitted"} == set(LAYER_KINDS)
    candidates = [r for r in fp8 if r["variant"] == "candidate"]
    assert [r["layer_kind"] for r in candidates] == ["gate_up"]  # --kinds, one each; the bf16 head: bf16's
    assert [r["layer_kind"] for r in rows if r["section"] == "bf16 M=1" and r["variant"] == "candidate"] == [
        "gate_up", "lm_head"]
    assert all(r["config"] != fp8[0]["defaults"][r["layer_kind"]] and "delta_per_call_us" in r for r in candidates)
    assert {r["layer_kind"] for r in rows if r["section"] == "int4 moe" and r["variant"] == "candidate"} >= {"gate_up",
                                                                                                          "down"}
    assert set(data["seconds"]) == {"fp8", "bf16", "batch_invariant", "moe_int4"}


def test_bad_input_is_refused(sweep_script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep_script.parse_args(["--budget-s", "0"])
    assert exit_info.value.code == 2 and "--budget-s must be positive, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep_script.parse_args(["--families", "int3"])
    with pytest.raises(SystemExit):
        sweep_script.parse_args(["--families"])
    assert "nothing to run: give --families or --moe-int4" in capsys.readouterr().err
    assert sweep_script.parse_args(["--families", "--moe-int4"]).families == []
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="'intermediate_size'"):
        linear_chain.ChainShapes.from_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="num_layers must be at least 1, got 0"):
        linear_chain.ChainShapes.from_hf_config(LLAMA, num_layers=0)
    with pytest.raises(ValueError, match="layer kind must be one of"):
        SMALL.linear_shape("attention")
    with pytest.raises(ValueError, match="int4 MoE kernel must be one of"):
        moe_int4_chain.candidate_configs("router")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            sweep_script.main(["--out", str(tmp_path)])
