"""The model layer stands alone: nothing under pan2render/models imports the layers built on it
(parallel, runner, jobs), not even lazily inside a function. Parallelism is applied to a plain
pipeline from outside (`pan2render.parallel.parallelize_pipeline`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pan2render.models

FORBIDDEN = ("pan2render.parallel", "pan2render.runner", "pan2render.jobs")
MODELS = Path(pan2render.models.__file__).parent


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at ``path``, a module of ``package``:
    top-level or nested in a function, relative ones resolved, ``from X import name`` counted as
    both X and X.name (name may be a submodule), ``importlib.import_module("...")`` / ``__import__``
    with a literal name included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def forbidden_imports(root: Path, package: str) -> list[str]:
    """``file:line: module`` for every import of a FORBIDDEN layer in the package at ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        # The package a relative import starts from: the folder the file is in (for an __init__.py
        # too, since "." there is the package itself).
        module_package = ".".join([package, *path.relative_to(root).parts[:-1]])
        for line, module in imported_modules(path, module_package):
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN):
                problems.append(f"{path.relative_to(root.parent)}:{line}: {module}")
    return problems


def test_models_import_nothing_from_parallel_runner_or_jobs() -> None:
    assert list(MODELS.glob("*.py")), MODELS  # the walk sees the package
    problems = forbidden_imports(MODELS, "pan2render.models")
    assert problems == [], "pan2render/models must not import the layers above it:\n" + "\n".join(problems)


@pytest.mark.parametrize("source", [
    "def parallelize(pipe, group):\n    from ..parallel import parallelize_pipeline\n    return 1\n",
    "from .. import parallel\n",
    "import pan2render.runner.worker.render_worker\n",
    "class A:\n    def f(self):\n        from pan2render.jobs.spec import JobSpec\n",
    "import importlib\nmod = importlib.import_module('pan2render.parallel.decode')\n",
])
def test_the_walk_finds_lazy_and_relative_imports(tmp_path: Path, source: str) -> None:
    """Negative control: each of these, dropped into a copy of the model package, is reported."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "clean.py").write_text("from .vae import WanVAE\nimport torch\nfrom ..kernels import vae_decode\n")
    assert forbidden_imports(root, "pan2render.models") == []
    (root / "leaky.py").write_text(source)
    problems = forbidden_imports(root, "pan2render.models")
    assert problems and all(p.startswith("models/leaky.py:") for p in problems), problems
