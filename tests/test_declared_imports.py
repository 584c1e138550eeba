"""Every distribution declares what it imports: a module-level import names one of its required dependencies, an
import inside a function (taken only when a feature is used) names a required dependency or one of its extras.

The imports are read from the source (``ast``), so a lazy import that a test never reaches is checked too; the
module -> distribution map is the installed environment's (:func:`importlib.metadata.packages_distributions`).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Top-level module names imported at module level (outside ``if TYPE_CHECKING``), and everywhere else."""
    tree = ast.parse(path.read_text(), filename=str(path))
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, at_module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            (eager if at_module_level else lazy).update(n.partition(".")[0] for n in names)
            deeper = at_module_level and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try, ast.If)
            )
            visit(child, deeper)

    visit(tree, True)
    return eager, lazy


@pytest.mark.parametrize("package", DISTRIBUTIONS, ids=lambda p: p.name)
def test_each_import_is_a_declared_dependency(package: Path) -> None:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    own = project["name"].replace("-", "_")
    required = _names(project.get("dependencies", []))
    extras = set().union(*(_names(v) for v in project.get("optional-dependencies", {}).values()))
    owners = {m: {d.lower().replace("_", "-") for d in dists} for m, dists in packages_distributions().items()}
    for other in DISTRIBUTIONS:  # editable installs list no modules: this monorepo's own are its src folders
        name = tomllib.loads((other / "pyproject.toml").read_text())["project"]["name"]
        owners.update({src.name: {name} for src in (other / "src").iterdir() if (src / "__init__.py").exists()})
    problems = []
    for path in sorted((package / "src").rglob("*.py")):
        eager, lazy = _imports(path)
        for module in sorted((eager | lazy) - set(sys.stdlib_module_names) - {own, "__future__"}):
            # a module not installed here (an optional GPU extra): its distribution by the usual spelling
            dists = owners.get(module) or {module.replace("_", "-")}
            where = path.relative_to(ROOT)
            if not dists & (required | (set() if module in eager else extras)):
                kind = "at module level (a required dependency)" if module in eager else "(a dependency or extra)"
                problems.append(f"{where}: imports {module} {kind}, but {package.name} declares none of {dists}")
    assert not problems, "\n".join(problems)


def test_the_distributions_depend_on_each_other_without_a_cycle() -> None:
    """Requirements and extras among this monorepo's distributions form a DAG (galva-ckpt once required galva-models
    through an extra while galva-models required galva-ckpt)."""
    graph: dict[str, set[str]] = {}
    for package in DISTRIBUTIONS:
        project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
        wanted = _names(project.get("dependencies", []))
        wanted |= set().union(*(_names(v) for v in project.get("optional-dependencies", {}).values()))
        graph[project["name"]] = wanted
    graph = {name: wanted & set(graph) for name, wanted in graph.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "dependency cycle: " + " -> ".join((*path, name))
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())


def _module_name(src: Path, path: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _own_imports(src: Path, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``src`` that ``path`` imports, eagerly or inside a function (a lazy import is still an arrow:
    it only hides a circle until that function runs); ``if TYPE_CHECKING`` blocks are left out (they never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(src, path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {name for name in found if name in modules and name != here}


@pytest.mark.parametrize("package", DISTRIBUTIONS, ids=lambda p: p.name)
def test_the_modules_of_a_distribution_import_each_other_without_a_circle(package: Path) -> None:
    """No two modules of one distribution import each other, directly or round a longer circle (``galva_profiler.cli``
    and ``model_cli`` once did). A package's ``__init__`` is its front door, re-exporting its modules: arrows into it
    are not followed (every module of a package runs it first anyway)."""
    src = package / "src"
    paths = {_module_name(src, p): p for p in sorted(src.rglob("*.py"))}
    fronts = {name for name, p in paths.items() if p.name == "__init__.py"}
    graph = {name: _own_imports(src, p, set(paths)) - fronts for name, p in paths.items()}
    circles: list[str] = []
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            circles.append(" -> ".join((*path[path.index(name) :], name)))
            return
        if name not in done:
            for other in sorted(graph[name]):
                visit(other, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())
    assert not circles, "import circles:\n" + "\n".join(circles)
