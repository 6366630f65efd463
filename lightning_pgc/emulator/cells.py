"""The cells and arms of the emulated crossover map, and one (cell, arm) run of the tuning protocol.

A *cell* is a cluster (``n``, straggler pattern, compute- or communication-bound) and a data condition (iid or a
Dirichlet label skew) on a proxy task. An *arm* is a strategy with its ``s`` (``c = s + 1``) and its staleness
correction. :func:`run_arm` carries out the protocol for one arm in one cell:

1. tuning: every ``(lr, momentum)`` of the protocol's grid on the tuning seeds (disjoint from the evaluation seeds),
   scored by the restricted mean time to the late target (misses censored at the budget), ties (above all: a grid on
   which every setting missed) broken by the mean final validation loss;
2. the edge rule: while the chosen setting sits on an edge of the grid tried so far (the largest or smallest lr, the
   largest momentum; momentum 0 is the domain's boundary, not an edge), the grid is extended one step beyond that
   edge (lr doubled or halved, momentum towards 1) and the new settings are tuned too, up to :data:`LR_REACH` steps and
   :data:`MOMENTUM_STEPS`; a choice still on an edge there is recorded as such (``tuning.edge``);
3. the miss rule: an arm that missed the late target on every setting and tuning seed (``tuning.missed_everywhere``;
   the edge rule has then followed the lowest final loss) is evaluated at the setting with the lowest mean final
   validation loss; its ratios are bounds (every miss counts as the budget), labelled so, and never ranked
   (:mod:`~lightning_pgc.emulator.summary`);
4. evaluation: the chosen setting on every evaluation seed, times to both targets recorded (``None``: missed).

The budget of a cell is a fixed virtual time, ``budget_steps`` ideal steps (one gradient plus the step's
communication, no delay); every arm's schedule is cut there, so slow steps buy fewer versions. A version's time is
its close at the leader plus the aggregate's trip back (when every waiting rank can apply it), not one rank's
apply: a rank that is itself the straggler does not delay the version's time stamp. A seed fixes the delay
realisation, the partition split and mini-batch streams, and the model's initial weights.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_pgc.codes import AutoScheme, BoundedScheme, make_scheme
from lightning_pgc.examples.digits import load_digits_tensors
from lightning_pgc.emulator.cluster import NODE_PATTERNS, Cluster, node_size
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import from_records
from lightning_pgc.emulator.machine import environment
from lightning_pgc.emulator.scoring import tuning_score
from lightning_pgc.emulator.tasks import make_task, spec
from lightning_pgc.emulator.train import Task, emulate_grid
from lightning_pgc.emulator.clock import Costs, simulate

__all__ = [
    "ARM_FAMILIES",
    "CORRECTIONS",
    "LRS",
    "LR_REACH",
    "MOMENTA",
    "MOMENTUM_STEPS",
    "MapArm",
    "MapCell",
    "Protocol",
    "arms_for",
    "cs_for",
    "on_edge",
    "run_arm",
]

#: the learning rates of the starting grid (the edge rule extends it: :func:`run_arm`)
LRS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
#: the momenta of the starting grid; 0.25 because most stale arms of a grid without it chose 0 (docs/results/emulator.md)
MOMENTA: tuple[float, ...] = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9)
#: how far the edge rule may extend the learning rate: at most this many halvings below the starting grid's smallest
#: lr and doublings above its largest (the map's own grid: 0.003125 to 25.6)
LR_REACH: int = 4
#: the momenta the edge rule adds above the grid's largest, in order
MOMENTUM_STEPS: tuple[float, ...] = (0.95, 0.975, 0.99)
#: the staleness corrections every pipelined arm also runs with (``CodingOptions.staleness_correction`` with its
#: defaults: look-ahead ``k = c - 1``, delay compensation ``lambda = 0.04``)
CORRECTIONS: tuple[str, ...] = ("lookahead", "delay_compensation", "momentum")
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
    """The tuning protocol's constants (recorded with every result). A proxy task with a map grid of its own brings
    its targets, budget, grid and validation interval (:meth:`for_task`)."""

    targets: tuple[float, float] = (0.5, 0.3)  # validation loss: early, late
    budget_steps: int = 300
    max_versions: int = 400
    tuning_seeds: tuple[int, ...] = (1000, 1001)
    eval_seeds: tuple[int, ...] = tuple(range(20))
    lrs: tuple[float, ...] = LRS
    momenta: tuple[float, ...] = MOMENTA
    extend: bool = True  # the edge rule (off: the grid as given)
    val_every: int = 1  # versions between validation losses (a target's time is the first validation at or below it)

    def __post_init__(self) -> None:
        if set(self.tuning_seeds) & set(self.eval_seeds):
            raise ValueError(f"tuning seeds {self.tuning_seeds} overlap the evaluation seeds {self.eval_seeds}")
        if not self.tuning_seeds or not self.eval_seeds:
            raise ValueError("a protocol needs at least one tuning seed and one evaluation seed")

    def for_task(self, task: str) -> "Protocol":
        """The protocol for ``task``: a task with a map grid of its own (:attr:`TaskSpec.map_lrs`, the harder tasks)
        brings its targets, budget (its horizon; versions capped at 4/3 of it), validation interval and starting
        grid; the digits tasks keep the protocol's."""
        own = spec(task)
        if own.map_lrs is None or own.map_momenta is None:
            return self
        return replace(
            self,
            targets=own.targets,
            budget_steps=own.horizon,
            max_versions=math.ceil(own.horizon * 4 / 3),
            lrs=own.map_lrs,
            momenta=own.map_momenta,
            val_every=own.val_every,
        )


