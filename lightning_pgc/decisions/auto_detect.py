"""The two statistics ``scheme="auto"`` switches on: the evidence of a change and the rate of stalls (pure).

:class:`Evidence` is a one-sided cumulative sum per candidate arm (a CUSUM test): each version adds the saving the
candidate is predicted to make over the current arm, beyond the margin, in seconds, and the sum never goes below
zero (a version that argues the other way takes its amount off, down to zero). No version adds more than
:data:`MOST_PER_VERSION` of the threshold, so one version alone (a stall) never switches; a large persistent slowdown
of the same ranks crosses it in two versions (three where stalls were seen within the horizon:
:data:`MOST_WITH_STALLS`), a marginal one in many or never.

:class:`StallRate` treats what a change-point test must not react to: a rank whose own time at a version is more
than :data:`STALL_RATIO` times its level (the median of its reported times over the :data:`REACH` versions either
side) stalled there. A stall is over before a switch could help, so it is counted as a rate: what it added to
each order statistic of the version's times, summed over the last ``horizon`` versions and divided by
``horizon``, is the expected extra time per version that each arm pays at that rate
(:meth:`StallRate.per_version`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["MOST_PER_VERSION", "MOST_WITH_STALLS", "REACH", "STALL_RATIO", "Evidence", "StallRate", "kth"]

#: the largest share of the threshold one version's saving adds to the evidence (below 1: no single version switches)
MOST_PER_VERSION = 0.6
#: the same where the horizon holds stalls: two slow versions in a row may then be two stalls, so it takes three
MOST_WITH_STALLS = 0.4
#: a rank's time more than this many times its level (its median over the neighbouring versions) is a stall
STALL_RATIO = 3.0
#: versions either side of a version whose reported times give a rank's level there (a version is judged once
#: this many later versions closed; a slowness lasting more than this many versions is a level, not a stall)
REACH = 4


def kth(row: Sequence[float], k: int) -> float:
    """The ``k``-th smallest value of ``row`` (``k`` from 1)."""
    return sorted(row)[k - 1]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class StallRate:
    """Per version, the time stalls added to each order statistic ``k`` of ``orders``; their sum over the last
    ``horizon`` versions.

    :meth:`judge` a version from the reported times around it (``times``: version -> per-rank seconds, None where a
    rank sent no code); judging it again (a late code arrived) replaces its entry.
    """

    def __init__(self, n: int, orders: Sequence[int], horizon: int) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon!r}")
        self.n, self.orders, self.horizon = n, sorted(set(orders)), int(horizon)
        self.excess: dict[int, dict[int, float]] = {}  # version -> {k: seconds} (versions with a stall only)
        self.stalled: dict[int, list[int]] = {}  # version -> the ranks that stalled there
        self.judged = -1  # the newest version judged

    def judge(self, times: dict[int, list[Optional[float]]], version: int) -> None:
        """Judge ``version`` from the reported times of the versions within :data:`REACH` of it."""
        row = times.get(version)
        self.excess.pop(version, None)
        self.stalled.pop(version, None)
        if row is None:
            return
        actual, level = [], []
        for r in range(self.n):
            near = [t for u in range(version - REACH, version + REACH + 1) for t in [_at(times, u, r)] if t is not None]
            typical = _median(near) if near else 0.0
            own = row[r]
            actual.append(typical if own is None else own)
            level.append(typical if own is not None and typical > 0 and own > STALL_RATIO * typical else actual[-1])
        ranks = [r for r in range(self.n) if actual[r] != level[r]]
        if ranks:
            self.stalled[version] = ranks
            self.excess[version] = {k: kth(actual, k) - kth(level, k) for k in self.orders}

    def forget_before(self, version: int) -> None:
        """Drop the versions older than ``version``."""
        for v in [v for v in self.excess if v < version]:
            del self.excess[v]
            self.stalled.pop(v, None)

    def per_version(self, k: int) -> float:
        """The expected seconds stalls add to the ``k``-th fastest time of a version, at the rate of the last
        ``horizon`` versions (a run shorter than the horizon counts the rest of it as free of stalls)."""
        return sum(e.get(k, 0.0) for e in self.excess.values()) / self.horizon

    def count(self) -> int:
        """Stalls within the horizon."""
        return sum(len(r) for r in self.stalled.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "excess": {int(v): {int(k): float(s) for k, s in e.items()} for v, e in self.excess.items()},
            "stalled": {int(v): list(r) for v, r in self.stalled.items()},
            "judged": self.judged,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.excess = {int(v): {int(k): float(s) for k, s in e.items()} for v, e in state.get("excess", {}).items()}
        self.stalled = {int(v): [int(r) for r in rs] for v, rs in state.get("stalled", {}).items()}
        self.judged = int(state.get("judged", -1))


def _at(times: dict[int, list[Optional[float]]], version: int, rank: int) -> Optional[float]:
    row = times.get(version)
    return None if row is None else row[rank]


class Evidence:
    """The cumulative predicted saving of each candidate over the current arm (see the module docstring).

    Args:
        threshold: the sum that switches, in versions of the candidate's own predicted step time.
        margin: the least relative gain a version must predict to add to the sum (``(1 - margin)`` of the current
            arm's cost, less the candidate's).
    """

    def __init__(self, threshold: float, margin: float) -> None:
        self.threshold, self.margin = float(threshold), float(margin)
        self.sums: dict[Any, float] = {}
        self.since: dict[Any, int] = {}  # the version each positive run began
        self.who: dict[Any, tuple[int, ...]] = {}  # the ranks left out at the run's last capped version
        self.most = MOST_PER_VERSION  # the share of the threshold one version adds at most

    def add(
        self, arm: Any, version: int, current: float, cost: float, step_s: float, who: tuple[int, ...] = ()
    ) -> bool:
        """One version's evidence for ``arm`` (predicted ``cost`` per unit of progress against the current arm's
        ``current``; ``step_s``: its predicted seconds per version; ``who``: the ranks it would leave out at this
        version): whether its sum reached the threshold. A version capped at :attr:`most` that leaves
        out other ranks than the run's last capped one starts the run again: stalls of different ranks in
        consecutive versions are no onset."""
        bar = self.threshold * step_s
        saving = (1.0 - self.margin) * current - cost
        before = self.sums.get(arm, 0.0)
        if saving >= self.most * bar > 0:
            if self.who.get(arm, who) != who:
                before = 0.0
                self.since.pop(arm, None)
            self.who[arm] = who
        total = max(0.0, before + min(saving, self.most * bar))
        if total > 0 and arm not in self.since:
            self.since[arm] = version
        elif total <= 0:
            self.since.pop(arm, None)
            self.who.pop(arm, None)
        self.sums[arm] = total
        return total > 0 and total >= bar

    def clear(self) -> None:
        self.sums, self.since, self.who = {}, {}, {}
