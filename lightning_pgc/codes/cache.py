"""Per-rank cache of the newest gradient of each held partition (the PGC pipeline state).

A pipelined rank evaluates one partition per step and re-uses its other
``c-1`` cached partition gradients. Entries older than ``max_age - 1`` steps
are not valid (bounded staleness); memory is one gradient per held partition.

An entry is a tensor, or any object with an ``nbytes`` (e.g. the per-parameter gradients backward produced, kept
without a copy: :class:`~lightning_pgc.strategy.gradients.PartitionGradient`).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor

__all__ = ["StaleCache"]


class StaleCache:
    """Newest gradient and its model version for each held partition; valid while ``step - version < max_age``.

    ``max_age=None`` means unbounded (every stored entry stays valid).
    """

    def __init__(self, partitions: Sequence[int], max_age: int | None) -> None:
        parts = tuple(int(p) for p in partitions)
        if not parts:
            raise ValueError("StaleCache needs at least one held partition")
        if len(set(parts)) != len(parts):
            raise ValueError(f"StaleCache partitions must be distinct, got {parts}")
        if max_age is not None and (isinstance(max_age, bool) or int(max_age) != max_age or max_age < 1):
            raise ValueError(f"max_age must be an int >= 1 (or None for unbounded), got {max_age!r}")
        self.partitions: tuple[int, ...] = parts
        self.max_age: int | None = None if max_age is None else int(max_age)
        self._grads: dict[int, Any] = {}
        self._versions: dict[int, int] = {}

    def put(self, partition: int, grad: Any, version: int, *, copy: bool = True) -> None:
        """Store ``grad`` as the newest gradient of ``partition``, computed at model ``version``.

        Replaces the previous entry (one per partition). With ``copy=True``
        (default, tensors only) the cache keeps its own detached copy, so later in-place changes
        by the caller (e.g. zeroed ``.grad``) cannot corrupt it; with ``copy=False`` it keeps ``grad`` itself (a
        tensor, or an object with ``nbytes``), which the caller must not change.
        """
        if partition not in self.partitions:
            raise ValueError(f"partition {partition!r} is not held by this rank (holds {list(self.partitions)})")
        if not isinstance(grad, Tensor) and (copy or not hasattr(grad, "nbytes")):
            raise ValueError(
                f"grad must be a torch.Tensor (or, with copy=False, an object with nbytes), got {type(grad).__name__}"
            )
        if isinstance(version, bool) or int(version) != version or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        version = int(version)
        old = self._versions.get(partition)
        if old is not None and version < old:
            raise ValueError(
                f"partition {partition}: refusing version {version} older than the cached version {old} "
                "(the cache keeps the newest gradient)"
            )
        stored = grad.detach() if isinstance(grad, Tensor) else grad
        if copy:
            stored = stored.clone()
        self._grads.pop(partition, None)  # free the old tensor before keeping the new one
        self._grads[partition] = stored
        self._versions[partition] = version

    def _age(self, partition: int, step: int) -> int:
        age = step - self._versions[partition]
        if age < 0:
            raise ValueError(
                f"partition {partition} is cached at version {self._versions[partition]}, newer than step {step}"
            )
        return age

    def _is_valid(self, partition: int, step: int) -> bool:
        return self.max_age is None or self._age(partition, step) < self.max_age

    def valid(self, step: int) -> dict[int, Any]:
        """Entries usable at ``step`` (``step - version < max_age``), in held order. Tensors are not copied."""
        return {p: self._grads[p] for p in self.partitions if p in self._grads and self._is_valid(p, step)}

    def versions(self) -> dict[int, int]:
        """Model version of every stored entry (valid or not), in held order."""
        return {p: self._versions[p] for p in self.partitions if p in self._versions}

    def entries(self) -> dict[int, tuple[int, Any]]:
        """Every stored entry (valid or not) as ``partition -> (version, tensor)``, in held order; not copied
        (what a checkpoint saves)."""
        return {p: (self._versions[p], self._grads[p]) for p in self.partitions if p in self._grads}

    def ages(self, step: int) -> dict[int, int]:
        """``step - version`` of the entries valid at ``step``, in held order."""
        return {p: self._age(p, step) for p in self.partitions if p in self._grads and self._is_valid(p, step)}

    def evict(self, step: int) -> tuple[int, ...]:
        """Drop entries no longer valid at ``step`` (frees their memory); returns the dropped partitions."""
        dropped = tuple(p for p in self.partitions if p in self._grads and not self._is_valid(p, step))
        for p in dropped:
            del self._grads[p]
            del self._versions[p]
        return dropped

    def discard(self, partition: int) -> None:
        """Forget the entry of ``partition`` if any (e.g. a non-finite gradient must not enter later codes)."""
        self._grads.pop(partition, None)
        self._versions.pop(partition, None)

    def clear(self) -> None:
        """Forget every entry (e.g. on resume: the pipeline restarts empty)."""
        self._grads.clear()
        self._versions.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by cached tensors (at most one per held partition)."""
        return sum(
            t.numel() * t.element_size() if isinstance(t, Tensor) else int(t.nbytes) for t in self._grads.values()
        )

    def __len__(self) -> int:
        return len(self._grads)

    def __contains__(self, partition: object) -> bool:
        return partition in self._grads

    def __repr__(self) -> str:
        return (
            f"StaleCache(partitions={list(self.partitions)}, max_age={self.max_age}, "
            f"versions={self.versions()}, nbytes={self.nbytes})"
        )
