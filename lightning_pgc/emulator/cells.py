"""The cells and arms of the emulated crossover map, and one (cell, arm) run of the tuning protocol.

A *cell* is a cluster (``n``, straggler pattern, compute- or communication-bound) and a data condition (iid or a
Dirichlet label skew) on a proxy task. An *arm* is a strategy with its ``s`` (``c = s + 1``). :func:`run_arm`
carries out the protocol for one arm in one cell:

1. tuning: every ``(lr, momentum)`` of :data:`LRS` x :data:`MOMENTA` on the tuning seeds (disjoint from the
   evaluation seeds), scored by the restricted mean time to the late target (misses censored at the budget);
2. evaluation: the chosen setting on every evaluation seed, times to both targets recorded (``None``: missed).

The budget of a cell is a fixed virtual time, ``BUDGET_STEPS`` ideal steps (one gradient plus the step's
communication, no delay); every arm's schedule is cut there, so slow steps buy fewer versions. A seed fixes the
delay realisation, the partition split and mini-batch streams, and the model's initial weights.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_pgc.codes import AutoScheme, BoundedScheme, make_scheme
from lightning_pgc.examples.digits import load_digits_tensors
from lightning_pgc.emulator.cluster import Cluster
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import from_records
from lightning_pgc.emulator.scoring import tuning_score
from lightning_pgc.emulator.tasks import make_task
from lightning_pgc.emulator.train import emulate_grid
from lightning_pgc.emulator.clock import Costs, simulate

__all__ = ["Arm", "Cell", "LRS", "MOMENTA", "Protocol", "arms_for", "run_arm"]

#: the learning rates of the tuning grid; 1.6 is in it because most tuned arms of a grid ending at 0.8 chose 0.8
#: (docs/emulator.md, "Tuning protocol")
LRS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
MOMENTA: tuple[float, ...] = (0.0, 0.5, 0.7, 0.8, 0.9)
#: strategy name (as registered, ``ddp`` for the synchronous baseline) -> scheme of the codes package
STRATEGIES: dict[str, str] = {
    "ddp": "dgd",
    "ignore_stragglers": "ignore",
    "gc_fr": "gc_fr",
    "gc_cr": "gc_cr",
    "pgc_fr": "pgc_fr",
    "pgc_cr": "pgc_cr",
    "bounded_staleness": "bounded",
    "pgc_auto": "auto",  # s = c - 1 is its max_stragglers (lightning_pgc/emulator/auto.py)
}


@dataclass(frozen=True)
class Protocol:
    """The tuning protocol's constants (recorded with every result)."""

    targets: tuple[float, float] = (0.5, 0.3)  # validation loss: early, late
    budget_steps: int = 300
    max_versions: int = 400
    tuning_seeds: tuple[int, ...] = (1000, 1001)
    eval_seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = LRS
    momenta: tuple[float, ...] = MOMENTA


