"""Counts the sm_90 instructions of the int4 MoE GEMV's K loop for each variant (nibble_lanes:
triton_int4_gemv.py, word_tiles: triton_int4_word_tiles.py) at Kimi-K2.5's shapes, compiled on
the CPU (no GPU needed): a sanity check of a kernel's loop, not a measure of its speed (the perf
log has three kernels whose counts fell and whose decode got slower).

The kernels are compiled for GPUTarget("cuda", 90, 32) with the arguments specialised as a real
launch specialises them (16-byte aligned pointers, ints divisible by 16 marked so, an int equal
to 1 a constant), disassembled with Triton's nvdisasm, and the largest loop (a backward branch's
span) is read as the K loop. Printed per case: the loop's instructions, per weight a thread reads
an iteration, and the barriers (BAR), shared-memory loads / stores (LDS / STS), global loads (LDG)
and conversions (F2F / I2F / F2I) in it; --json writes the table too.

    python scripts/count_int4_gemv_sass.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, INTER, TOP_K = 7168, 2048, 8  # Kimi-K2.5's routed experts
NVDISASM_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\.?(L\w+):")


def _gate_up_args() -> dict:
    return dict(num_counters=HIDDEN // 8, hidden=HIDDEN, inter=INTER, stride_x=HIDDEN,
                stride_packed_expert=2 * INTER * HIDDEN // 8, stride_scale_expert=2 * INTER * HIDDEN // 32,
                stride_act=INTER, words_per_row=HIDDEN // 8, groups_per_row=HIDDEN // 32)


def _down_args() -> dict:
    return dict(hidden=HIDDEN, inter=INTER, stride_act=INTER, stride_packed_expert=HIDDEN * INTER // 8,
                stride_scale_expert=HIDDEN * INTER // 32, stride_shared=HIDDEN, stride_out=HIDDEN,
                words_per_row=INTER // 8, groups_per_row=INTER // 32)


def _compile(fn, ints: dict, constants: dict, num_warps: int, pointer_types: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constexprs = {}, {}, dict(constants)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name], attrs[(i,)] = pointer_types.get(name, "*bf16"), [["tt.divisibility", 16]]
        elif ints[name] == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _sass(cubin: bytes) -> str:
    import triton.backends.nvidia as nvidia  # the nvdisasm Triton ships

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def largest_loop(sass: str) -> list[str]:
    """The instructions of the largest backward-branch span of the disassembly (the K loop)."""
    labels, lines = {}, []
    pending = []
    for raw in sass.splitlines():
        label = LABEL.match(raw.strip())
        if label:
            pending.append(label.group(1))
            continue
        line = NVDISASM_LINE.search(raw)
        if not line:
            continue
        address = int(line.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        lines.append((address, line.group(2)))
    best = []
    for address, text in lines:
        branch = re.match(r"(?:@!?U?P\w+\s+)?BRA\s+(?:\w+\s+)?`?\(?\.?(L\w+)", text)
        if branch and branch.group(1) in labels and labels[branch.group(1)] <= address:
            body = [t for a, t in lines if labels[branch.group(1)] <= a <= address]
            best = body if len(body) > len(best) else best
    return best


def count(body: list[str], weights_per_thread: int) -> dict:
    ops = [t.split()[0] if not t.startswith("@") else t.split()[1] for t in body]
    prefix = lambda p: sum(op.split(".")[0] == p for op in ops)  # noqa: E731
    return {"loop": len(ops), "per_weight": round(len(ops) / weights_per_thread, 2), "BAR": prefix("BAR"),
            "LDS": prefix("LDS"), "STS": prefix("STS"), "LDG": prefix("LDG"),
            "convert": prefix("F2F") + prefix("I2F") + prefix("F2I") + prefix("I2FP") + prefix("F2FP"),
            "FFMA": prefix("FFMA")}


def cases():
    from foretell.ops.moe import triton_int4_gemv as lanes
    from foretell.ops.moe import triton_int4_word_tiles as words

    gate_up_ptrs = {"packed_ptr": "*i32", "ids_ptr": "*i64", "counters_ptr": "*i32"}
    down_ptrs = {"packed_ptr": "*i32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "scratch_ptr": "*fp32",
                 "counters_ptr": "*i32"}
    gate_up_common = dict(TOP_K=TOP_K, ZERO_COUNTERS=True)
    down_common = dict(TOP_K=TOP_K, SLOTS=1, GROUPS=8, HAS_SHARED=True)
    table = []
    for block_n, block_k, warps in ((4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (16, 512, 4), (32, 512, 4),
                                    (64, 256, 4), (16, 256, 2)):
        tiles = dict(BLOCK_N=block_n, BLOCK_K=block_k)
        per_thread = 2 * block_n * block_k // (32 * warps)  # gate and up
        table.append((f"gate_up nibble_lanes {block_n}x{block_k}, {warps} warps", lanes._int4_gate_up_kernel,
                      _gate_up_args(), {**gate_up_common, **tiles}, warps, gate_up_ptrs, per_thread))
        table.append((f"gate_up word_tiles {block_n}x{block_k}, {warps} warps", words._int4_words_gate_up_kernel,
                      _gate_up_args(), {**gate_up_common, **tiles, "EVEN_K": True}, warps,
                      gate_up_ptrs, per_thread))
    for block_n, block_k, warps in ((8, 256, 2), (16, 256, 2), (32, 256, 2), (16, 512, 4)):
        tiles = dict(BLOCK_N=block_n, BLOCK_K=block_k)
        per_thread = block_n * block_k // (32 * warps)
        table.append((f"down nibble_lanes {block_n}x{block_k}, {warps} warps", lanes._int4_down_combine_kernel,
                      _down_args(), {**down_common, **tiles}, warps, down_ptrs, per_thread))
        table.append((f"down word_tiles {block_n}x{block_k}, {warps} warps", words._int4_words_down_combine_kernel,
                      _down_args(), {**down_common, **tiles, "EVEN_K": True}, warps, down_ptrs,
                      per_thread))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args()
    results = {}
    for name, fn, ints, constants, warps, pointers, per_thread in cases():
        if args.only not in name:
            continue
        try:
            compiled = _compile(fn, ints, constants, warps, pointers)
            results[name] = count(largest_loop(_sass(compiled.asm["cubin"])), per_thread)
        except Exception as e:  # one case's failure is reported, the rest still run
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"{name:48s} {results[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
