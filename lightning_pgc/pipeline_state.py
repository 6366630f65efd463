"""One rank's pipeline state at a checkpoint: its stale cache and the step its pipeline warmed up at.

Lightning writes a checkpoint from global rank 0 only, but every rank's stale cache differs (each holds other
partitions), so each rank writes its own :class:`PipelineState` next to the checkpoint, in
``<checkpoint>.pgc/rank{k}.pt`` (:func:`sidecar_path`). A resumed run that loads it continues at the same
version with the same cache contents; with the deterministic data and delay streams (both keyed by step) its
parameters then match an uninterrupted run's bitwise whenever the admitted sets match (docs/guide.md).

Pure data and checks: no Lightning, no ``torch.distributed``; the strategy does the file I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["FORMAT", "PipelineState", "dtype_name", "sidecar_dir", "sidecar_path", "sidecar_paths"]

#: Version of the sidecar layout; a file with another one is not used (warm start, with a warning).
FORMAT = 1


def sidecar_dir(checkpoint_path: str) -> str:
    """The folder holding the per-rank pipeline files of ``checkpoint_path``: ``<checkpoint>.pgc``."""
    return f"{checkpoint_path}.pgc"


def sidecar_path(checkpoint_path: str, rank: int) -> str:
    """Where ``rank`` writes its pipeline state for ``checkpoint_path``: ``<checkpoint>.pgc/rank{rank}.pt``."""
    return os.path.join(sidecar_dir(checkpoint_path), f"rank{int(rank)}.pt")


def sidecar_paths(checkpoint_path: str, rank: int) -> list[str]:
    """Where to look for ``rank``'s pipeline file when resuming from ``checkpoint_path``: next to it, then next to
    the file a symlink points to (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink)."""
    paths = [sidecar_path(checkpoint_path, rank)]
    if os.path.islink(checkpoint_path):
        paths.append(sidecar_path(os.path.realpath(checkpoint_path), rank))
    return paths


@dataclass(eq=False)  # entries hold tensors: compare fields and tensors explicitly
class PipelineState:
    """What one rank's pipeline needs to continue bitwise after a resume.

    ``entries`` maps each cached partition to ``(version, flat)``: the model version its gradient was computed
    at, and the cache slot (the flat gradient, then the loss slot; anything after ``grad_numel + 1`` is unused).
    The other fields identify the run the cache belongs to: a resume into a run that differs in any of them
    cannot reuse the cache (:meth:`mismatch`).
    """

    rank: int
    world_size: int
    scheme: str
    partitions: tuple[int, ...]
    seed: int
    grad_numel: int
    dtype: str
    global_step: int
    warm_start: int
    entries: dict[int, tuple[int, Tensor]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of ints, strings and tensors (``torch.load(weights_only=True)`` reads it back)."""
        return {
            "format": FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "scheme": self.scheme,
            "partitions": list(self.partitions),
            "seed": self.seed,
            "grad_numel": self.grad_numel,
            "dtype": self.dtype,
            "global_step": self.global_step,
            "warm_start": self.warm_start,
            "entries": {int(p): {"version": int(v), "flat": t} for p, (v, t) in self.entries.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> PipelineState:
        """Read :meth:`to_dict`'s form back.

        Raises:
            ValueError: not a pipeline file of this :data:`FORMAT`, or a malformed one.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a PGC pipeline file of format {FORMAT} (found {found!r})")
        try:
            entries = {int(p): (int(e["version"]), e["flat"]) for p, e in data["entries"].items()}
            state = cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                scheme=str(data["scheme"]),
                partitions=tuple(int(p) for p in data["partitions"]),
                seed=int(data["seed"]),
                grad_numel=int(data["grad_numel"]),
                dtype=str(data["dtype"]),
                global_step=int(data["global_step"]),
                warm_start=int(data["warm_start"]),
                entries=entries,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed PGC pipeline file ({type(err).__name__}: {err})") from err
        for p, (version, flat) in entries.items():
            if not isinstance(flat, Tensor) or flat.dim() != 1 or flat.numel() < state.grad_numel + 1:
                raise ValueError(
                    f"malformed PGC pipeline file: partition {p}'s entry is not a flat gradient of at "
                    f"least {state.grad_numel + 1} elements"
                )
            if p not in state.partitions or not 0 <= version < state.global_step:
                raise ValueError(
                    f"malformed PGC pipeline file: entry of partition {p} at version {version} (holds "
                    f"{list(state.partitions)}, saved at step {state.global_step})"
                )
        return state

    def mismatch(self, expected: PipelineState) -> Optional[str]:
        """Why this saved state cannot continue the run described by ``expected`` (whose ``entries`` and
        ``warm_start`` are ignored), or ``None`` if it can."""
        checks = (
            ("ranks", self.world_size, expected.world_size),
            ("rank", self.rank, expected.rank),
            ("scheme", self.scheme, expected.scheme),
            ("held partitions", self.partitions, expected.partitions),
            ("seed (partition split and data streams)", self.seed, expected.seed),
            ("gradient size (the model changed)", self.grad_numel, expected.grad_numel),
            ("payload dtype", self.dtype, expected.dtype),
            (
                "global step (this file belongs to another save of the checkpoint)",
                self.global_step,
                expected.global_step,
            ),
        )
        for what, saved, now in checks:
            if saved != now:
                return f"{what}: saved {saved!r}, now {now!r}"
        if self.warm_start > self.global_step:
            return f"warm start {self.warm_start} after the saved step {self.global_step}"
        return None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (how :class:`PipelineState` records the payload dtype)."""
    return str(dtype).removeprefix("torch.")
