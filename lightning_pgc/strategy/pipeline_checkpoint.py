"""Pipeline checkpoints: each rank's stale cache saved next to Lightning's checkpoint and reloaded on resume.

Lightning writes a checkpoint from global rank 0 only, but every rank's stale cache differs (each holds other
partitions), so each rank writes its own :class:`PipelineState` next to the checkpoint, in
``<checkpoint>.pgc/rank{k}.pt`` (:func:`sidecar_path`). A resumed run that loads it continues at the same
version with the same cache contents; with the deterministic data and delay streams (both keyed by step) its
parameters then match an uninterrupted run's bitwise whenever the admitted sets match (docs/guide.md).

:class:`PipelineState` and the path helpers are pure data and checks (no Lightning, no ``torch.distributed``);
:class:`PipelineCheckpoints` does the file I/O: :class:`~lightning_pgc.PGCStrategy` owns one and delegates its
``save_checkpoint``, ``remove_checkpoint`` and ``load_checkpoint`` overrides to it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import Tensor

import lightning.pytorch as pl
from lightning_pgc.codes import Scheme, StaleCache
from lightning_pgc.strategy.gradients import Gradients
from lightning_pgc.strategy.options import CodingOptions

__all__ = [
    "FORMAT",
    "PipelineCheckpoints",
    "PipelineState",
    "dtype_name",
    "sidecar_dir",
    "sidecar_path",
    "sidecar_paths",
]

# The strategy's logger: these messages were always logged (and filtered by users) under that name.
log = logging.getLogger("lightning_pgc.strategy")

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


class PipelineCheckpointsHost(Protocol):
    """What :class:`PipelineCheckpoints` uses of its strategy (:class:`~lightning_pgc.PGCStrategy`)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def seed(self) -> int: ...

    @property
    def coding(self) -> CodingOptions: ...

    @property
    def scheme(self) -> Optional[Scheme]: ...

    @property
    def cache(self) -> Optional[StaleCache]: ...

    @property
    def gradients(self) -> Gradients: ...

    @property
    def lightning_module(self) -> Optional[pl.LightningModule]: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    def warm_start_step(self) -> int: ...