@dataclass(frozen=True)
class MapCell:
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
class MapArm:
    """A strategy with its ``c``, and the staleness correction it runs with (``PGCStrategy``'s
    ``coding.staleness_correction``, ``coding.lookahead_steps`` and ``coding.dc_lambda``; the pipelined schemes and
    bounded staleness).

    ``bounded_staleness``: ``c`` is the window (``coordinator.staleness``) and ``replication`` the copies of each
    partition (:class:`~lightning_pgc.codes.BoundedScheme` with its default ``fresh``); the other strategies ignore
    it."""

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


def cs_for(n: int, pattern: str = "none") -> list[int]:
    """The arms' ``c`` in a cell of ``n`` workers: 2, an intermediate 4 (3 at n = 4) and ``n / 8`` (n >= 64), and for a
    node-level pattern (:data:`~lightning_pgc.emulator.cluster.NODE_PATTERNS`) also ``node + 1`` and ``2 node``
    (``node`` = :func:`~lightning_pgc.emulator.cluster.node_size`): ``s`` at and above the node size, so that an
    arm can leave a whole slow or stalled node out. Only ``c < n``."""
    cs = {2, 3 if n <= 4 else 4}
    if n >= 64:
        cs.add(n // 8)
    if pattern in NODE_PATTERNS:
        node = node_size(n)
        cs |= {node + 1, 2 * node}
    return sorted(c for c in cs if 2 <= c < n)


def _base_arms(n: int, c: int) -> list[MapArm]:
    """The map's own arms at one ``c``: ignore, gradient coding (FR, CR), the pipelined schemes uncorrected and with
    each correction of :data:`CORRECTIONS`, bounded staleness with replication ``c`` (window 2) uncorrected and with
    look-ahead."""
    arms = [MapArm("ignore_stragglers", c), MapArm("gc_fr", c), MapArm("gc_cr", c)]
    for strategy in ("pgc_fr", "pgc_cr"):
        arms += [MapArm(strategy, c)] + [MapArm(strategy, c, correction) for correction in CORRECTIONS]
    arms += [MapArm("bounded_staleness", 2, replication=c), MapArm("bounded_staleness", 2, "lookahead", replication=c)]
    return arms


def _auto_arms(n: int, c: int) -> list[MapArm]:
    """``pgc_auto`` with ``max_stragglers = c - 1``: the strategy's own leader and switching rule
    (:mod:`lightning_pgc.emulator.auto`), tuned like every other arm."""
    return [MapArm("pgc_auto", c)]


#: functions ``(n, c) -> arms`` whose arms every cell runs at each of its ``c`` (a new arm family registers here)
ARM_FAMILIES: list[Callable[[int, int], list[MapArm]]] = [_base_arms, _auto_arms]


def arms_for(n: int, cs: Optional[list[int]] = None, pattern: str = "none") -> tuple[list[MapArm], list[str]]:
    """The arms of a cell with ``n`` workers (ddp, then every arm of :data:`ARM_FAMILIES` at each ``c`` of ``cs``,
    default :func:`cs_for`) and the reasons for arms left out (a scheme that refuses ``(n, s)``)."""
    cs = cs_for(n, pattern) if cs is None else list(cs)
    arms, skipped = [MapArm("ddp")], []
    for c in cs:
        for family in ARM_FAMILIES:
            for arm in family(n, c):
                if arm.strategy == "gc_cr" and n > GC_CR_MAX_N and n % c:
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


def _task(task: str, seed: int) -> Task:
    """The proxy task with its model's initial weights drawn from ``seed``
    (:func:`~lightning_pgc.emulator.tasks.make_task`)."""
    return make_task(task, seed)


def _model(task: str, seed: int) -> tuple[nn.Module, int]:
    """The proxy task's model (initial weights from ``seed``) and its samples per partition evaluation."""
    t = _task(task, seed)
    return t.model, t.batch_size


def budget_s(cell: MapCell, protocol: Protocol) -> float:
    """The cell's budget in virtual seconds: ``budget_steps`` ideal ddp steps (one gradient, the step's messages)."""
    costs = cell.cluster().clock_costs()
    return protocol.budget_steps * (costs.compute_s + costs.code_s + costs.aggregate_s + costs.overhead_s)


def _schedule(cell: MapCell, arm: MapArm, seed: int, protocol: Protocol, budget: float) -> tuple[Any, list[Any]]:
    """The arm's versions within the budget, each stamped at its close plus the aggregate's trip back."""
    cluster = cell.cluster()
    scheme = arm.scheme(cell.n)
    costs = cluster.clock_costs()
    res = simulate(scheme, protocol.max_versions, cluster.delay_model(seed), costs, delay_seed=seed)
    versions = from_records(res.records, [r.closed_at + costs.aggregate_s for r in res.records])
    return scheme, [v for v in versions if v.time_s <= budget]


def _runs(
    cell: MapCell, arm: MapArm, seed: int, settings: list[tuple[float, float]], protocol: Protocol, budget: float
) -> list[Any]:
    scheme, schedule = _schedule(cell, arm, seed, protocol, budget)
    task = _task(cell.task, seed)
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
        val_every=protocol.val_every,
        **arm.correction_kwargs(),
    )


