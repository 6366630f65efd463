"""The choice of ``scheme="auto"``: which arm (scheme and ``s``) to run, from the step times the leader measures.

Pure decisions (no Lightning, no torch.distributed, no I/O but reading the shipped factor table). The leader
(:class:`~lightning_pgc.decisions.auto_leader.AutoLeader`) feeds a :class:`StepWindow` every rank's own compute time
per version (what each code's announcement says the rank spent between applying its previous aggregate and sending
this code, so waiting is not counted) and the measured time of the all-reduce; :class:`AutoRule` predicts, for each
candidate arm (:class:`AutoCandidate`), the time per unit of training progress

    cost(arm) = (E[(n - s)-th fastest own time of a version] + all-reduce) * factor(arm)

where the expectation is the mean over the window's versions (a rank that sent no code for a version counts with
its latest time) and ``factor`` is the arm's versions-to-target relative to ``dgd``, read from the table derived
from the emulated map (:class:`FactorTable`, ``lightning_pgc/auto_factors.json``, ``benchmarks/auto_table.py``).

Hysteresis: the rule switches from the current arm to the cheapest one only once that one has been predicted at
most ``(1 - margin)`` of the current arm's cost for ``patience`` consecutive versions, with a full window; the same
condition brings it back (to ``dgd`` when the slowness ends). A cost ratio inside the band ``(1 - margin, 1 /
(1 - margin))`` never switches either way, so costs that wander around the margin cannot make it flap.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional, Sequence

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

    @property
    def full(self) -> bool:
        """``size`` versions reported and every rank reported at least once."""
        if len(self.times) < self.size:
            return False
        return all(
            self.before[r] is not None or any(row[r] is not None for row in self.times.values()) for r in range(self.n)
        )

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
        margin: the least predicted gain that switches (0.1: the new arm costs at most 90 % of the current one).
        patience: consecutive versions the gain must hold, with a full window, before a switch.
        window: versions in the window.
        start: the arm at the start (``dgd``).
    """

    def __init__(
        self,
        n: int,
        arms: Sequence[AutoCandidate],
        table: FactorTable,
        margin: float = 0.1,
        patience: int = 10,
        window: int = 30,
        start: AutoCandidate = DGD,
    ) -> None:
        if not 0.0 < margin < 1.0:
            raise ValueError(f"margin must be in (0, 1), got {margin!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience!r}")
        for arm in arms:
            if arm.s >= n:
                raise ValueError(f"arm {arm.label} needs s < n = {n}")
        self.n, self.margin, self.patience = n, float(margin), int(patience)
        self.table = table
        self.arms = [a for a in arms if table.factor(a) is not None]
        self.left_out = [a for a in arms if table.factor(a) is None]
        if DGD not in self.arms:
            self.arms.insert(0, DGD)
        self.window = StepWindow(n, window)
        self.arm = start if start in self.arms else DGD
        self._pending: Optional[AutoCandidate] = None
        self._count = 0

    # ------------------------------------------------------------------------------------------ predictions
    def costs(self) -> dict[AutoCandidate, float]:
        """Predicted seconds per unit of progress (``dgd``'s versions) of every candidate, from the window."""
        rows = self.window.rows()
        reduce_s = self.window.allreduce_s()
        out = {}
        for arm in self.arms:
            factor = self.table.factor(arm)
            assert factor is not None
            out[arm] = (order_statistic_mean(rows, self.n - arm.s) + reduce_s) * factor
        return out

    # ------------------------------------------------------------------------------------------ the rule
    def step(self) -> Decision:
        """Called once per closed version, after its times entered the window: the arm for the next version."""
        if not self.window.full:
            self._pending, self._count = None, 0
            return Decision(self.arm, False)
        costs = self.costs()
        current = costs[self.arm]
        best = min(self.arms, key=lambda a: (costs[a], a != self.arm, a.s, a.code))
        if best == self.arm or not costs[best] <= (1.0 - self.margin) * current:
            self._pending, self._count = None, 0
            return Decision(self.arm, False)
        if best != self._pending:
            self._pending, self._count = best, 0
        self._count += 1
        if self._count < self.patience:
            return Decision(self.arm, False)
        ratio = costs[best] / current if current > 0 else 0.0
        reason = self.explain(self.arm, best, ratio)
        self.arm, self._pending, self._count = best, None, 0
        return Decision(best, True, reason, ratio)

    def explain(self, old: AutoCandidate, new: AutoCandidate, ratio: float) -> str:
        """A line a person can read: who is slow (or that nobody is any more), and the predicted gain."""
        rows = self.window.rows()
        means = [sum(row[r] for row in rows) / len(rows) for r in range(self.n)]
        typical = sorted(means)[(self.n - 1) // 2]
        slow = sorted((r for r in range(self.n) if typical > 0 and means[r] >= 1.1 * typical), key=lambda r: -means[r])
        span = f"{len(rows)} steps"
        if slow and new.s > old.s:
            who = ", ".join(f"rank {r}" for r in slow[: new.s])
            factor = means[slow[0]] / typical
            what = f"{who} {'has' if len(slow[: new.s]) == 1 else 'have'} been {factor:.1f}x slower for {span}"
        elif slow:
            what = f"the slowest rank (rank {slow[0]}) is {means[slow[0]] / typical:.1f}x slower over {span}"
        else:
            what = f"no rank has been more than 1.1x slower than the median for {span}"
        return f"{what}: switching to {new.label} (predicted {ratio:.2f}x {old.label}'s time per unit of progress)"

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "arm": [self.arm.scheme, self.arm.s],
            "window": self.window.state_dict(),
            "pending": None if self._pending is None else [self._pending.scheme, self._pending.s],
            "count": self._count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state (an arm that is no candidate here falls back to ``dgd``)."""
        arm = AutoCandidate(str(state["arm"][0]), int(state["arm"][1]))
        self.arm = arm if arm in self.arms else DGD
        if state.get("window") is not None:
            self.window.load_state_dict(state["window"])
        pending = state.get("pending")
        self._pending = None if pending is None else AutoCandidate(str(pending[0]), int(pending[1]))
        self._count = int(state.get("count", 0))
