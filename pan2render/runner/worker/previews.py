"""The worker's preview maker, run on its I/O lane: a sampling's predicted latents, handed over at a
step boundary by the GPU lane (`pan2render.models.preview`), become the WebP strip the driver keeps
as ``DIR/<job>/preview.webp``, with the note of what it shows (`pan2render.preview_file`)."""

from __future__ import annotations

from pan2render.media.video import webp_strip
from pan2render.models.preview import PreviewLatents, RgbMap
from pan2render.preview_file import PreviewNote, with_note

# Pixels a preview's tiles are tall: a 704x1248 video's latent frame (44 x 78) at twice its size, as
# the monitor shows it; smaller videos' tiles are scaled up to the same height.
PREVIEW_HEIGHT = 88


def make_preview(latents: PreviewLatents, rgb_map: RgbMap) -> bytes:
    """The map applied to each latent frame held, the tiles scaled to PREVIEW_HEIGHT, side by side,
    encoded, and the note added."""
    tiles = list(rgb_map.apply(latents.x0.numpy()))  # each uint8 [h, w, 3]
    note = PreviewNote(step=latents.step, total_steps=latents.total_steps, frames=latents.frames,
                       map=rgb_map.source, at=latents.at)
    return with_note(webp_strip(tiles, height=PREVIEW_HEIGHT), note)
