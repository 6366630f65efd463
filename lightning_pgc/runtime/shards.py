"""How the flat payload is cut into shards and who owns each shard (pure bookkeeping, no communication).

The payload of one rank is ``[gradient | loss | buffers]``: the first ``coded_numel`` elements are decoded with
the scheme's weights, the rest (BatchNorm statistics and other buffers) are averaged over the admitted ranks.
It is cut into ``num_shards`` equal, contiguous shards (the last one zero-padded). Shard ``j`` is owned by rank
``j`` at first; an owner can be reassigned from a given version on (a dead or frozen owner, a later issue), so
ownership is a function of ``(shard, version)``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


ALIGN = 8  # elements: shards are padded to a multiple of this (32 bytes in float32)


def choose_num_shards(payload_bytes: int, world_size: int, shard_bytes: int) -> int:
    """Shards for a payload: one per ``shard_bytes`` (at least one, at most one per rank).

    Small payloads take one shard (a star through the leader: two messages per rank and step), because for them
    per-message latency, not bandwidth, sets the step time; large ones take ``world_size`` shards, so every rank
    moves ``O(payload)`` bytes per step, as a ring all-reduce does.
    """
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    return max(1, min(world_size, math.ceil(payload_bytes / shard_bytes)))


@dataclass(frozen=True)
class ShardLayout:
    """``numel`` payload elements (the first ``coded_numel`` decoded, the rest averaged) in ``num_shards`` shards."""

    numel: int
    coded_numel: int
    num_shards: int

    def __post_init__(self) -> None:
        if self.numel < 1 or not 0 <= self.coded_numel <= self.numel:
            raise ValueError(f"need 0 <= coded_numel <= numel and numel >= 1, got {self.coded_numel}, {self.numel}")
        if not 1 <= self.num_shards <= self.numel:
            raise ValueError(f"need 1 <= num_shards <= numel, got {self.num_shards} for numel {self.numel}")

    @property
    def shard_numel(self) -> int:
        """Elements per shard (all shards have this size on the wire; the last is zero-padded). A multiple of
        ``ALIGN`` elements, so every row of a message matrix starts 8-byte aligned (its int64 header is a view)."""
        return ALIGN * math.ceil(self.numel / (self.num_shards * ALIGN))

    @property
    def padded_numel(self) -> int:
        return self.num_shards * self.shard_numel

    def bounds(self, shard: int) -> tuple[int, int]:
        """Global ``[start, end)`` of ``shard`` inside the padded payload."""
        size = self.shard_numel
        return shard * size, (shard + 1) * size

    def coded_end(self, shard: int) -> int:
        """Local index where the decoded region of ``shard`` ends (the averaged region starts there)."""
        return min(max(self.coded_numel - shard * self.shard_numel, 0), self.shard_numel)

    def plain_end(self, shard: int) -> int:
        """Local index where the real payload of ``shard`` ends (padding starts there)."""
        return min(max(self.numel - shard * self.shard_numel, 0), self.shard_numel)


class OwnerMap:
    """Owner of every shard, by version: ``owner(j, v)``; ``reassign(j, rank, from_version)`` moves a shard.

    Thread-safe. Reassignments of one shard must come in increasing ``from_version`` order.
    """

    def __init__(self, num_shards: int, world_size: int) -> None:
        if not 1 <= num_shards <= world_size:
            raise ValueError(f"need 1 <= num_shards <= world_size, got {num_shards} shards for {world_size} ranks")
        self.num_shards = num_shards
        self.world_size = world_size
        self._changes: list[list[tuple[int, int]]] = [[(0, j)] for j in range(num_shards)]  # (from_version, rank)
        self._lock = threading.Lock()

    def owner(self, shard: int, version: int) -> int:
        with self._lock:
            rank = self._changes[shard][0][1]
            for start, r in self._changes[shard]:
                if start > version:
                    break
                rank = r
            return rank

    def shards_of(self, rank: int, version: int) -> list[int]:
        """Shards ``rank`` owns at ``version``."""
        return [j for j in range(self.num_shards) if self.owner(j, version) == rank]

    def owners(self, version: int) -> set[int]:
        return {self.owner(j, version) for j in range(self.num_shards)}

    def reassign(self, shard: int, rank: int, from_version: int) -> None:
        """``rank`` owns ``shard`` from ``from_version`` on.

        Raises:
            ValueError: unknown shard or rank, or a version older than the shard's last reassignment.
        """
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"no shard {shard}; there are {self.num_shards}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"no rank {rank}; world size is {self.world_size}")
        with self._lock:
            last = self._changes[shard][-1][0]
            if from_version < last:
                raise ValueError(f"shard {shard} was already reassigned from version {last} > {from_version}")
            self._changes[shard].append((from_version, rank))
