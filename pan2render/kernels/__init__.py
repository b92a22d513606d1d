"""Fast paths: the VAE decode kernel (vae_*.py) and DiT fusions (dit_*.py). Import submodules directly."""

from pan2render.kernels.dit_fused import set_fused_kernels  # noqa: E402,F401  (the pipeline imports it from here)
