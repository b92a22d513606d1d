"""LoRA adapters merged into the DiT's weights, switched between jobs with an exact restore.

A file is read (safetensors only) into a `LoraWeights`: for each linear layer it adapts, its
factors and its own scale (`pan2render.lora_plan` says which keys do what, from the header, and
checks them against the model). `MergedLoras` merges a list of (adapter, scale) into a model's
weights, ``W <- W + sum_i scale_i * s_i * (B_i @ A_i)`` computed in fp32 and rounded once to the
weight's dtype, with a copy of every weight it touched kept beside it; switching to another list
first writes those copies back, so the weights return bit for bit to the checkpoint's and a sweep
over scales builds up no drift. Merging rather than adding ``B(Ax)`` at run time: the forward then
costs what it costs without the adapter (docs/performance.md, "LoRA").

The parallel strategies share the plain model (`pan2render.parallel`), so merging into its
weights applies to every rank's forward; every rank merges the same list.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes
from torch import Tensor, nn

from ..lora_plan import LoraFileError, LoraPlan, Target, header_of_bytes, plan_lora, read_header

log = logging.getLogger(__name__)

__all__ = ["LoraDelta", "LoraFileError", "LoraWeights", "MergedLoras", "linear_shapes", "read_lora"]


@dataclass(frozen=True)
class LoraDelta:
    """What one adapter adds to one linear layer, before the job's scale: ``weight_scale * (up @
    down)`` (or ``weight_scale * diff``) on the weight, ``bias_scale * bias`` on the bias. Tensors
    as stored in the file (the merge computes in fp32)."""

    module: str
    down: Tensor | None  # A [rank, in]
    up: Tensor | None  # B [out, rank]
    diff: Tensor | None  # [out, in]
    bias: Tensor | None  # [out]
    weight_scale: float
    bias_scale: float

    @property
    def has_weight_delta(self) -> bool:
        return self.diff is not None or self.down is not None

    def weight_delta(self, device: torch.device) -> Tensor:
        """The weight's delta [out, in] in fp32 on ``device``."""
        if self.diff is not None:
            return self.diff.to(device, torch.float32) * self.weight_scale
        assert self.up is not None and self.down is not None, self.module
        return (self.up.to(device, torch.float32) @ self.down.to(device, torch.float32)) * self.weight_scale

    def bias_delta(self, device: torch.device) -> Tensor:
        """The bias's delta [out] in fp32 on ``device``."""
        assert self.bias is not None, self.module
        return self.bias.to(device, torch.float32) * self.bias_scale


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA file, read and checked against a model: its content digest and per-layer deltas."""

    name: str  # the file, for messages
    sha256: str
    plan: LoraPlan
    deltas: tuple[LoraDelta, ...]

    def to(self, device: str | torch.device) -> "LoraWeights":
        """The same adapter with its factors on ``device`` (a merge then copies nothing to it)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, deltas=tuple(replace(d, down=move(d.down), up=move(d.up), diff=move(d.diff),
                                                  bias=move(d.bias)) for d in self.deltas))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in self.deltas for t in (d.down, d.up, d.diff, d.bias) if t is not None)


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every ``nn.Linear`` of ``model``: module name -> weight shape (out, in)."""
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def read_lora(source: str | Path | bytes, *, linears: Mapping[str, tuple[int, int]],
              name: str | None = None) -> LoraWeights:
    """A LoRA file (a path, or its bytes as a worker receives them) checked against ``linears``
    (`linear_shapes` of the model). Never unpickles: a pickle or any non-safetensors file is a
    LoraFileError naming it, as is a key or shape that does not fit the model."""
    if isinstance(source, (str, Path)):
        name = name or str(source)
        data = _read_file(Path(source), name)
    else:
        data, name = source, name or "<bytes>"
    plan = plan_lora(header_of_bytes(data, display=name), linears, name=name)
    try:
        tensors = load_safetensors_bytes(data)
    except Exception as e:  # safetensors' own error types: truncated data, bad offsets
        raise LoraFileError(f"LoRA {name!r} cannot be read as safetensors ({e})") from e
    deltas = tuple(_delta(t, tensors) for t in plan.targets)
    if plan.dropped:
        log.warning("LoRA %s: %d diff key(s) left unread, as diffusers leaves them (e.g. %s)", name,
                    len(plan.dropped), plan.dropped[0])
    return LoraWeights(name=name, sha256=hashlib.sha256(data).hexdigest(), plan=plan, deltas=deltas)


def _read_file(path: Path, name: str) -> bytes:
    read_header(path, display=name)  # first: a pickle is refused before its bytes are read
    try:
        return path.read_bytes()
    except OSError as e:
        raise LoraFileError(f"LoRA {name!r} cannot be read: {e.strerror or e}") from e


def _delta(target: Target, tensors: Mapping[str, Tensor]) -> LoraDelta:
    alpha_over_rank = 1.0
    if target.alpha is not None:
        alpha_over_rank = float(tensors[target.alpha].reshape(())) / target.rank
    get = lambda key: None if key is None else tensors[key]  # noqa: E731
    return LoraDelta(module=target.module, down=get(target.down), up=get(target.up), diff=get(target.diff),
                     bias=get(target.bias), weight_scale=target.config_scale * alpha_over_rank,
                     bias_scale=target.config_scale)


# ------------------------------------------------------------------------------------------------
# Merging


AdapterKey = tuple[tuple[str, float], ...]  # (sha256, scale) per adapter, in order


class MergedLoras:
    """The adapters merged into one model's weights, and the originals of what they touched.

    ``backup_device``: where the copies of the touched weights live (None: beside each weight, the
    fastest restore; "cpu" saves the device memory, ~2 bytes a parameter touched in bf16)."""

    def __init__(self, model: nn.Module, *, backup_device: str | torch.device | None = None) -> None:
        self.model = model
        self.backup_device = None if backup_device is None else torch.device(backup_device)
        self._originals: dict[str, Tensor] = {}  # parameter name -> its checkpoint values
        self.active: AdapterKey = ()

    @property
    def restore_bytes(self) -> int:
        """Bytes the copies of the touched weights hold (on ``backup_device``)."""
        return sum(t.nbytes for t in self._originals.values())

    @staticmethod
    def key_of(adapters: Sequence[tuple[LoraWeights, float]]) -> AdapterKey:
        """What identifies a merged set: each adapter's digest and scale (scale 0 adapters left out:
        they change nothing)."""
        return tuple((w.sha256, float(s)) for w, s in adapters if s != 0)

    @torch.no_grad()
    def set(self, adapters: Sequence[tuple[LoraWeights, float]]) -> bool:
        """Merge ``adapters`` (each with its job scale) in place of the current set; a no-op when the
        set is the same. Returns whether the weights changed."""
        key = self.key_of(adapters)
        if key == self.active:
            return False
        params = dict(self.model.named_parameters())
        touched = self._touched(adapters, params)
        self._restore(keep=set(touched))
        self.active = ()  # until the merge below has completed
        for pname, parts in touched.items():
            param = params[pname]
            if pname not in self._originals:
                self._originals[pname] = self._copy(param)
            # One fp32 delta per parameter at a time ([out, in]: 176 MB for a 5B FFN linear), so
            # the merge needs memory for one layer, not the model.
            total = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            for delta, scale in parts:
                total.add_(delta(param.device), alpha=scale)
            param.copy_((param.float() + total).to(param.dtype))
        self.active = key
        return True

    def _copy(self, param: Tensor) -> Tensor:
        """A copy of ``param`` on the backup device; pinned on the host for a GPU weight, so the
        restore's copy back runs at the link's speed rather than through a pageable bounce."""
        device = self.backup_device or param.device
        pin = device.type == "cpu" and param.is_cuda
        return torch.empty(param.shape, dtype=param.dtype, device=device, pin_memory=pin).copy_(param.detach())

    @torch.no_grad()
    def clear(self) -> None:
        """The checkpoint's weights again, bit for bit."""
        self._restore(keep=set())
        self.active = ()

    def _restore(self, *, keep: set[str]) -> None:
        """Every touched weight back to its original; the copies of those in ``keep`` are kept (the
        next merge touches them again), the others freed."""
        params = dict(self.model.named_parameters())
        for pname in list(self._originals):
            params[pname].copy_(self._originals[pname])
            if pname not in keep:
                del self._originals[pname]

    @staticmethod
    def _touched(adapters: Sequence[tuple[LoraWeights, float]], params: Mapping[str, nn.Parameter],
                 ) -> dict[str, list[tuple[Callable[[torch.device], Tensor], float]]]:
        """Parameter name -> [(its fp32 delta on a device, made when called; the job scale)], in
        adapter order."""
        out: dict[str, list[tuple[Callable[[torch.device], Tensor], float]]] = {}
        for weights, scale in adapters:
            if scale == 0:
                continue
            for d in weights.deltas:
                for pname, delta in ((f"{d.module}.weight", d.weight_delta if d.has_weight_delta else None),
                                     (f"{d.module}.bias", d.bias_delta if d.bias is not None else None)):
                    if delta is None:
                        continue
                    if pname not in params:
                        raise LoraFileError(f"LoRA {weights.name!r} changes {pname!r}, which this model lacks "
                                            f"(it was checked against another model)")
                    out.setdefault(pname, []).append((delta, float(scale)))
        return out
