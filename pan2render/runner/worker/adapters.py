"""The LoRA files a worker was sent, read onto its device by digest, and the job's set merged into
the DiT before each sampling (none: the previous job's are unmerged). A bounded few are kept, least
recently used dropped first; the sampling's reply says which, so the driver sends again what was
dropped."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pan2render.runner.protocol import artifacts
from pan2render.runner.protocol.failures import JobInputError
from pan2render.runner.protocol.messages import Adapter

# Enough for a sweep over a few adapters; each is tens to hundreds of MB on the device.
ADAPTERS_KEPT = 4


class AdapterCache:
    def __init__(self) -> None:
        self._read: OrderedDict[str, Any] = OrderedDict()  # digest -> pipeline.read_lora's weights

    def set(self, pipe: Any, adapters: tuple[Adapter, ...]) -> None:
        weights = []
        for a in adapters:
            if a.data is not None and a.sha256 not in self._read:
                if artifacts.sha256_bytes(a.data) != a.sha256:
                    raise JobInputError(f"LoRA {a.name}: its bytes do not match the digest the job id was made with")
                self._read[a.sha256] = pipe.read_lora(a.data, name=a.name)
            held = self._read.get(a.sha256)
            if held is None:
                raise RuntimeError(f"LoRA {a.name} ({a.sha256[:12]}) was neither sent nor kept on this worker")
            self._read.move_to_end(a.sha256)
            weights.append((held, a.scale))
        pipe.set_loras(weights)
        keep = {a.sha256 for a in adapters}
        while len(self._read) > max(ADAPTERS_KEPT, len(keep)):
            del self._read[next(d for d in self._read if d not in keep)]

    def held(self) -> tuple[str, ...]:
        return tuple(self._read)

    def clear(self) -> None:
        """Its model was dropped: what was read for it goes too."""
        self._read.clear()
