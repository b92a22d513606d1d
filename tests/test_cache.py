"""Where the cache folder is: $PAN2_RENDER_CACHE, else the account's ~/.cache/pan2-render."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from pan2render.cache import cache_root


@pytest.mark.parametrize("home", ["", None])
def test_an_empty_or_missing_home_uses_the_accounts_home_not_the_root(
        home: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAN2_RENDER_CACHE", raising=False)
    if home is None:
        monkeypatch.delenv("HOME", raising=False)
    else:
        monkeypatch.setenv("HOME", home)
    account = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert cache_root() == account / ".cache" / "pan2-render"
    assert not str(cache_root()).startswith("/.cache")


def test_the_variable_wins_and_an_empty_one_counts_as_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PAN2_RENDER_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.setenv("PAN2_RENDER_CACHE", "")
    assert cache_root() == tmp_path / "home" / ".cache" / "pan2-render"
