"""Data placements: which partitions each rank holds (FR, CR, or just its own).

A placement is pure bookkeeping: ``n`` ranks, ``n`` partitions, ``c`` copies of
each partition. Schemes (``schemes.py``) combine a placement with an
evaluation schedule, an encoder and a decoder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = [
    "Placement",
    "OwnPlacement",
    "FRPlacement",
    "CRPlacement",
    "fr_suggestions",
]


class Placement(ABC):
    """Which partitions each of ``n`` ranks holds, with ``c`` copies per partition."""

    kind: str = ""

    def __init__(self, n: int, c: int) -> None:
        if n < 1 or c < 1 or c > n:
            raise ValueError(f"placement needs 1 <= c <= n, got n={n}, c={c}")
        self.n: int = n
        self.c: int = c

    def check_worker(self, worker: int) -> int:
        """Return ``worker`` as int, or raise if it is not a rank in ``range(n)``."""
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < self.n:
            raise ValueError(f"worker must be an int rank in range({self.n}), got {worker!r}")
        return worker

    def check_partition(self, partition: int) -> int:
        """Return ``partition`` as int, or raise if it is not in ``range(n)``."""
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < self.n:
            raise ValueError(f"partition must be an int in range({self.n}), got {partition!r}")
        return partition

    @abstractmethod
    def partitions(self, worker: int) -> tuple[int, ...]:
        """Partitions held by ``worker``, in the order its rotation visits them."""

    def holders(self, partition: int) -> tuple[int, ...]:
        """Ranks holding ``partition`` (ascending); there are exactly ``c`` of them."""
        self.check_partition(partition)
        return tuple(k for k in range(self.n) if partition in self.partitions(k))

    def matrix(self) -> list[list[int]]:
        """0/1 support matrix S[k][j] = 1 iff rank k holds partition j."""
        rows = []
        for k in range(self.n):
            held = set(self.partitions(k))
            rows.append([1 if j in held else 0 for j in range(self.n)])
        return rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, c={self.c})"


class OwnPlacement(Placement):
    """No replication: rank ``k`` holds only partition ``k`` (dgd, ignore)."""

    kind = "own"

    def __init__(self, n: int) -> None:
        super().__init__(n, 1)

    def partitions(self, worker: int) -> tuple[int, ...]:
        return (self.check_worker(worker),)

    def holders(self, partition: int) -> tuple[int, ...]:
        return (self.check_partition(partition),)


class FRPlacement(Placement):
    """Fractional repetition: ``n/c`` groups of ``c`` ranks; a group's ranks hold the same ``c`` partitions."""

    kind = "fr"

    def __init__(self, n: int, c: int) -> None:
        super().__init__(n, c)
        if n % c != 0:
            raise ValueError(f"fractional repetition needs c | n, got n={n}, c={c}")
        self.num_groups: int = n // c

    def group(self, worker: int) -> int:
        """Group index of ``worker`` (``worker // c``)."""
        return self.check_worker(worker) // self.c

    def group_members(self, group: int) -> tuple[int, ...]:
        """Ranks of ``group``; they also are the partitions that group holds."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group must be in range({self.num_groups}), got {group!r}")
        return tuple(range(group * self.c, group * self.c + self.c))

    def partitions(self, worker: int) -> tuple[int, ...]:
        return self.group_members(self.group(worker))

    def holders(self, partition: int) -> tuple[int, ...]:
        return self.group_members(self.check_partition(partition) // self.c)


class CRPlacement(Placement):
    """Cyclic repetition: rank ``k`` holds ``{k, k+1, ..., k+c-1} mod n``."""

    kind = "cr"

    def partitions(self, worker: int) -> tuple[int, ...]:
        k = self.check_worker(worker)
        return tuple((k + i) % self.n for i in range(self.c))

    def holders(self, partition: int) -> tuple[int, ...]:
        j = self.check_partition(partition)
        return tuple(sorted((j - i) % self.n for i in range(self.c)))


def fr_suggestions(n: int, s: int) -> str:
    """Human hint for an FR config where ``c = s+1`` does not divide ``n``: nearby valid ``s`` and ``n``."""
    c = s + 1
    valid_s = [d - 1 for d in range(1, n + 1) if n % d == 0]
    lower_s = [v for v in valid_s if v < s]
    upper_s = [v for v in valid_s if v > s]
    parts = []
    near_s = ([max(lower_s)] if lower_s else []) + ([min(upper_s)] if upper_s else [])
    if near_s:
        parts.append("s=" + " or s=".join(str(v) for v in near_s) + f" with n={n}")
    lo_n = (n // c) * c
    hi_n = lo_n + c
    near_n = [m for m in (lo_n, hi_n) if m >= max(2, c + 0) and m > s]
    if near_n:
        parts.append("n=" + " or n=".join(str(m) for m in near_n) + f" with s={s}")
    return "; ".join(parts)
