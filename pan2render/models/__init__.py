"""PAN2 / Wan2.2 models: the reference implementation every other part stands on.

Public API (kept stable; tests outside the package call exactly this)::

    from pan2render.models import load_vae, load_dit, PAN2Pipeline, PAN2PipelineConfig
"""

from .loading import ModelFolderError
from .pipeline import PAN2Pipeline, PAN2PipelineConfig, load_dit, load_vae

__all__ = ["ModelFolderError", "PAN2Pipeline", "PAN2PipelineConfig", "load_dit", "load_vae"]
