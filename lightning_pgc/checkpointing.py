"""PipelineCheckpoints: each rank's stale cache saved next to Lightning's checkpoint and reloaded on resume.

:class:`~lightning_pgc.PGCStrategy` owns one and delegates its ``save_checkpoint``, ``remove_checkpoint`` and
``load_checkpoint`` overrides to it; the file format is :mod:`lightning_pgc.pipeline_state`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from lightning_pgc.pipeline_state import PipelineState, dtype_name, sidecar_dir, sidecar_path, sidecar_paths

if TYPE_CHECKING:
    from lightning_pgc.strategy import PGCStrategy

# The strategy's logger: these messages were always logged (and filtered by users) under that name.
log = logging.getLogger("lightning_pgc.strategy")


class PipelineCheckpoints:
    """The per-rank pipeline files of one :class:`~lightning_pgc.PGCStrategy` (``<checkpoint>.pgc/rank{k}.pt``), so
    that a resumed fit continues the pipeline instead of warming it up again.

    Call order: :meth:`remember` when a checkpoint is loaded (before ``setup``), :meth:`resumed` then :meth:`fill`
    once in ``on_train_start``; :meth:`save` and :meth:`remove` whenever Lightning saves or drops a checkpoint.
    """

    def __init__(self, strategy: "PGCStrategy") -> None:
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
            grad_numel=st._grad_numel,
            dtype=dtype_name(st._payload_dtype),
            global_step=st.lightning_module.trainer.global_step,
            warm_start=st._warm_start_step(),
            entries=cache.entries(),
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
            grad_numel=st._grad_numel,
            dtype=dtype_name(st._payload_dtype),
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
            if st.warmup == "full"
            else "the cache refills over the next c steps"
        )
        log.warning(
            "PGC rank %d: resuming at step %d without the stale cache: %s. The pipeline warms up again "
            "(warmup=%r: %s), so this run does not continue the interrupted one bitwise.",
            st.global_rank,
            step,
            reasons[0],
            st.warmup,
            how,
        )
        return None

    def fill(self, state: PipelineState) -> None:
        """Copy the saved entries into this rank's cache slots (after the layout and the slots are reset)."""
        st = self.strategy
        assert st.cache is not None
        used = st._grad_numel + 1
        for partition, (version, flat) in state.entries.items():
            slot = st._slot(partition)
            slot[:used].copy_(flat[:used])
            st.cache.put(partition, slot, version, copy=False)
