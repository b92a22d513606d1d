from __future__ import annotations

import pytest

from pan2render.models import PAN2Pipeline, PAN2PipelineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> PAN2Pipeline:
    """The embedded tiny model on the CPU, built into a cache of the module's own (a module that
    needs another build defines its own ``tiny``)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAN2_RENDER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield PAN2Pipeline.from_pretrained("tiny", PAN2PipelineConfig(device="cpu"))
    mp.undo()
