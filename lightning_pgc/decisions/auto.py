"""The choice of ``scheme="auto"``: which arm (scheme and ``s``) to run, from the step times the leader measures.

Pure decisions (no Lightning, no torch.distributed, no I/O but reading the shipped factor table). The leader
(:class:`~lightning_pgc.decisions.auto_leader.AutoLeader`) feeds the rule every rank's own compute time per version
(what each code's announcement says the rank spent between applying its previous aggregate and sending this code,
so waiting is not counted) and the measured time of the all-reduce. After each closed version :class:`AutoRule`
predicts, for each candidate arm (:class:`AutoCandidate`), its time per unit of training progress

    cost(arm) = (step(arm) + stalls(arm)) * factor(arm),  step(arm) = (n - s)-th fastest own time + all-reduce

from that version's times (a rank that sent no code for it counts with its latest time); ``stalls`` is what rare
stalls add to that order statistic per version at the rate of the last ``horizon`` versions, and ``factor`` the
arm's versions-to-target relative to ``dgd``, read from the table derived from the emulated map
(:class:`FactorTable`, ``lightning_pgc/auto_factors.json``, ``benchmarks/auto_table.py``).

The change-point test (:class:`~lightning_pgc.decisions.auto_detect.Evidence`): every version adds, for each other
candidate, its predicted saving ``(1 - margin) * cost(current) - cost(candidate)`` in seconds to that candidate's
evidence, which never goes below zero, and no version adds more than 60 % of the threshold (40 % once stalls were
seen; a capped version that leaves out other ranks than the last one restarts the evidence); a candidate whose
evidence reaches ``threshold`` times its predicted step time is switched to, and every evidence starts again from
zero. A slowdown the table says pays well switches in two versions, a marginal one in many or never; the end of a
slowness switches back the same way. Stalls (:class:`~lightning_pgc.decisions.auto_detect.StallRate`) are judged
once the versions after them are known and counted as a rate, never as an onset.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional, Sequence

from lightning_pgc.decisions.auto_detect import MOST_PER_VERSION, MOST_WITH_STALLS, REACH, Evidence, StallRate, kth

__all__ = [
    "ARM_CODES",
    "AutoCandidate",
    "AutoRule",
    "Decision",
    "FactorTable",
    "StepWindow",
    "arm_from_code",
    "candidates",
]

#: ``pgc/auto_arm``: the metric's value of each scheme an arm may run (``pgc/auto_s`` carries its ``s``).
ARM_CODES: dict[str, int] = {"dgd": 0, "ignore": 1, "pgc_cr": 2, "pgc_fr": 3, "gc_cr": 4, "gc_fr": 5}

#: Versions of per-rank times the rule keeps (a code later than this is not counted).
RECENT = 64

#: The table file shipped in the package (written by ``benchmarks/auto_table.py``).
TABLE_FILE = "auto_factors.json"

_STRATEGY = {"dgd": "ddp", "ignore": "ignore_stragglers"}  # how the emulated map names the arms


@dataclass(frozen=True, order=True)
class AutoCandidate:
    """One arm ``scheme="auto"`` may run: a scheme of :mod:`lightning_pgc.codes` and its ``s``."""

    scheme: str
    s: int

    def __post_init__(self) -> None:
        if self.scheme not in ARM_CODES:
            raise ValueError(f"unknown arm scheme {self.scheme!r}; valid: {', '.join(ARM_CODES)}")
        if (self.scheme == "dgd") != (self.s == 0) or self.s < 0:
            raise ValueError(f"arm {self.scheme!r} with s={self.s}: dgd has s = 0, every other arm s >= 1")

    @property
    def label(self) -> str:
        """How logs name it: ``dgd``, ``ignore_stragglers s=1``, ``pgc_cr s=1``."""
        return "dgd" if self.scheme == "dgd" else f"{_STRATEGY.get(self.scheme, self.scheme)} s={self.s}"

    @property
    def table_key(self) -> str:
        """How the emulated map labels it (``ddp``, ``ignore_stragglers c=2``, ``pgc_cr c=2``)."""
        return "ddp" if self.scheme == "dgd" else f"{_STRATEGY.get(self.scheme, self.scheme)} c={self.s + 1}"

    @property
    def code(self) -> int:
        return ARM_CODES[self.scheme]


DGD = AutoCandidate("dgd", 0)


def arm_from_code(code: int, s: int) -> AutoCandidate:
    """The arm of a ``(pgc/auto_arm, pgc/auto_s)`` pair (what a decision message carries)."""
    for name, value in ARM_CODES.items():
        if value == code:
            return AutoCandidate(name, s)
    raise ValueError(f"unknown arm code {code}")


def candidates(max_stragglers: int, schemes: Sequence[str] = ("ignore",)) -> list[AutoCandidate]:
    """``dgd`` and, for ``s = 1 .. max_stragglers``, each of ``schemes``."""
    if max_stragglers < 1:
        raise ValueError(f"max_stragglers must be >= 1, got {max_stragglers}")
    return [DGD] + [AutoCandidate(name, s) for s in range(1, max_stragglers + 1) for name in schemes]


@dataclass(frozen=True)
class FactorTable:
    """Versions to target of each arm relative to ``dgd`` (``factors[arm.table_key]``), measured on ``task`` with
    ``n`` workers; ``source`` names the map it was derived from."""

    n: int
    task: str
    factors: dict[str, float]
    source: str = ""

    def factor(self, arm: AutoCandidate) -> Optional[float]:
        """The arm's factor (``dgd``: 1), or None where the table has no measurement of it."""
        return 1.0 if arm.scheme == "dgd" else self.factors.get(arm.table_key)

    @classmethod
    def from_dict(cls, data: dict[str, Any], n: int) -> "FactorTable":
        """The entries of a table file (``{"source": ..., "tables": [{"n", "task", "factors": {key: {"factor":
        ...}}}]}``) measured with the ``n`` nearest to ``n`` (ties: the smaller). Where several tasks were measured at
        that ``n`` (the run's task is not known), each arm's factor is the largest any of them measured: a switch
        must pay on every task the map ran; ``task`` joins their names."""
        tables = data.get("tables") or []
        if not tables:
            raise ValueError("the factor table file has no tables")
        nearest = min((int(t["n"]) for t in tables), key=lambda m: (abs(m - n), m))
        entries = sorted((t for t in tables if int(t["n"]) == nearest), key=lambda t: str(t["task"]))
        factors: dict[str, float] = {}
        for entry in entries:
            for key, value in entry["factors"].items():
                factors[key] = max(factors.get(key, 0.0), float(value["factor"]))
        task = "+".join(str(t["task"]) for t in entries)
        return cls(nearest, task, factors, str(data.get("source", "")))

    @classmethod
    def shipped(cls, n: int) -> "FactorTable":
        """The table shipped in the package, its entry nearest to ``n`` workers."""
        text = resources.files("lightning_pgc").joinpath(TABLE_FILE).read_text()
        return cls.from_dict(json.loads(text), n)


