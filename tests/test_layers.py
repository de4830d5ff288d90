"""The package's layers: no import cycle between modules, and no stage importing one above it.

``LAYERS`` is the order of docs/design.md ("Layout"), lowest first: a unit (a top-level module or package of
``seqcal``; the activation cache, ``execution.cache``, is a unit of its own) imports only itself and units of
lower layers. Every import counts: at the top of a module, inside a function, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent / "src" / "seqcal"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "assets"),
    ("console", "backend"),  # kernels, process settings, the thread count from the free cores
    ("algorithms", "models"),  # pure tensor math; model names and Hub ids -> directories
    ("owners",),  # after which subgraph the streaming writers (checkpoint, GGUF) write each module
    ("gguf",),  # GGUF's grids and types (schemes name them), its writer
    ("records", "sources"),  # the data that crosses stages; quantized source checkpoints read per weight
    ("tracing", "execution.cache", "data"),  # trace, partition, run a graph; the activation cache; batches
    ("experts", "report", "multimodal"),  # multimodal: processors, media rows
    ("mappings",),
    ("modifiers",),
    ("recipe", "checkpoint"),
    ("evaluation", "distributed"),
    ("execution",),  # the pipeline: calls every stage below
    ("plan",),  # the memory plan and the host-memory budget's decisions
    ("run_args",),  # oneshot's configuration
    ("loading", "modelfree"),  # the model as the user gave it; model-free quantization (no model class)
    ("entrypoint",),  # oneshot
    ("seqcal",),  # the package's public names
    ("cli",),  # the command
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module(path: Path) -> str:
    parts = ("seqcal", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(ROOT.rglob("*.py"))}


def _unit(module: str) -> str:
    if module == "seqcal":
        return "seqcal"
    if module == "seqcal.execution.cache" or module.startswith("seqcal.execution.cache."):
        return "execution.cache"
    return module.split(".")[1]


def _imports(module: str) -> set[str]:
    """The seqcal modules ``module`` imports (a name imported from a package counts as its submodule when it
    is one), anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in MODULES}
    assert units <= set(RANK), f"add these to LAYERS (and to docs/design.md): {sorted(units - set(RANK))}"
    assert set(RANK) <= units, f"LAYERS names units that do not exist: {sorted(set(RANK) - units)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module: str) -> None:
    unit = _unit(module)
    wrong = sorted(
        target
        for target in GRAPH[module]
        if _unit(target) != unit and RANK.get(_unit(target), -1) >= RANK.get(unit, -1)
    )
    assert not wrong, f"{module} (layer {RANK.get(unit)}: {unit}) imports {wrong}, not below it (LAYERS)"


def test_no_import_cycle_between_modules() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(MODULES):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_check_sees_an_upward_import() -> None:
    """The graph is read right: the entrypoint imports the pipeline, and the tracer nothing of execution."""
    assert "seqcal.execution.pipeline" in GRAPH["seqcal.entrypoint"]
    assert "seqcal.records" in GRAPH["seqcal.checkpoint.writer"]
    assert RANK["execution"] > RANK["tracing"]
    assert not any(_unit(t) == "execution" for m in MODULES if _unit(m) == "tracing" for t in GRAPH[m])
