"""The package's import structure: no circles between files, the layers of DESIGN.md ("Who may
import whom"), a torch-free engine core, and a light `import foretell` / `foretell --help`.

The graph is read from the source (ast), not from a running interpreter, so it sees every import
whether or not a test happens to reach it. An edge A -> B means module A names module B (or a
name inside B) in an import statement. Each edge has a kind:
  top       at module level: runs when A is imported;
  deferred  inside a function or method: runs when that code first runs;
  type      under `if TYPE_CHECKING:`: never runs, annotations only.
Decisions:
- Circles count top and deferred edges. A deferred import is how a circle is usually hidden (the
  module works because its half of the circle loads late), yet the two files still cannot be
  understood, tested or moved apart, so it is a circle all the same. Type-only edges do not count:
  they never execute, and annotating with a type from a file that imports you is harmless.
- The layer rules count every kind, type-only included: a spec_decode module that annotates an
  argument with a runner class is handed the runner, which is what the rule forbids.
- Importing a submodule also runs its packages' __init__ files; those implicit edges are left
  out (the package __init__ files import nothing, except foretell/__init__.py, which is lazy).
- Relative imports are resolved; `from foretell.x import y` is an edge to foretell.x.y when that
  is a module, else to foretell.x.

Known exceptions are listed with the reason and what removes them; the tests fail when one is
no longer needed, so the lists only shrink.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "foretell"
REPO_ROOT = PACKAGE_DIR.parent

# The engine's core: what the scheduler needs to decide a step. No torch, nothing of the device side.
CORE_MODULES = (
    "foretell.config",
    "foretell.sampling_params",
    "foretell.engine.scheduler",
    "foretell.engine.block_manager",
    "foretell.engine.sequence",
    "foretell.engine.outputs",
    "foretell.engine.metrics",
)
DEVICE_SIDE_PACKAGES = ("foretell.runner", "foretell.models", "foretell.layers", "foretell.ops")
HEAVY_FOR_CORE = ("torch", "triton", "transformers", "fastapi")
# Nothing here is needed to print help; each costs from tenths of a second to many seconds.
HEAVY_FOR_HELP = (
    "torch", "numpy", "triton", "transformers", "tokenizers", "safetensors", "huggingface_hub",
    "fastapi", "starlette", "uvicorn", "pydantic", "matplotlib", "httpx", "requests", "jinja2",
    "tqdm",
)

# (importer, imported) edges that close a circle today. Each is the import that should go.
KNOWN_CIRCLE_EDGES: dict[tuple[str, str], str] = {}

# (importer, imported) edges that break a layer rule today.
KNOWN_LAYER_EXCEPTIONS = {
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    kind: str  # top | deferred | type
    line: int


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: strip (level - 1) packages off this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names] + [base]  # the package last


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of a package module by a package module, with its kind (see the docstring)."""

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], Edge] = {}
    rank = {"top": 0, "deferred": 1, "type": 2}  # an edge keeps its strongest kind

    for module, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
            for child in ast.iter_child_nodes(node):
                child_in_function = in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                )
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    kind = "type" if type_only else ("deferred" if in_function else "top")
                    names = _imported_names(child, module, is_package)
                    # `from a import b`: b as a module when it is one, else a itself
                    if isinstance(child, ast.ImportFrom):
                        names = [n for n in names[:-1] if n in modules] or names[-1:]
                    targets = {owner(n) for n in names}
                    for target in targets:
                        if target is None or target == module or not target.startswith("foretell"):
                            continue
                        old = edges.get((module, target))
                        if old is None or rank[kind] < rank[old.kind]:
                            edges[(module, target)] = Edge(module, target, kind, child.lineno)
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.body:
                        visit(ast.Module(body=[stmt], type_ignores=[]), child_in_function, True)
                    for stmt in child.orelse:
                        visit(ast.Module(body=[stmt], type_ignores=[]), child_in_function, type_only)
                    continue
                visit(child, child_in_function, type_only)

        visit(ast.parse(path.read_text(), filename=str(path)), False, False)
    return sorted(edges.values(), key=lambda e: (e.importer, e.imported))


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    modules = module_files()
    return modules, import_edges(modules)


