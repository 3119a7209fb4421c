"""scripts/sass_loop_count.py on the CPU: its loop finder against a hand-written disassembly (a loop
nested in a longer one, a forward branch that is no loop, predicated instructions), and the script
end to end in a fresh process on one kernel-compile case (skipped where this Triton cannot build for
sm_90): the row names the case, counts a loop, and the int4 MoE gate_up over x's lanes shows no
barrier pair per lane (what the lanes were built to remove); a name matching nothing is an error."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass_loop_count.py")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   FFMA R3, R2, R2, R3 ;
.L_x_1:
        /*0030*/                   LOP3.LUT R5, R2, 0xf, RZ, 0xc0, !PT ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   ISETP.GE.AND P1, PT, R6, R7, PT ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
"""


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sass_loop_count_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_longest_loop_is_the_outer_one(script):
    loop = script.longest_loop(SASS)
    assert [script.opcode(i) for i in loop] == ["LDG", "FFMA", "LOP3", "BRA", "BRA", "ISETP", "BRA"]


def test_no_loop_gives_an_empty_body(script):
    assert script.longest_loop("        /*0000*/                   EXIT ;\n") == []


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)


def _toolchain() -> bool:
    spec = importlib.util.find_spec("triton")  # looked up, not imported (see test_kernels_compile_sm90.py)
    if spec is None or not spec.submodule_search_locations:
        return False
    tools = os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(tools, tool)) for tool in ("ptxas", "nvdisasm", "cuobjdump"))


@pytest.mark.skipif(not _toolchain(), reason="needs Triton with its sm_90 toolchain (ptxas, nvdisasm)")
def test_counts_a_case_built_as_launched():
    run = _run("--match", "int4 moe gemv gate_up over x's lanes")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if rows and "error" in rows[0] and "cuda" in rows[0]["error"].lower():
        pytest.skip(f"this Triton cannot build for sm_90 here: {rows[0]['error']}")
    assert [row["case"] for row in rows] == ["int4 moe gemv gate_up over x's lanes, Kimi-K2.5"]
    row = rows[0]
    assert row["loop_instructions"] > 100 and row["registers"] > 0
    assert row["top_opcodes"]["FFMA"] > 0 and row["top_opcodes"]["LOP3"] > 0
    assert row["shared_round_trips"].get("BAR", 0) <= 2  # the per-tile lanes took 18 a tile


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the fixtures' cases import triton")
def test_a_match_of_nothing_is_refused():
    run = _run("--match", "no such kernel anywhere")
    assert run.returncode == 2 and "no kernel-compile case matches" in run.stderr
