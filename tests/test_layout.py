"""The package's shape: exports, documented import paths, layers, no cycles. Modules split
where a concern ends, not at a line count."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

import celery_semaphore
from celery_semaphore import SemaphoreTask, SemaphoreValidationError, bounded
from celery_semaphore.testing import unbounded

PACKAGE = Path(celery_semaphore.__file__).parent

LAYERS = {"core": 0, "asyncio": 1, "integration": 2, "views": 3}
"""Imports only point down: views -> integration -> asyncio -> core (errors is below them
all)."""

DOCUMENTED_MODULES = [
    "celery_semaphore",
    "celery_semaphore.core",
    "celery_semaphore.asyncio",
    "celery_semaphore.integration",
    "celery_semaphore.views.cli",
    "celery_semaphore.views.flower",
    "celery_semaphore.flower",
    "celery_semaphore.views.inspection",
    "celery_semaphore.errors",
    "celery_semaphore.signals",
    "celery_semaphore.metrics",
    "celery_semaphore.testing",
    "celery_semaphore.pytest_plugin",
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports at module level (TYPE_CHECKING blocks aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports nothing at run time
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            if node.module is None:  # `from . import sibling` imports the sibling only
                found.update(f"{base}.{alias.name}" for alias in node.names)
                continue
            target = f"{base}.{node.module}"
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and str(node.module).startswith("celery_semaphore"):
            found.add(str(node.module))
    return found


def test_every_exported_name_and_documented_module_imports() -> None:
    for module_name in DOCUMENTED_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            assert getattr(module, name) is not None, f"{module_name}.{name}"


def test_imports_only_point_down_and_never_in_a_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path) & modules.keys() for name, path in modules.items()}
    for name, targets in graph.items():
        layer = LAYERS.get(name.split(".")[1]) if name.count(".") else None
        for target in targets:
            target_layer = LAYERS.get(target.split(".")[1]) if target.count(".") else None
            if layer is not None and target_layer is not None:
                assert target_layer <= layer, f"{name} imports {target}, a layer above it"
            if layer in (LAYERS["core"], LAYERS["asyncio"]):
                assert target_layer in (None, 0, layer), f"{name} imports {target}"
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in graph[node]:
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target] if target in path else [target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_the_core_and_asyncio_import_no_celery() -> None:
    probe = (
        "import sys, celery_semaphore, celery_semaphore.core, celery_semaphore.asyncio;"
        "from celery_semaphore import Semaphore;"
        "print(sorted(m for m in sys.modules if m == 'celery' or m.startswith('celery.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_unbounded_runs_bodies_with_no_semaphore_and_then_bounds_again() -> None:
    # No Redis answers at this URL: only a body run without a semaphore can succeed.
    app = Celery("unbounded", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=SemaphoreTask, semaphore="k", limit=1, shared=False, name="u.t")
    def t(n: int) -> int:
        return n

    @bounded("k", 1, app=app)
    def plain(n: int) -> int:
        return n

    with unbounded():
        with unbounded():
            assert t.apply((1,)).get() == 1
        assert t(2) == 2
        assert plain(3) == 3
    with pytest.raises(celery_semaphore.SemaphoreError):
        plain(4)
    # A task whose options are invalid is refused even inside unbounded().
    with unbounded(), pytest.raises(SemaphoreValidationError):

        @app.task(base=SemaphoreTask, semaphore="k", limit=0, shared=False, name="u.bad")
        def bad() -> None: ...

        bad.apply().get()