def find_circles(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        successors[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(successors[node]):
                work.append((node, i + 1))
                nxt = successors[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return circles


def describe(edges: list[Edge], modules: dict[str, Path], members: set[str]) -> str:
    lines = []
    for e in edges:
        if e.importer in members and e.imported in members:
            where = modules[e.importer].relative_to(REPO_ROOT)
            lines.append(f"  {e.importer} -> {e.imported} ({e.kind}, {where}:{e.line})")
    return "\n".join(lines)


def test_graph_reader_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The reader itself, on a small package laid out on disk: every import form, every kind."""
    pkg = tmp_path / "foretell"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text(
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "import foretell.sub.b\n"
        "from foretell.sub import c\n"
        "if TYPE_CHECKING:\n"
        "    from foretell.sub.d import Thing\n"
        "def f():\n"
        "    from .sub.e import g\n"
        "    return g\n"
    )
    for name in "bcde":
        (pkg / "sub" / f"{name}.py").write_text("X = 1\n")
    (pkg / "sub" / "e.py").write_text("from ..a import f\n")  # a -> e (deferred) -> a: a circle
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", pkg)
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    modules = module_files()
    assert set(modules) == {"foretell", "foretell.a", "foretell.sub"} | {
        f"foretell.sub.{n}" for n in "bcde"
    }
    got = {(e.importer, e.imported, e.kind) for e in import_edges(modules)}
    assert got == {
        ("foretell.a", "foretell.sub.b", "top"),
        ("foretell.a", "foretell.sub.c", "top"),
        ("foretell.a", "foretell.sub.d", "type"),
        ("foretell.a", "foretell.sub.e", "deferred"),
        ("foretell.sub", "foretell.sub.b", "top"),
        ("foretell.sub.e", "foretell.a", "top"),
    }
    circles = find_circles(list(modules), [e for e in import_edges(modules) if e.kind != "type"])
    assert circles == [["foretell.a", "foretell.sub.e"]]


def test_no_import_circles_between_files(graph):
    modules, edges = graph
    running = [e for e in edges if e.kind != "type"]
    allowed = [e for e in running if (e.importer, e.imported) not in KNOWN_CIRCLE_EDGES]
    circles = find_circles(list(modules), allowed)
    report = "\n".join(f"{c}:\n{describe(allowed, modules, set(c))}" for c in circles)
    assert not circles, f"import circles between files (break them; see DESIGN.md):\n{report}"

    present = {(e.importer, e.imported) for e in running}
    in_a_circle = set()
    for circle in find_circles(list(modules), running):
        in_a_circle |= {(a, b) for a, b in present if a in circle and b in circle}
    stale = sorted(edge for edge in KNOWN_CIRCLE_EDGES if edge not in in_a_circle)
    assert not stale, f"these known circle edges no longer close a circle: delete them from KNOWN_CIRCLE_EDGES: {stale}"


def _layer_rules() -> list[tuple[str, callable, tuple[str, ...]]]:
    def under(*packages):
        return lambda m: any(m == p or m.startswith(p + ".") for p in packages)

    face_and_tools = ("foretell.cli", "foretell.cli_args", "foretell.server", "foretell.bench",
                      "foretell.eval", "foretell.training")
    engine_layer = ("foretell.engine.llm", "foretell.engine.engine", "foretell.engine.warm_up")
    below_engine = ("foretell.runner", "foretell.spec_decode", "foretell.models", "foretell.layers",
                    "foretell.ops")
    return [
        ("the core imports nothing of runner, models, layers or ops",
         lambda m: m in CORE_MODULES, DEVICE_SIDE_PACKAGES),
        ("spec_decode never imports runner", under("foretell.spec_decode"), ("foretell.runner",)),
        ("layers never import models", under("foretell.layers"), ("foretell.models",)),
        ("models never import runner", under("foretell.models"), ("foretell.runner",)),
        ("ops import nothing of the package above them",
         under("foretell.ops"),
         ("foretell.engine", "foretell.runner", "foretell.spec_decode", "foretell.models",
          "foretell.layers", "foretell.loader", *face_and_tools)),
        ("nothing below the engine imports the engine", under(*below_engine, *CORE_MODULES),
         engine_layer),
        ("nothing below the face and tools imports them",
         under("foretell.engine", *below_engine, *CORE_MODULES), face_and_tools),
    ]


def test_layer_rules_hold(graph):
    modules, edges = graph
    broken = []
    seen_exceptions = set()
    for rule, applies_to, forbidden in _layer_rules():
        for e in edges:
            if not applies_to(e.importer):
                continue
            if not any(e.imported == f or e.imported.startswith(f + ".") for f in forbidden):
                continue
            if (e.importer, e.imported) in KNOWN_LAYER_EXCEPTIONS:
                seen_exceptions.add((e.importer, e.imported))
                continue
            where = modules[e.importer].relative_to(REPO_ROOT)
            broken.append(f"  {rule}: {e.importer} -> {e.imported} ({e.kind}, {where}:{e.line})")
    assert not broken, "imports against DESIGN.md's layers:\n" + "\n".join(broken)
    stale = sorted(set(KNOWN_LAYER_EXCEPTIONS) - seen_exceptions)
    assert not stale, f"these layer exceptions are gone: delete them from KNOWN_LAYER_EXCEPTIONS: {stale}"


def test_core_modules_exist(graph):
    modules, _ = graph
    missing = [m for m in CORE_MODULES if m not in modules]
    assert not missing, f"CORE_MODULES names modules that are gone: {missing}"


def loaded_modules_after(code: str) -> tuple[set[str], float, str]:
    """Run code in a fresh interpreter; the modules loaded at its end, its wall time, its stdout."""
    probe = code + "\nimport sys, json\nsys.stderr.write('MODULES ' + json.dumps(sorted(sys.modules)) + '\\n')\n"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    wall_s = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    line = next(l for l in done.stderr.splitlines() if l.startswith("MODULES "))
    return set(json.loads(line[len("MODULES "):])), wall_s, done.stdout


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_torch(module):
    loaded, _, _ = loaded_modules_after(f"import {module}")
    heavy = sorted(m for m in HEAVY_FOR_CORE if m in loaded)
    device_side = sorted(m for m in loaded if m.startswith(DEVICE_SIDE_PACKAGES))
    assert not heavy, f"importing {module} loads {heavy}"
    assert not device_side, f"importing {module} loads {device_side}"


def test_core_works_without_torch():
    """The core does its job with torch made unimportable: config validation, sampling params,
    a sequence through the block manager."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "from foretell.config import build_engine_config, ModelConfig\n"
        "from foretell.sampling_params import SamplingParams\n"
        "import foretell.engine.scheduler, foretell.engine.block_manager, foretell.engine.metrics\n"
        "try:\n"
        "    ModelConfig(model='m', dtype='float64')\n"
        "except ValueError as e:\n"
        "    assert 'float64' in str(e)\n"
        "else:\n"
        "    raise SystemExit('dtype float64 was accepted')\n"
        "SamplingParams(temperature=0.5, max_tokens=3)\n"
    )
    loaded_modules_after(code)


def test_import_foretell_is_light():
    loaded, wall_s, _ = loaded_modules_after("import foretell")
    heavy = sorted(m for m in HEAVY_FOR_HELP if m in loaded)
    ours = sorted(m for m in loaded if m.startswith("foretell."))
    assert not heavy, f"`import foretell` loads {heavy}"
    assert not ours, f"`import foretell` loads {ours} (the public names load on first use)"
    print(f"import foretell: {wall_s:.2f} s in a fresh interpreter")


def test_public_names_load_on_first_use():
    loaded, _, out = loaded_modules_after(
        "import foretell\n"
        "from foretell import LLM, SamplingParams, SpeculativeConfig\n"
        "print(LLM.__module__, SamplingParams.__module__, SpeculativeConfig.__module__)\n"
        "print(sorted(foretell.__all__) == sorted(n for n in dir(foretell) if n in foretell.__all__))\n"
        "try:\n"
        "    foretell.NoSuchName\n"
        "except AttributeError as e:\n"
        "    print('AttributeError', e)\n"
    )
    assert out.splitlines() == [
        "foretell.engine.llm foretell.sampling_params foretell.speculative_config",
        "True",
        "AttributeError module 'foretell' has no attribute 'NoSuchName'",
    ]
    assert "foretell.engine.llm" in loaded


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["bench"], ["eval"], ["train-eagle3"]],
                         ids=lambda c: " ".join(c) or "top")
def test_cli_help_is_light(command):
    code = (
        "from foretell.cli import main\n"
        "try:\n"
        f"    main({command + ['--help']!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
    )
    loaded, wall_s, out = loaded_modules_after(code)
    assert out.startswith("usage: foretell"), out[:200]
    heavy = sorted(m for m in HEAVY_FOR_HELP if m in loaded)
    assert not heavy, f"`foretell {' '.join(command)} --help` loads {heavy}"
    print(f"foretell {' '.join(command)} --help: {wall_s:.2f} s in a fresh interpreter")