class StepWindow:
    """The last ``size`` versions' own compute time of every rank, and the last all-reduce times.

    ``add(rank, version, seconds)`` in any order (late codes included); a version enters the window once any rank
    reported it. :meth:`rows` fills a rank's missing time with its latest earlier one (a rank that skipped a
    version because it was behind is as slow as it last was).
    """

    def __init__(self, n: int, size: int) -> None:
        if n < 2 or size < 1:
            raise ValueError(f"need n >= 2 and size >= 1, got n={n}, size={size}")
        self.n, self.size = n, size
        self.times: dict[int, list[Optional[float]]] = {}  # version -> per rank seconds (None: not reported)
        self.before: list[Optional[float]] = [None] * n  # each rank's latest time among the versions that left
        self.allreduce: list[float] = []

    def add(self, rank: int, version: int, seconds: float) -> None:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} out of range for n={self.n}")
        if not math.isfinite(seconds) or seconds < 0:
            return
        if version not in self.times:
            if len(self.times) >= self.size and version < min(self.times):
                return  # older than the window
            self.times[version] = [None] * self.n
            while len(self.times) > self.size:
                for r, t in enumerate(self.times.pop(min(self.times))):
                    if t is not None:
                        self.before[r] = t
        self.times[version][rank] = float(seconds)

    def add_allreduce(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.allreduce.append(float(seconds))
            del self.allreduce[: max(0, len(self.allreduce) - self.size)]

    def __len__(self) -> int:
        return len(self.times)

    def known(self) -> bool:
        """Whether every rank reported at least once (within the window or before it)."""
        return all(
            self.before[r] is not None or any(row[r] is not None for row in self.times.values()) for r in range(self.n)
        )

    def newest(self) -> int:
        """The newest version reported (-1: none)."""
        return max(self.times) if self.times else -1

    def row(self, version: int) -> list[float]:
        """Every rank's time at ``version``: a rank that sent none there counts with its latest earlier one (it is
        as slow as it last was), else its time before the window, else its first later one."""
        oldest = min(self.times) if self.times else version
        out: list[float] = []
        for r in range(self.n):
            known: Optional[float] = None
            for u in range(version, oldest - 1, -1):
                row = self.times.get(u)
                if row is not None and row[r] is not None:
                    known = row[r]
                    break
            if known is None:
                known = self.before[r]
            if known is None:
                later = [t for u, row in sorted(self.times.items()) if u > version for t in [row[r]] if t is not None]
                known = later[0] if later else 0.0
            out.append(float(known))
        return out

    def rows(self) -> list[list[float]]:
        """One row per version of the window: every rank's time, missing ones filled forward (from its time before the
        window, else backward from its first one)."""
        versions = sorted(self.times)
        last: list[Optional[float]] = list(self.before)
        for v in versions:  # backward fill for the first rows: a rank's first time stands for the ones before
            for r, t in enumerate(self.times[v]):
                if last[r] is None and t is not None:
                    last[r] = t
        out = []
        for v in versions:
            row: list[float] = []
            for r, t in enumerate(self.times[v]):
                if t is not None:
                    last[r] = t
                known = last[r]
                row.append(0.0 if known is None else known)
            out.append(row)
        return out

    def allreduce_s(self) -> float:
        return sum(self.allreduce) / len(self.allreduce) if self.allreduce else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "size": self.size,
            "times": {int(v): list(row) for v, row in self.times.items()},
            "before": list(self.before),
            "allreduce": list(self.allreduce),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved window (a window saved with other ``n`` is ignored: it describes other ranks)."""
        if int(state.get("n", -1)) != self.n:
            return
        self.times = {}
        for v in sorted(int(k) for k in state["times"])[-self.size :]:
            row = state["times"][v] if v in state["times"] else state["times"][str(v)]
            self.times[v] = [None if t is None else float(t) for t in row]
        self.before = [None if t is None else float(t) for t in state.get("before", [None] * self.n)]
        self.allreduce = [float(t) for t in state.get("allreduce", [])][-self.size :]


def order_statistic_mean(rows: Sequence[Sequence[float]], k: int) -> float:
    """Mean over ``rows`` of each row's ``k``-th smallest value (``k`` from 1)."""
    if not rows:
        return 0.0
    return sum(sorted(row)[k - 1] for row in rows) / len(rows)


@dataclass(frozen=True)
class Decision:
    """What the rule decided at one version: the arm for the next version, and why when it switched."""

    arm: AutoCandidate
    switched: bool
    reason: str = ""
    predicted_ratio: float = 1.0  # the new arm's predicted cost over the previous arm's


class AutoRule:
    """The switching rule of ``scheme="auto"`` (see the module docstring).

    Args:
        n: ranks.
        arms: the candidates (``dgd`` first); arms without a factor in ``table`` are left out.
        table: versions-to-target factors.
        margin: the least relative gain a version must predict to count as evidence for a candidate.
        threshold: the evidence that switches, in versions of the candidate's predicted step time.
        horizon: versions over which the stall rate is estimated.
        start: the arm at the start (``dgd``).
    """

    def __init__(
        self,
        n: int,
        arms: Sequence[AutoCandidate],
        table: FactorTable,
        margin: float = 0.05,
        threshold: float = 1.0,
        horizon: int = 200,
        start: AutoCandidate = DGD,
    ) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
        for arm in arms:
            if arm.s >= n:
                raise ValueError(f"arm {arm.label} needs s < n = {n}")
        self.n, self.margin, self.threshold = n, float(margin), float(threshold)
        self.table = table
        self.arms = [a for a in arms if table.factor(a) is not None]
        self.left_out = [a for a in arms if table.factor(a) is None]
        if DGD not in self.arms:
            self.arms.insert(0, DGD)
        self.window = StepWindow(n, RECENT)
        self.stalls = StallRate(n, [n - a.s for a in self.arms], horizon)
        self.evidence = Evidence(threshold, margin)
        self.arm = start if start in self.arms else DGD
        self._late: set[int] = set()  # judged versions a late code changed

    # ------------------------------------------------------------------------------------------ inputs
    def add(self, rank: int, version: int, seconds: float) -> None:
        """Rank ``rank`` spent ``seconds`` of its own time on ``version`` (in any order; late codes included)."""
        self.window.add(rank, version, seconds)
        if version <= self.stalls.judged and version in self.window.times:
            self._late.update(range(version - REACH, version + REACH + 1))

    def _judge(self, version: int) -> None:
        """Judge the versions whose later neighbours are now known, and those a late code changed."""
        frontier = version - REACH
        todo = sorted(u for u in self._late if u <= self.stalls.judged) + list(
            range(self.stalls.judged + 1, frontier + 1)
        )
        self._late.clear()
        for u in todo:
            if u in self.window.times:
                self.stalls.judge(self.window.times, u)
        self.stalls.judged = max(self.stalls.judged, frontier)
        self.stalls.forget_before(version - self.stalls.horizon + 1)

    # ------------------------------------------------------------------------------------------ predictions
    def step_times(self, version: int) -> dict[AutoCandidate, float]:
        """Predicted seconds per version of every candidate at ``version``: the ``(n - s)``-th fastest own time
        plus the all-reduce."""
        row = self.window.row(version)
        reduce_s = self.window.allreduce_s()
        return {arm: kth(row, self.n - arm.s) + reduce_s for arm in self.arms}

    def costs(self, version: Optional[int] = None) -> dict[AutoCandidate, float]:
        """Predicted seconds per unit of progress (``dgd``'s versions) of every candidate at ``version`` (default:
        the newest): its step time plus what stalls add per version at their rate, times its factor."""
        v = self.window.newest() if version is None else version
        out = {}
        for arm, step_s in self.step_times(v).items():
            factor = self.table.factor(arm)
            assert factor is not None
            out[arm] = (step_s + self.stalls.per_version(self.n - arm.s)) * factor
        return out

    # ------------------------------------------------------------------------------------------ the rule
    def step(self, version: Optional[int] = None) -> Decision:
        """Called once per closed ``version`` (default: the newest reported), after its times were added: the arm
        for the next version."""
        v = self.window.newest() if version is None else version
        if v < 0 or v not in self.window.times:
            return Decision(self.arm, False)
        self._judge(v)
        if not self.window.known():
            return Decision(self.arm, False)
        steps, costs = self.step_times(v), self.costs(v)
        current = costs[self.arm]
        slowest = sorted(range(self.n), key=self.window.row(v).__getitem__, reverse=True)
        self.evidence.most = MOST_WITH_STALLS if self.stalls.count() else MOST_PER_VERSION
        ready = []
        for arm in self.arms:
            who = tuple(sorted(slowest[: arm.s]))
            if arm != self.arm and self.evidence.add(arm, v, current, costs[arm], steps[arm], who):
                ready.append(arm)
        if not ready:
            return Decision(self.arm, False)
        best = max(ready, key=lambda a: (self.evidence.sums[a] / steps[a], -costs[a], -a.s))
        ratio = costs[best] / current if current > 0 else 0.0
        reason = self.explain(self.arm, best, ratio, v)
        self.arm = best
        self.evidence.clear()
        return Decision(best, True, reason, ratio)

    def explain(self, old: AutoCandidate, new: AutoCandidate, ratio: float, version: Optional[int] = None) -> str:
        """A line a person can read: who is slow (or that nobody is any more), or the stalls' rate, and the gain."""
        v = self.window.newest() if version is None else version
        since = self.evidence.since.get(new, v)
        rows = [self.window.row(u) for u in range(since, v + 1) if u in self.window.times] or [self.window.row(v)]
        means = [sum(row[r] for row in rows) / len(rows) for r in range(self.n)]
        typical = sorted(means)[(self.n - 1) // 2]
        slow = sorted((r for r in range(self.n) if typical > 0 and means[r] >= 1.1 * typical), key=lambda r: -means[r])
        span = f"{len(rows)} steps"
        rate = {a: self.stalls.per_version(self.n - a.s) * (self.table.factor(a) or 1.0) for a in (old, new)}
        costs = self.costs(v)
        gain = f"switching to {new.label} (predicted {ratio:.2f}x {old.label}'s time per unit of progress)"
        if rate[old] - rate[new] > 0.5 * (costs[old] - costs[new]):
            count, horizon = self.stalls.count(), self.stalls.horizon
            what = f"{count} stalls in the last {horizon} steps cost {old.label} {rate[old]:.3g} s per step on average"
        elif slow and new.s > old.s:
            who = ", ".join(f"rank {r}" for r in slow[: new.s])
            factor = means[slow[0]] / typical
            what = f"{who} {'has' if len(slow[: new.s]) == 1 else 'have'} been {factor:.1f}x slower for {span}"
        elif slow:
            what = f"the slowest rank (rank {slow[0]}) is {means[slow[0]] / typical:.1f}x slower over {span}"
        else:
            what = f"no rank has been more than 1.1x slower than the median for {span}"
        return f"{what}: {gain}"

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "arm": [self.arm.scheme, self.arm.s],
            "window": self.window.state_dict(),
            "stalls": self.stalls.state_dict(),
            "evidence": [
                [a.scheme, a.s, total, self.evidence.since.get(a, -1), list(self.evidence.who.get(a, ()))]
                for a, total in self.evidence.sums.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state (an arm that is no candidate here falls back to ``dgd``)."""
        arm = AutoCandidate(str(state["arm"][0]), int(state["arm"][1]))
        self.arm = arm if arm in self.arms else DGD
        if state.get("window") is not None:
            self.window.load_state_dict(state["window"])
        if state.get("stalls") is not None:
            self.stalls.load_state_dict(state["stalls"])
        self.evidence.clear()
        for scheme, s, total, since, *who in state.get("evidence", []):
            cand = AutoCandidate(str(scheme), int(s))
            if cand in self.arms and cand != self.arm:
                self.evidence.sums[cand] = float(total)
                if int(since) >= 0:
                    self.evidence.since[cand] = int(since)
                if who and who[0]:
                    self.evidence.who[cand] = tuple(int(r) for r in who[0])