def _final_loss(run: Any) -> float:
    """The last validation loss of a run (``inf``: none, or not finite)."""
    if run is None or not run.val_loss or not math.isfinite(run.val_loss[-1]):
        return math.inf
    return float(run.val_loss[-1])


def on_edge(chosen: tuple[float, float], lrs: Sequence[float], momenta: Sequence[float]) -> list[str]:
    """The edges of the grid ``lrs`` x ``momenta`` that ``chosen`` sits on: ``"lr_high"``, ``"lr_low"``,
    ``"momentum_high"`` (momentum 0 is the domain's boundary, not an edge)."""
    lr, m = chosen
    edges = []
    if lr >= max(lrs):
        edges.append("lr_high")
    if lr <= min(lrs):
        edges.append("lr_low")
    if m >= max(momenta) and m > 0:
        edges.append("momentum_high")
    return edges


def _extension(
    edges: list[str], lrs: list[float], momenta: list[float], limits: tuple[float, float]
) -> tuple[list[float], list[float], list[str]]:
    """The lrs and momenta the edge rule adds for ``edges``, and the edges it cannot extend (beyond the lr
    ``limits``, or past :data:`MOMENTUM_STEPS`)."""
    new_lrs: list[float] = []
    new_momenta: list[float] = []
    stuck = []
    for edge in edges:
        if edge == "lr_high" and max(lrs) * 2 <= limits[1] * (1 + 1e-9):
            new_lrs.append(max(lrs) * 2)
        elif edge == "lr_low" and min(lrs) / 2 >= limits[0] * (1 - 1e-9):
            new_lrs.append(min(lrs) / 2)
        elif edge == "momentum_high" and any(m > max(momenta) for m in MOMENTUM_STEPS):
            new_momenta.append(min(m for m in MOMENTUM_STEPS if m > max(momenta)))
        else:
            stuck.append(edge)
    return new_lrs, new_momenta, stuck


