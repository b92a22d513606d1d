"""Every import a package's modules make, lazy ones included: what the layer and role tests walk."""

from __future__ import annotations

import ast
from pathlib import Path


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


def package_imports(root: Path, package: str) -> list[tuple[Path, int, str]]:
    """(file, line, module) of every import of every module of the package at ``root`` (named
    ``package``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        # The package a relative import starts from: the folder the file is in (for an __init__.py
        # too, since "." there is the package itself).
        module_package = ".".join([package, *path.relative_to(root).parts[:-1]])
        out += [(path, line, module) for line, module in imported_modules(path, module_package)]
    return out
