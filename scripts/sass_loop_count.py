"""Count the sm_90 (H100/H200) instructions of a Triton kernel's main loop without a GPU, built as the
engine launches it: the kernel-compile fixtures' cases (tests/fixtures/kernel_compile*.py), with every
pointer and every integer argument marked divisible by 16 (what Triton's launcher specializes on when
the sizes are; name the ones that are not with --not16).

    python scripts/sass_loop_count.py --match "int4 moe gemv gate_up" [--not16 num_counters one] [--json OUT]

Prints, per matching case: the longest loop's instructions (the body between a backward branch and
its target), its most frequent opcodes, the shared-memory round trips in it (BAR / STS / LDS: a
layout conversion per iteration), and the kernel's registers. Counts are for reading a loop's cost
on paper; they have misled before (docs/perf-log.md): measure on the device before keeping a change.
Builds without the divisibility marks (fixtures/kernel_compile.py's, which only check that a kernel
compiles) pick other layouts and vector widths than the device runs, so do not count from those.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

FIXTURES = ("fixtures.kernel_compile", "fixtures.kernel_compile_low_precision")


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def compile_as_launched(fn, types: dict, constants: dict, num_warps: int, not16: set[str]):
    """fixtures.kernel_compile._compile with pointers and integers (but not16's) divisible by 16."""
    from fixtures.kernel_compile import _compile

    runtime = [name for name in fn.arg_names if name not in constants and name not in not16]
    divisible = {name for name in runtime
                 if name.endswith("_ptr") or types.get(name, "i32").startswith(("*", "i"))}
    return _compile(fn, types, constants, num_warps, divisible_by_16=divisible)


def _disassemble(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    finally:
        os.unlink(f.name)
    return sass, usage


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop: from a label to the backward branch that returns to it."""
    labels, instructions = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if found:
            instructions.append(found.group(1).strip())
    loops = []
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            loops.append(instructions[labels[branch.group(1)]:i + 1])
    return max(loops, key=len, default=[])


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def count_case(name: str, case: tuple, not16: set[str]) -> dict:
    fn, types, constants, *rest = case
    compiled = compile_as_launched(fn, types, constants, rest[0] if rest else 4, not16)
    sass, usage = _disassemble(compiled.asm["cubin"])
    loop = longest_loop(sass)
    ops = collections.Counter(opcode(i) for i in loop)
    registers = re.search(r"REG:(\d+)", usage)
    return {"case": name, "loop_instructions": len(loop), "registers": int(registers.group(1)) if registers else None,
            "shared_round_trips": {op: ops[op] for op in ("BAR", "STS", "STSM", "LDS") if ops[op]},
            "top_opcodes": dict(ops.most_common(12))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default="", help="cases whose name contains this (case-insensitive)")
    parser.add_argument("--not16", nargs="*", default=["num_counters", "one", "max_exp"],
                        help="integer arguments not to mark divisible by 16")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    rows = []
    for module in FIXTURES:
        for name, case in importlib.import_module(module)._cases().items():
            if args.match.lower() in name.lower():
                try:
                    rows.append(count_case(name, case, set(args.not16)))
                except Exception as e:  # noqa: BLE001 (a case that does not build is reported, the rest go on)
                    rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
                print(json.dumps(rows[-1]), flush=True)
    if not rows:
        parser.error(f"no kernel-compile case matches {args.match!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