def run_arm(cell: MapCell, arm: MapArm, protocol: Protocol = Protocol()) -> dict[str, Any]:
    """The tuning protocol for ``arm`` in ``cell``: one JSON-ready record."""
    started = time.process_time()
    protocol = protocol.for_task(cell.task)
    budget = budget_s(cell, protocol)
    early, late = protocol.targets
    lrs, momenta = list(protocol.lrs), list(protocol.momenta)
    limits = (min(lrs) / 2**LR_REACH, max(lrs) * 2**LR_REACH)
    late_times: dict[tuple[float, float], list[Optional[float]]] = {}
    final: dict[tuple[float, float], list[float]] = {}

    def tune(settings: list[tuple[float, float]]) -> None:
        for seed in protocol.tuning_seeds:
            for setting, run in zip(settings, _runs(cell, arm, seed, settings, protocol, budget)):
                late_times.setdefault(setting, []).append(None if run is None else run.time_to(late))
                final.setdefault(setting, []).append(_final_loss(run))

    def score(setting: tuple[float, float]) -> tuple[float, float, float, float]:
        loss = sum(final[setting]) / len(final[setting])  # ties: the lower final loss, then the larger lr, momentum
        return (tuning_score(late_times[setting], budget), loss, -setting[0], -setting[1])

    edges: list[str] = []
    missed = False
    if cell.fixed is not None:  # the settings a real run used: evaluate those, no tuning
        fixed = {label: (lr, m) for label, lr, m in cell.fixed}
        if arm.label not in fixed:
            raise ValueError(f"cell {cell.pattern!r} fixes settings for {sorted(fixed)}, not for {arm.label!r}")
        chosen = fixed[arm.label]
    else:
        tune([(lr, m) for lr in lrs for m in momenta])
        chosen = min(late_times, key=score)
        edges = on_edge(chosen, lrs, momenta)
        while edges and protocol.extend:
            new_lrs, new_momenta, stuck = _extension(edges, lrs, momenta, limits)
            if not new_lrs and not new_momenta:
                edges = stuck
                break
            lrs += new_lrs
            momenta += new_momenta
            tune([(lr, m) for lr in lrs for m in momenta if (lr, m) not in late_times])
            chosen = min(late_times, key=score)
            edges = on_edge(chosen, lrs, momenta)
        missed = all(t is None for times in late_times.values() for t in times)
    evaluation: dict[str, list[Any]] = {
        "time_early": [],
        "time_late": [],
        "versions_late": [],
        "diverged": [],
        "final_loss": [],
    }
    for seed in protocol.eval_seeds:
        run = _runs(cell, arm, seed, [chosen], protocol, budget)[0]
        t_late = None if run is None else run.time_to(late)
        evaluation["time_early"].append(None if run is None else run.time_to(early))
        evaluation["time_late"].append(t_late)
        evaluation["versions_late"].append(
            None if t_late is None else next(s for s, t in zip(run.val_steps, run.val_times) if t == t_late)
        )
        evaluation["diverged"].append(bool(run is not None and run.diverged))
        evaluation["final_loss"].append(_final_loss(run) if math.isfinite(_final_loss(run)) else None)
    return {
        "cell": asdict(cell),
        "arm": arm.record(),
        "protocol": {**asdict(protocol)},
        "budget_s": budget,
        "tuning": {
            "scores": [
                {
                    "lr": s[0],
                    "momentum": s[1],
                    "score_s": tuning_score(t, budget),
                    "times_late": t,
                    "final_loss": [x if math.isfinite(x) else None for x in final[s]],
                }
                for s, t in late_times.items()
            ],
            "lrs": sorted(lrs),
            "momenta": sorted(momenta),
            "chosen": {"lr": chosen[0], "momentum": chosen[1]},
            "edge": edges,
            "missed_everywhere": missed,
        },
        "eval": {"seeds": list(protocol.eval_seeds), **evaluation},
        "cpu_s": time.process_time() - started,
        "environment": environment(),
    }
