"""The model layer stands alone: nothing under pan2render/models imports the layers built on it
(parallel, runner, jobs), not even lazily inside a function. Parallelism is applied to a plain
pipeline from outside (`pan2render.parallel.parallelize_pipeline`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_walk import package_imports

import pan2render.models

FORBIDDEN = ("pan2render.parallel", "pan2render.runner", "pan2render.jobs")
MODELS = Path(pan2render.models.__file__).parent


def forbidden_imports(root: Path, package: str) -> list[str]:
    """``file:line: module`` for every import of a FORBIDDEN layer in the package at ``root``."""
    return [f"{path.relative_to(root.parent)}:{line}: {module}" for path, line, module in package_imports(root, package)
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN)]


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
