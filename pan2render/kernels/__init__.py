"""Fast paths: the VAE decode kernel (vae_*.py), DiT fusions (dit_*.py) and the attention backend
choice (attention.py). Import submodules directly."""
