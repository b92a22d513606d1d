"""Shared helpers for runner tests: batch files, and the Ray settings that keep start-up fast."""

from __future__ import annotations

import os

import pytest

# Ray: no uv-run runtime-env probing, no usage-stats network calls. Set before ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture
def fake_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every worker build the fake pipeline instead of the tiny model."""
    monkeypatch.setenv("PAN2_RENDER_PIPELINE", "pan2render.runner.worker.fake_pipeline:load_fake_pipeline")