class PipelineCheckpoints:
    """The per-rank pipeline files of one :class:`~lightning_pgc.PGCStrategy` (``<checkpoint>.pgc/rank{k}.pt``), so
    that a resumed fit continues the pipeline instead of warming it up again.

    Call order: :meth:`remember` when a checkpoint is loaded (before ``setup``), :meth:`resumed` then :meth:`fill`
    once in ``on_train_start``; :meth:`save` and :meth:`remove` whenever Lightning saves or drops a checkpoint.
    """

    def __init__(self, strategy: PipelineCheckpointsHost) -> None:
        self.strategy = strategy
        self.resume_from: Optional[tuple[str, Any]] = None  # (checkpoint path, its "pgc" entry) until fit starts

    def state(self) -> Optional[PipelineState]:
        """This rank's stale cache and warm-start step now; tensors are not copied. ``None`` outside fit, and for
        schemes without a pipeline (their cache holds only the current step's gradients)."""
        st = self.strategy
        cache, scheme = st.cache, st.scheme
        if cache is None or scheme is None or not scheme.pipelined or st.lightning_module is None:
            return None
        return PipelineState(
            rank=st.global_rank,
            world_size=st.world_size,
            scheme=scheme.name,
            partitions=cache.partitions,
            seed=st.seed,
            grad_numel=st.gradients.grad_numel,
            dtype=dtype_name(st.gradients.dtype),
            global_step=st.lightning_module.trainer.global_step,
            warm_start=st.warm_start_step(),
            entries={p: (v, st.gradients.flat(e)) for p, (v, e) in cache.entries().items()},  # flat for the file
        )

    def entry(self, state: Optional[PipelineState], checkpoint: dict[str, Any], filepath: Any) -> None:
        """Rank 0: add the ``pgc`` entry that tells a resume where the pipeline files are."""
        if state is not None and self.strategy.is_global_zero:
            checkpoint["pgc"] = {
                "world_size": state.world_size,
                "scheme": state.scheme,
                "global_step": state.global_step,
                "warm_start": state.warm_start,
                "pipeline": os.path.basename(sidecar_dir(str(filepath))),
            }

    def save(self, state: Optional[PipelineState], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this rank's pipeline file (every rank, after Lightning's checkpoint; nothing if ``state`` is None)."""
        if state is not None:
            self.strategy.checkpoint_io.save_checkpoint(
                state.to_dict(), sidecar_path(str(filepath), self.strategy.global_rank), storage_options=storage_options
            )

    def remove(self, filepath: Any) -> None:
        """Remove this rank's pipeline file; the folder goes with the last rank's."""
        path = sidecar_path(str(filepath), self.strategy.global_rank)
        self.strategy.checkpoint_io.remove_checkpoint(path)
        try:
            os.rmdir(sidecar_dir(str(filepath)))
        except OSError:  # other ranks' files still there (or not a local path): the last rank removes it
            pass

    def remember(self, checkpoint_path: Any, checkpoint: dict[str, Any]) -> None:
        """Note the checkpoint a fit may resume from (its path and ``pgc`` entry)."""
        self.resume_from = (str(checkpoint_path), checkpoint.get("pgc"))

    def resumed(self, step: int) -> Optional[PipelineState]:
        """The pipeline state this rank saved with the checkpoint being resumed from, if it fits this run; otherwise
        ``None`` with a warning that names the reason (the pipeline then warms up again at ``step``). Schemes
        without a pipeline need nothing: ``None``, silently."""
        st = self.strategy
        assert st.scheme is not None and st.cache is not None
        if self.resume_from is None or not st.scheme.pipelined:
            self.resume_from = None
            return None
        checkpoint_path, info = self.resume_from
        self.resume_from = None
        expected = PipelineState(
            rank=st.global_rank,
            world_size=st.world_size,
            scheme=st.scheme.name,
            partitions=st.cache.partitions,
            seed=st.seed,
            grad_numel=st.gradients.grad_numel,
            dtype=dtype_name(st.gradients.dtype),
            global_step=step,
            warm_start=step,
        )
        reasons = []
        for path in sidecar_paths(checkpoint_path, st.global_rank):  # next to it, then next to a symlink's target
            try:
                saved = PipelineState.from_dict(st.checkpoint_io.load_checkpoint(path, weights_only=True))
            except FileNotFoundError:
                reasons.append(
                    f"{path} is missing (copy the .pgc folder along with the checkpoint)"
                    if info is not None
                    else "the checkpoint has no PGC pipeline state (saved by another strategy or scheme, "
                    "or after fit ended)"
                )
                continue
            except Exception as err:  # an unreadable file must not stop the resume: warm up instead, loudly
                reasons.append(f"{path} could not be read ({type(err).__name__}: {err})")
                continue
            mismatch = saved.mismatch(expected)
            if mismatch is None:
                log.info(
                    "PGC rank %d: resumed the stale cache at step %d (%d entries)",
                    st.global_rank,
                    step,
                    len(saved.entries),
                )
                return saved
            reasons.append(f"{path} is from another run ({mismatch})")
        how = (
            "every held partition is evaluated at that step"
            if st.coding.warmup == "full"
            else "the cache refills over the next c steps"
        )
        log.warning(
            "PGC rank %d: resuming at step %d without the stale cache: %s. The pipeline warms up again "
            "(coding.warmup=%r: %s), so this run does not continue the interrupted one bitwise.",
            st.global_rank,
            step,
            reasons[0],
            st.coding.warmup,
            how,
        )
        return None

    def fill(self, state: PipelineState) -> None:
        """Put the saved entries into this rank's cache (after the layout is reset), on the model's device."""
        st = self.strategy
        assert st.cache is not None
        for partition, (version, flat) in state.entries.items():
            st.cache.put(partition, st.gradients.entry_of(flat[: st.gradients.grad_numel + 1]), version, copy=False)