@dataclass(frozen=True)
class Cell:
    """A cluster, a data condition and a proxy task (``mlp``: digits MLP 64-64-10, 8 samples per partition
    evaluation; ``cnn``: the digits CNN of the real 4-rank runs, 16 samples; ``lm``, ``bncnn``: the harder tasks of
    :mod:`~lightning_pgc.emulator.tasks`)."""

    n: int
    pattern: str
    bound: str = "compute"
    data: str = "iid"
    alpha: float = 0.1
    task: str = "mlp"
    delay: Optional[str] = None  # explicit delay spec (the cells that mirror real runs)
    costs: Optional[tuple[float, float, float, float]] = None  # compute, overhead, code, aggregate seconds
    cs: Optional[tuple[int, ...]] = None  # the arms' c (default: see arms_for)
    fixed: Optional[tuple[tuple[str, float, float], ...]] = None  # (arm label, lr, momentum): no tuning, these settings

    def cluster(self) -> Cluster:
        costs = None if self.costs is None else Costs(*self.costs)
        return Cluster(self.n, self.pattern, self.bound, self.delay, costs)

    def condition(self) -> DataCondition:
        return DataCondition(self.data, self.alpha)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Arm:
    """A strategy with its ``c``, and the staleness correction it runs with (``PGCStrategy``'s
    ``staleness_correction``, ``lookahead_steps`` and ``dc_lambda``; the pipelined schemes and bounded staleness).

    ``bounded_staleness``: ``c`` is the window (``staleness``) and ``replication`` the copies of each partition
    (:class:`~lightning_pgc.codes.BoundedScheme` with its default ``fresh``); the other strategies ignore it."""

    strategy: str
    c: int = 1
    correction: str = "none"
    lookahead_steps: Optional[float] = None
    dc_lambda: float = 0.04
    replication: int = 2

    @property
    def bounded(self) -> bool:
        return STRATEGIES.get(self.strategy) == "bounded"

    @property
    def s(self) -> int:
        """Tolerated stragglers: ``c - 1`` (bounded staleness: ``replication - 1``)."""
        return self.replication - 1 if self.bounded else self.c - 1

    @property
    def label(self) -> str:
        base = self.strategy if self.strategy == "ddp" else f"{self.strategy} c={self.c}"
        if self.bounded:
            base = f"bounded r={self.replication} c={self.c}"
        if self.correction == "none":
            return base
        if self.correction == "lookahead" and self.lookahead_steps is not None:
            return f"{base} lookahead k={self.lookahead_steps:g}"
        if self.correction == "delay_compensation" and self.dc_lambda != 0.04:
            return f"{base} delay_compensation lambda={self.dc_lambda:g}"
        return f"{base} {self.correction}"

    def correction_fields(self) -> dict[str, Any]:
        """The correction's settings (empty without one: records of uncorrected arms keep their old form)."""
        if self.correction == "none":
            return {}
        return {"correction": self.correction, "lookahead_steps": self.lookahead_steps, "dc_lambda": self.dc_lambda}

    def correction_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~lightning_pgc.emulator.train.emulate_grid` for the correction."""
        return {"correction": self.correction, "lookahead_steps": self.lookahead_steps, "dc_lambda": self.dc_lambda}

    def scheme(self, n: int) -> Any:
        if self.bounded:
            return BoundedScheme(n, self.replication, self.c)
        return _scheme(STRATEGIES[self.strategy], n, self.s)

    def record(self) -> dict[str, Any]:
        """The arm as its record states it."""
        extra = {"replication": self.replication} if self.bounded else {}
        return {
            "strategy": self.strategy,
            "c": self.c,
            "s": self.s,
            "label": self.label,
            **extra,
            **self.correction_fields(),
        }


@functools.lru_cache(maxsize=64)
def _scheme(name: str, n: int, s: int) -> Any:
    """Schemes are built once per (name, n, s): Tandon's code searches for a well-conditioned B, which takes long."""
    return AutoScheme(n, s) if name == "auto" else make_scheme(name, n, s)


#: gc_cr is left out above this n where c does not divide n: Tandon's random construction searches over received
#: sets (about a minute at n = 64 on this machine) and its worst-case conditioning grows with n (docs/math.md).
#: Where c divides n, gc_cr uses the tiling construction (exact, built in O(n c)) at every n.
GC_CR_MAX_N = 16


def arms_for(n: int, cs: Optional[list[int]] = None) -> tuple[list[Arm], list[str]]:
    """The arms of a cell with ``n`` workers (``c`` in ``cs``, default 2 and ``n / 8`` for ``n >= 32``) and the reasons
    for arms left out (a scheme that refuses ``(n, s)``)."""
    if cs is None:
        cs = [2] + ([n // 8] if n >= 32 else [4] if n >= 16 else [])
    cs = list(cs)
    arms, skipped = [Arm("ddp")], []
    for c in cs:
        for strategy in ("ignore_stragglers", "gc_fr", "gc_cr", "pgc_fr", "pgc_cr"):
            arm = Arm(strategy, c)
            if strategy == "gc_cr" and n > GC_CR_MAX_N and n % c:
                skipped.append(
                    f"{arm.label}: left out for n > {GC_CR_MAX_N} where c does not divide n (building Tandon's "
                    "code takes minutes, and its decoding conditions worsen with n)"
                )
                continue
            try:
                arm.scheme(n)
            except ValueError as err:
                skipped.append(f"{arm.label}: {str(err).splitlines()[0][:120]}")
                continue
            arms.append(arm)
    return arms, skipped


_DATA: dict[str, Any] = {}


def _digits() -> tuple[torch.Tensor, ...]:
    if "digits" not in _DATA:
        train, val = load_digits_tensors()
        _DATA["digits"] = (*train.tensors, *val.tensors)
    return _DATA["digits"]


def _model(task: str, seed: int) -> tuple[nn.Module, int]:
    """Task ``task``'s model at seed ``seed`` and its samples per partition (:func:`~lightning_pgc.emulator.tasks.make_task`)."""
    built = make_task(task, seed)
    return built.model, built.batch_size


def budget_s(cell: Cell, protocol: Protocol) -> float:
    """The cell's budget in virtual seconds: ``budget_steps`` ideal ddp steps (one gradient, the step's messages)."""
    costs = cell.cluster().clock_costs()
    return protocol.budget_steps * (costs.compute_s + costs.code_s + costs.aggregate_s + costs.overhead_s)


def _schedule(cell: Cell, arm: Arm, seed: int, protocol: Protocol, budget: float) -> tuple[Any, list[Any]]:
    cluster = cell.cluster()
    scheme = arm.scheme(cell.n)
    res = simulate(scheme, protocol.max_versions, cluster.delay_model(seed), cluster.clock_costs(), delay_seed=seed)
    versions = from_records(res.records, res.applied[0])
    return scheme, [v for v in versions if v.time_s <= budget]


def _runs(
    cell: Cell, arm: Arm, seed: int, settings: list[tuple[float, float]], protocol: Protocol, budget: float
) -> list[Any]:
    scheme, schedule = _schedule(cell, arm, seed, protocol, budget)
    task = make_task(cell.task, seed)
    if task.y_train.dim() != 1 and cell.data != "iid":
        raise ValueError(f"task {cell.task!r} has no labels to skew: use data='iid'")
    streams = partition_streams(task.y_train.numpy(), cell.n, seed, cell.condition())
    if not schedule:  # not one version within the budget
        return [None] * len(settings)
    return emulate_grid(
        scheme,
        schedule,
        task,
        streams,
        settings,
        stop_below=min(protocol.targets),
        **arm.correction_kwargs(),
    )


def run_arm(cell: Cell, arm: Arm, protocol: Protocol = Protocol()) -> dict[str, Any]:
    """The tuning protocol for ``arm`` in ``cell``: one JSON-ready record."""
    started = time.process_time()
    budget = budget_s(cell, protocol)
    early, late = protocol.targets
    settings = [(lr, m) for lr in protocol.lrs for m in protocol.momenta]
    late_times: dict[tuple[float, float], list[Optional[float]]] = {s: [] for s in settings}
    if cell.fixed is not None:  # the settings a real run used: evaluate those, no tuning
        fixed = {label: (lr, m) for label, lr, m in cell.fixed}
        if arm.label not in fixed:
            raise ValueError(f"cell {cell.pattern!r} fixes settings for {sorted(fixed)}, not for {arm.label!r}")
        chosen, settings, scores = fixed[arm.label], [], {}
    else:
        for seed in protocol.tuning_seeds:
            for setting, run in zip(settings, _runs(cell, arm, seed, settings, protocol, budget)):
                late_times[setting].append(None if run is None else run.time_to(late))
        scores = {s: tuning_score(t, budget) for s, t in late_times.items()}
        chosen = min(settings, key=lambda s: (scores[s], -s[0], -s[1]))  # ties: the larger lr, then momentum
    evaluation: dict[str, list[Any]] = {"time_early": [], "time_late": [], "versions_late": [], "diverged": []}
    for seed in protocol.eval_seeds:
        run = _runs(cell, arm, seed, [chosen], protocol, budget)[0]
        t_late = None if run is None else run.time_to(late)
        evaluation["time_early"].append(None if run is None else run.time_to(early))
        evaluation["time_late"].append(t_late)
        evaluation["versions_late"].append(
            None if t_late is None else next(s for s, t in zip(run.val_steps, run.val_times) if t == t_late)
        )
        evaluation["diverged"].append(bool(run is not None and run.diverged))
    return {
        "cell": asdict(cell),
        "arm": arm.record(),
        "protocol": {**asdict(protocol)},
        "budget_s": budget,
        "tuning": {
            "scores": [
                {"lr": s[0], "momentum": s[1], "score_s": scores[s], "times_late": late_times[s]} for s in settings
            ],
            "chosen": {"lr": chosen[0], "momentum": chosen[1]},
        },
        "eval": {"seeds": list(protocol.eval_seeds), **evaluation},
        "cpu_s": time.process_time() - started,
    }
