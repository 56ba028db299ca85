"""Arrows run one way (CONVENTIONS.md): no import cycle between Snapline's modules, the
runtime imports no concrete sink or connector, and sinks/connectors never import the runtime.

Module-level imports only: imports under ``if TYPE_CHECKING`` and inside functions do not
execute at import time. Package ``__init__`` files only re-export and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "snapline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts)


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("snapline")}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    return {
        name: {i for i in _imports(ast.parse(path.read_text())) if i in modules and i != name}
        for name, path in modules.items()
    }


def test_no_import_cycles() -> None:
    graph = import_graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_runtime_imports_no_concrete_sink_or_connector_and_sinks_not_the_runtime() -> None:
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("snapline.pipeline.runtime"):
            bad = {i for i in imports if i.startswith(("snapline.sinks", "snapline.connectors."))}
            bad -= {"snapline.connectors.config"}  # redaction of secrets in logged settings
            assert not bad, f"{module} imports {sorted(bad)}"
        if module.startswith(("snapline.sinks", "snapline.connectors")):
            bad = {i for i in imports if i.startswith("snapline.pipeline.runtime")}
            assert not bad, f"{module} imports the runtime: {sorted(bad)}"


def test_what_a_worker_imports_at_start_leaves_pyarrow_and_numpy_out() -> None:
    """A restarted worker's first output waits for its imports (benchmarks/README.md,
    "Recovery": process start and imports were ~0.5 s of ~1.3 s). The check for an
    interrupted savepoint restore that every worker makes at start imported the restore
    module, and with it pyarrow, pyarrow.compute and numpy: ~0.4 s on the benchmark host.
    The modules of a worker's start (the CLI, the worker, the modules it imports in its start
    path, a pipeline with the memory backend) must not import them."""
    import subprocess
    import sys

    script = (
        "import sys, tempfile, types\n"
        "import snapline.pipeline.cli\n"
        "from snapline.pipeline.checkpoint.storage import CheckpointStorage\n"
        "from snapline.pipeline.runtime.worker import Worker\n"
        "import examples.running_total\n"
        # The start's check for a savepoint restore, run for real on a stand-in admin client
        # whose cluster has no groups (the check imports what it needs when it runs).
        "worker = object.__new__(Worker)\n"
        "worker.pipeline = examples.running_total.pipeline\n"
        "worker.storage = CheckpointStorage(tempfile.mkdtemp())\n"
        "answer = types.SimpleNamespace(valid=[], errors=[])\n"
        "listing = types.SimpleNamespace(result=lambda timeout: answer)\n"
        "admin = types.SimpleNamespace(list_consumer_groups=lambda request_timeout: listing)\n"
        "worker._background_admin = lambda: admin\n"
        "worker._wait_for_restore()\n"
        "print(sorted(m for m in ('pyarrow', 'numpy') if m in sys.modules))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT.parent,
        check=True,
    ).stdout.strip()
    assert found == "[]", f"a worker's start imports {found}"
