"""The runner's rooms: every module lives in the package of its role, and imports go one way between
roles, from the commands at the top to the protocol at the bottom, lazy imports inside functions
included (they run as surely as the others, only later)."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_walk import package_imports

import pan2render.runner

RUNNER = Path(pan2render.runner.__file__).parent
# Top to bottom: a role may import its own modules and those of the roles below it, never above.
ROLES = ("cli", "farm", "serve", "views", "cluster", "worker", "protocol")


def role_of(module: str) -> str | None:
    """The role of a module of ``pan2render.runner`` (None: not one of the runner's)."""
    parts = module.split(".")
    if parts[:2] != ["pan2render", "runner"] or len(parts) < 3:
        return None
    return parts[2]


def upward_imports(root: Path) -> list[str]:
    """``file:line: module`` for every import of a module of a higher role (or of no role)."""
    problems = []
    for path, line, module in package_imports(root, "pan2render.runner"):
        rel = path.relative_to(root)
        if len(rel.parts) < 2:
            continue  # runner/__init__.py
        mine, theirs = rel.parts[0], role_of(module)
        if theirs is None or theirs == mine:
            continue
        if theirs not in ROLES or ROLES.index(theirs) < ROLES.index(mine):
            problems.append(f"runner/{rel}:{line}: {module} ({mine} -> {theirs})")
    return problems


def test_every_runner_module_is_in_the_package_of_its_role() -> None:
    loose = sorted(p.name for p in RUNNER.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules directly in pan2render/runner: {loose}"
    packages = sorted(p.name for p in RUNNER.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(ROLES), packages


def test_imports_go_down_the_roles_only() -> None:
    assert len(package_imports(RUNNER, "pan2render.runner")) > 100  # the walk sees the runner
    problems = upward_imports(RUNNER)
    assert problems == [], "imports that run up the runner's roles:\n" + "\n".join(problems)


@pytest.mark.parametrize(("role", "source"), [
    ("protocol", "from pan2render.runner.serve.retry import RetryPolicy\n"),
    ("worker", "def f():\n    from pan2render.runner.cluster import executor\n"),
    ("views", "import pan2render.runner.serve.progress\n"),
    ("serve", "from ..farm import service\n"),
    ("cluster", "import importlib\nm = importlib.import_module('pan2render.runner.serve.scheduler')\n"),
    ("farm", "class A:\n    def f(self):\n        from pan2render.runner.cli.main import main\n"),
])
def test_the_walk_finds_an_import_that_runs_up(tmp_path: Path, role: str, source: str) -> None:
    """Negative control: each of these, dropped into a copy of a lower role's package, is reported."""
    root = tmp_path / "runner"
    for r in ROLES:
        (root / r).mkdir(parents=True)
        (root / r / "__init__.py").write_text("")
    (root / "serve" / "clean.py").write_text("from pan2render.runner.protocol import messages\n"
                                            "from ..cluster.executor import Executor\n")
    assert upward_imports(root) == []
    (root / role / "leaky.py").write_text(source)
    problems = upward_imports(root)
    assert problems and all(p.startswith(f"runner/{role}/leaky.py:") for p in problems), problems


MODULE_LINES_MAX = 450  # a module longer than this usually holds two responsibilities: split it


def test_no_runner_module_holds_two_rooms() -> None:
    long = {str(p.relative_to(RUNNER)): n for p in RUNNER.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MODULE_LINES_MAX}
    assert long == {}, f"runner modules over {MODULE_LINES_MAX} lines: {long}"
