"""The README's "First five minutes", run as typed, in order, from a fresh clone, on the tiny model.

The clone is the repository's tracked files copied to a temporary folder. Creating a venv and
installing into it would take minutes (and the network), so the clone gets a stand-in ``.venv``
already marked installed: its ``python`` and ``pan2-render`` run this interpreter on the clone's
own code, and its ``activate`` puts them on PATH. Everything else (``make run``, the Makefile's
stamps, every ``pan2-render`` line) runs exactly as written in the README.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- first-five-minutes -->"


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split(MARK, 1)[1].split("<!-- /first-five-minutes -->", 1)[0]
    body = re.search(r"```sh\n(.*?)```", block, re.S)
    assert body, "README.md: the first-five-minutes block has no ```sh fence"
    joined = body.group(1).replace("\\\n", " ")  # a command continued with a backslash is one line
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _fresh_clone(dest: Path) -> None:
    try:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked-file list to clone from")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _stand_in_venv(clone: Path) -> None:
    bin_dir = clone / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "python": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
        "pan2-render": f'#!/bin/sh\nexec "{sys.executable}" -m pan2render.runner.cli "$@"\n',
        "activate": f'export PATH="{bin_dir}:$PATH"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for stamp in (".installed-run", ".installed-test"):  # newer than pyproject.toml: no install
        (clone / ".venv" / stamp).touch()


def test_readme_first_five_minutes_work_as_typed(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    commands = readme_commands()
    assert commands[0].startswith("make run") and any(c.startswith("source .venv/bin/activate") for c in commands)
    clone = tmp_path / "pan2-render"
    clone.mkdir()
    _fresh_clone(clone)
    _stand_in_venv(clone)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env.update({"PYTHONPATH": str(clone), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "PATH": "/usr/local/bin:/usr/bin:/bin"})  # no pan2-render on PATH until `activate`
    script = "set -e\n" + "".join(f"echo '$ {c}'\n{c}\n" for c in commands)
    proc = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900,
                          start_new_session=True)
    print(proc.stdout[-4000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"a README command failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert len(list((clone / "renders" / "quickstart").glob("*/video.mp4"))) == 6
    assert len(list((clone / "renders" / "sweep-tiny").glob("*/video.mp4"))) == 6
    assert (clone / "renders" / "quickstart" / "index.html").is_file()
    assert proc.stdout.rstrip().endswith("6 done")  # the last status line


def test_the_readme_says_what_the_browser_tests_need_as_ci_installs_it() -> None:
    """`make test`'s browser tests skip without Chromium: the README names the package `.ci/run`
    installs and every name the tests look for it under."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    package = re.search(r"apt-get install [^\n]*?(\bchromium\b)", ci)
    assert package is not None
    assert f"apt-get install {package[1]}`" in readme and "`.ci/run` installs it" in readme
    helpers = (REPO / "tests" / "runner" / "runner_helpers.py").read_text()
    names = re.search(r"CHROMIUM = .*?\((.*?)\)\)", helpers)
    assert names is not None
    for name in re.findall(r'"([\w-]+)"', names[1]):
        assert f"`{name}`" in readme, name
