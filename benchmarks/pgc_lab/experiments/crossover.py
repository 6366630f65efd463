"""The benchmark grid's plan, its raw per-run store, and the crossover map: pure (no Lightning, no processes).

The grid is cells (straggler model x cost of a gradient evaluation) times arms (a scheme with its ``c``, at its
own learning rate and momentum) times seeds. :func:`plan_sweep` lists the short sweep over rates and momenta,
:func:`choose_setting` picks each arm's setting by a rule fixed before any result (lowest mean final validation
loss over the sweep's seeds; ties: the smaller rate), :func:`plan_main` lists the main runs at those settings.
Every finished job is one record in a :class:`Store` (``docs/results/grid_runs/``, one JSON Lines file per round), keyed
by the job's name and checked against its spec, so the grid runs incrementally and the report re-renders from
whatever is finished.
:func:`summarize_cell` turns a cell's records into per-arm statistics (paired t intervals against ``dgd`` and
``ddp`` from :mod:`pgc_lab.experiments.stats`) and the cell's winner with its margin, or marks the cell
incomplete. ``benchmarks/grid.py`` runs the jobs and writes the report; ``benchmarks/seed_experiment.py`` collects
cluster runs with the same cell statistics. :data:`DELAYS` are the straggler models, shared with the simulated grid
(``benchmarks/sim_grid.py``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from pgc_lab.experiments.results import RunRecords
from pgc_lab.experiments.spec import current_spec
from pgc_lab.experiments.stats import (
    PairedInterval,
    equal_wall_time,
    paired_t_interval,
    time_to_target,
    value_at_wall,
)

#: name -> delay model, ``{last}`` standing for the last rank (the map grid's models: log-normal with rare
#: stalls scaled to 1-3 s, one persistent slow rank, exponential with a mean about the step time).
DELAYS: dict[str, str] = {
    "lognormal + stalls": "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.002, low=1.0, high=3.0)",
    "one slow rank": "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[{last}], seconds=0.1)",
    "exponential": "exponential(mean=0.1)",
}
#: short keys of the straggler models of :data:`DELAYS`
DELAY_KEYS: dict[str, str] = {"lognormal + stalls": "stalls", "one slow rank": "slowrank", "exponential": "exp"}


@dataclass(frozen=True)
class Cost:
    """The cost of one partition gradient evaluation: a model size, a per-evaluation sleep and the batch."""

    key: str
    label: str
    compute_s_per_eval: float  # simulated compute (sleep) per evaluation, on top of the model's own
    model: tuple[tuple[str, Any], ...]  # DigitsCNN arguments
    batch_size: int  # per rank and partition
    note: str


COSTS: dict[str, Cost] = {
    c.key: c
    for c in (
        Cost(
            "sleep",
            "digits CNN 38k + 25 ms sleep",
            0.025,
            (),
            16,
            "the 38k-parameter CNN (about 3 ms per batch-16 gradient here) plus 25 ms of simulated compute",
        ),
        Cost(
            "real",
            "CNN width 256 (1.7M), real compute",
            0.0,
            (("width", 256),),
            16,
            "DigitsCNN(width=256): 1.7M parameters, real convolution compute, no sleep",
        ),
        Cost(
            "comm",
            "4.3M-param head, batch 4 (communication)",
            0.0,
            (("hidden", 8192),),
            4,
            "DigitsCNN(hidden=8192): 4.3M parameters (17 MB per gradient message) of which almost all sit in one "
            "linear layer, batch 4: little compute per message, so moving gradients dominates",
        ),
    )
}

#: StalenessValve settings of the adaptive arms: benchmarks/safety_valve.py's threshold, factor and floor, with a
#: cheaper probe (two gradients of 64 samples every 20 steps, about 0.4 batch-16 evaluations per step; its 256
#: samples every 5 steps cost several times the training compute of the ``real`` cost). Bounded lowers its window.
VALVE: dict[str, Any] = {
    "threshold": 1.0,
    "factor": 0.5,
    "check_every_n_steps": 20,
    "min_scale": 1 / 64,
    "probe_size": 64,
}
#: scheme families in table order
FAMILIES = ("ddp", "dgd", "ignore", "gc_fr", "gc_cr", "pgc_fr", "pgc_cr", "bounded")


@dataclass(frozen=True)
class GridArm:
    """A compared configuration: a scheme with its ``c`` (copies / window), optionally with the adaptive rule."""

    family: str
    c: int = 1
    adaptive: bool = False

    @property
    def key(self) -> str:
        return (
            self.family
            + (f"_c{self.c}" if self.family not in ("ddp", "dgd") else "")
            + ("_valve" if self.adaptive else "")
        )

    @property
    def label(self) -> str:
        text = self.family + (f" c={self.c}" if self.family not in ("ddp", "dgd") else "")
        if self.family == "bounded":
            text = f"bounded r=2 c={self.c}"
        return text + (" + valve" if self.adaptive else "")

    def strategy(self, seed: int) -> tuple[str, dict[str, Any], Optional[dict[str, Any]]]:
        """(strategy name, strategy kwargs, valve arguments or None) of this arm's jobs."""
        valve = None
        if self.adaptive:
            valve = {**VALVE, "action": "window"} if self.family == "bounded" else dict(VALVE)
        if self.family == "ddp":
            return "ddp", {}, None
        if self.family == "dgd":
            return "dgd", {"seed": seed}, None
        if self.family == "bounded":
            return "bounded_staleness", {"seed": seed, "coordinator": {"replication": 2, "staleness": self.c}}, valve
        name = "ignore_stragglers" if self.family == "ignore" else self.family
        return name, {"seed": seed, "stragglers": self.c - 1}, valve


def arms_for(
    n: int, cs: Sequence[int], families: Sequence[str] = FAMILIES, adaptive: Sequence[str] = ("pgc_cr", "bounded")
) -> tuple[list[GridArm], list[str]]:
    """The arms ``n`` ranks allow (``adaptive`` families also with the valve), and why the others are left out."""
    from lightning_pgc.codes import BoundedScheme, make_scheme

    arms: list[GridArm] = [GridArm(f) for f in ("ddp", "dgd") if f in families]
    skipped: list[str] = []
    for family in families:
        if family in ("ddp", "dgd"):
            continue
        for c in sorted(set(cs)):
            if c > n:
                skipped.append(f"{family} c={c}: needs n >= {c} ranks (n = {n})")
                continue
            try:
                if family == "bounded":
                    BoundedScheme(n, replication=2, staleness=c)
                else:
                    make_scheme(family, n, c - 1)
            except ValueError as err:
                skipped.append(f"{family} c={c}: {str(err).splitlines()[0][:100]}")
                continue
            arms.append(GridArm(family, c))
            if family in adaptive:
                arms.append(GridArm(family, c, adaptive=True))
    return arms, skipped


@dataclass(frozen=True)
class GridCell:
    """One cell of the map: a straggler model (a key of :data:`DELAYS`) and an evaluation cost."""

    delay: str
    cost: str

    @property
    def key(self) -> str:
        return f"{DELAY_KEYS[self.delay]}-{self.cost}"

    def delay_model(self, n: int) -> str:
        return DELAYS[self.delay].format(last=n - 1)


#: the recipe's SGD momentum (``DigitsModule``); the sweep's rates are given at it
RECIPE_MOMENTUM = 0.9

#: an arm's optimizer setting: (learning rate, SGD momentum)
Setting = tuple[float, float]


@dataclass(frozen=True)
class Job:
    """One run: a phase (``sweep`` or ``main``), a cell, an arm, a learning rate, a seed, the SGD momentum and, for
    main runs, the round."""

    phase: str
    cell: GridCell
    arm: GridArm
    lr: float
    seed: int
    momentum: float = RECIPE_MOMENTUM
    #: the main runs' round: a cell's paired comparisons are only made between runs of one round, run together
    #: (wall-clock ratios between sittings are off by the machine's drift, 12-22 % per step measured here)
    round: int = 1

    @property
    def name(self) -> str:
        # the recipe's momentum and round 1 are not named, so the records made before either existed keep their names
        m = "" if self.momentum == RECIPE_MOMENTUM else f"__m{self.momentum:g}"
        r = "" if self.round == 1 else f"__r{self.round}"
        return f"{self.phase}__{self.cell.key}__{self.arm.key}__lr{self.lr:g}{m}{r}__seed{self.seed}"

    @property
    def setting(self) -> Setting:
        return (self.lr, self.momentum)


def sweep_settings(lrs: Sequence[float], momenta: Sequence[float]) -> list[Setting]:
    """Every (rate, momentum) the sweep tries. ``lrs`` are rates at :data:`RECIPE_MOMENTUM`; at momentum ``m`` the
    sweep tries the same effective rates ``lr / (1 - m)`` (SGD's step size once momentum has built up), so that
    e.g. momentum 0 is not handicapped by rates ten times too small."""
    out = []
    for m in momenta:
        if not 0.0 <= m < 1.0:
            raise ValueError(f"a momentum must be in [0, 1), got {m}")
        out += [(round(lr * (1.0 - m) / (1.0 - RECIPE_MOMENTUM), 10), m) for lr in lrs]
    return out


def plan_sweep(
    cells: Sequence[GridCell],
    arms: Sequence[GridArm],
    lrs: Sequence[float],
    seeds: Sequence[int],
    sweep_delay: str,
    momenta: Sequence[float] = (RECIPE_MOMENTUM,),
) -> list[Job]:
    """The sweep: every arm at every setting of :func:`sweep_settings`, per evaluation cost, under one straggler
    model (``sweep_delay``)."""
    costs = list(dict.fromkeys(cell.cost for cell in cells))
    return [
        Job("sweep", GridCell(sweep_delay, cost), arm, lr, seed, m)
        for cost in costs
        for arm in arms
        for lr, m in sweep_settings(lrs, momenta)
        for seed in seeds
    ]


def choose_setting(finals: Mapping[Any, Sequence[Optional[float]]], runs: int) -> Any:
    """The rule, fixed before any result: the setting (a rate, or a :data:`Setting`) with the lowest mean final
    validation loss over the sweep's seeds; a failed or diverged run (``None``, NaN, inf) counts as +inf; ties go
    to the smaller rate (then the smaller momentum). ``None`` while any setting has fewer than ``runs`` finished
    runs (the sweep is incomplete)."""
    if not finals or any(len(v) < runs for v in finals.values()):
        return None

    def score(values: Sequence[Optional[float]]) -> float:
        clean = [v if v is not None and math.isfinite(v) else math.inf for v in values]
        return math.inf if math.inf in clean else statistics.fmean(clean)

    return min(sorted(finals), key=lambda setting: (score(finals[setting]), setting))


def plan_main(
    cells: Sequence[GridCell],
    arms: Sequence[GridArm],
    seeds: Sequence[int],
    setting_of: Mapping[tuple[str, str], Optional[Setting]],
    main_round: int = 1,
) -> tuple[list[Job], list[tuple[GridCell, GridArm]]]:
    """The main runs of round ``main_round`` at each arm's chosen setting (``setting_of[(cost, arm key)]``), and
    the (cell, arm) pairs that have none yet (their sweep is unfinished). Within a cell the order is seed, then
    arm: the runs a paired interval compares (same cell and seed) run back to back, so slow drift of a shared
    machine hits both sides alike. A new round (the sweep's choices changed) reruns every arm, not only the arms
    whose setting changed, so that no ratio compares runs of two sittings."""
    jobs, waiting = [], []
    for cell in cells:
        ready = []
        for arm in arms:
            setting = setting_of.get((cell.cost, arm.key))
            if setting is None:
                waiting.append((cell, arm))
            else:
                ready.append((arm, setting))
        jobs += [Job("main", cell, arm, lr, seed, m, main_round) for seed in seeds for arm, (lr, m) in ready]
    return jobs, waiting


# ================================================================================================ the store
class Store:
    """The raw per-run records, named by :attr:`Job.name`, in append-only JSON Lines files
    (:class:`~pgc_lab.experiments.results.RunRecords`): one file per round of main runs (``round<r>``) and one
    for the sweep (``sweep``).

    A record is reused only when its spec equals the job's (``wandb`` and ``out`` ignored; the strategy keywords of
    older records read in today's form, :func:`~pgc_lab.experiments.spec.current_spec`), so changing a setting
    reruns exactly the affected jobs; the rerun's record is appended and supersedes the earlier one.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.records = RunRecords(self.folder)

    @staticmethod
    def book(job: Job) -> str:
        """The file a job's record goes to: ``sweep``, or the main runs' ``round<r>``."""
        return "sweep" if job.phase == "sweep" else f"round{job.round}"

    def path(self, job: Job) -> Path:
        return self.records.path(self.book(job))

    @staticmethod
    def comparable(spec: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in spec.items() if k not in ("wandb", "out", "start_method")}

    def load(self, job: Job, spec: Optional[Mapping[str, Any]] = None) -> Optional[dict[str, Any]]:
        """The record of ``job`` (None if missing, or run with another spec than ``spec``)."""
        record = self.records.get(self.book(job), job.name)
        if record is None:
            return None
        if spec is not None and current_spec(dict(record.get("spec") or {})) != json.loads(
            json.dumps(self.comparable(current_spec(dict(spec))))
        ):
            return None
        return record

    def save(self, job: Job, spec: Mapping[str, Any], record: Mapping[str, Any]) -> Path:
        return self.records.append(self.book(job), [{"job": job.name, "spec": self.comparable(spec), **record}])


def compact_record(row: Mapping[str, Any], val: Iterable[Sequence[float]], ok: bool, error: str = "") -> dict[str, Any]:
    """What a record keeps: the per-run measurements (``runs.run_row``) and the validation curve (wall, step, loss,
    acc), floats rounded to 6 significant digits so the files stay small."""

    def r(x: Any) -> Any:
        return float(f"{x:.6g}") if isinstance(x, float) and math.isfinite(x) else x

    return {
        "ok": ok,
        "error": error[-500:],
        "row": {k: r(v) for k, v in row.items() if k != "out"},
        "val": [[r(float(v)) for v in point[:4]] for point in val],
    }


# ============================================================================================ the statistics
@dataclass
class ArmSummary:
    """One arm in one cell, over the cell's seeds."""

    arm: str
    label: str
    lr: Optional[float]
    momentum: Optional[float]
    runs: int
    ok: int
    reached: int
    time_to_target_s: float
    vs_dgd: Optional[PairedInterval]
    vs_ddp: Optional[PairedInterval]
    acc_at_equal_wall: float
    means: dict[str, float] = field(default_factory=dict)  # per-run columns averaged over the finished seeds
    #: ``vs_dgd`` split into why: the ratio of steps to the target (what staleness or dropped partitions cost)
    #: times the ratio of seconds per step up to it (what not waiting for stragglers, or extra work, buys or
    #: costs). Per seed the two multiply to the time ratio, so their estimates multiply to ``vs_dgd``'s.
    steps_vs_dgd: Optional[PairedInterval] = None
    step_time_vs_dgd: Optional[PairedInterval] = None

    def as_dict(self) -> dict[str, Any]:
        intervals = ("vs_dgd", "vs_ddp", "steps_vs_dgd", "step_time_vs_dgd")
        out = {k: v for k, v in self.__dict__.items() if k not in intervals}
        for k in intervals:
            iv = getattr(self, k)
            out[k] = iv.as_dict() if iv else None
        return out


#: per-run columns averaged into ArmSummary.means (row keys of ``runs.run_row`` and the error decomposition)
MEAN_COLUMNS = (
    "grad_evals_to_target",
    "gflop_to_target",
    "grad_evals_per_step",
    "utilization_mean",
    "max_age",
    "mean_age",
    "fit_wall_s",
    "final_val_loss",
    "final_val_acc",
    "staleness_ratio",
)


def _ttt(record: Mapping[str, Any], target: float, axis: int = 0) -> Optional[float]:
    """Time (``axis`` 0, the wall column of ``val``) or optimizer steps (``axis`` 1) to the target validation loss,
    linear between two evaluations; ``None`` for a failed run or one that never reached it."""
    val = record.get("val") or []
    return time_to_target([p[axis] for p in val], [p[2] for p in val], target) if record.get("ok") else None


def _per_step(times: Sequence[Optional[float]], steps: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Seconds per optimizer step up to the target, per seed (``None`` where either is missing or zero)."""
    return [t / k if t is not None and k else None for t, k in zip(times, steps)]


def _paired(x: Sequence[Optional[float]], y: Sequence[Optional[float]]) -> Optional[PairedInterval]:
    """Paired t ratio interval of x over y when both have a positive value on every seed (>= 2 seeds)."""
    if len(x) < 2 or len(x) != len(y) or any(v is None or v <= 0 for v in (*x, *y)):
        return None
    return paired_t_interval(x, y, ratio=True)  # type: ignore[arg-type]


def summarize_cell(
    records: Mapping[str, Mapping[int, Mapping[str, Any]]],
    arms: Sequence[GridArm],
    seeds: Sequence[int],
    target: float,
    settings: Mapping[str, Optional[Setting]],
) -> dict[str, Any]:
    """A cell's statistics from its main-run records (``records[arm key][seed]``).

    Complete when every arm has a finished record for every seed; otherwise ``status`` is ``"incomplete"`` with
    the count, and no winner is named. The winner is the arm with the lowest geometric-mean time to the target
    validation loss among the arms that reached it on every seed; its margin is the paired ratio (t interval)
    of its time over the runner-up's (below 1: faster). An arm that missed the target on a seed can neither win
    nor get a ratio interval (its ``reached`` says so); nor can one whose first evaluation is already at the
    target (time 0: set the target below every arm's initial validation loss). ``steps_vs_dgd`` and
    ``step_time_vs_dgd`` split the ratio against ``dgd`` into steps to the target and seconds per step (see
    :class:`ArmSummary`). ``means`` averages the per-run columns of :data:`MEAN_COLUMNS` and, per term, the
    error decomposition the scheme logged.
    """
    expected = len(arms) * len(seeds)
    finished = sum(1 for arm in arms for s in seeds if s in records.get(arm.key, {}))
    ok_runs = sum(1 for arm in arms for s in seeds if records.get(arm.key, {}).get(s, {}).get("ok"))
    ends: dict[int, float] = {}
    for arm in arms:
        for s in seeds:
            rec = records.get(arm.key, {}).get(s)
            if rec and rec.get("ok") and rec.get("val"):
                ends[s] = equal_wall_time([ends.get(s, math.inf), rec["val"][-1][0]])
    times = {arm.key: [_ttt(records.get(arm.key, {}).get(s, {}), target) for s in seeds] for arm in arms}
    steps = {arm.key: [_ttt(records.get(arm.key, {}).get(s, {}), target, axis=1) for s in seeds] for arm in arms}
    step_times = {key: _per_step(times[key], steps[key]) for key in times}
    summaries: list[ArmSummary] = []
    for arm in arms:
        mine = [records.get(arm.key, {}).get(s) for s in seeds]
        done = [r for r in mine if r is not None]
        good = [r for r in done if r.get("ok")]
        reached = [t for t in times[arm.key] if t is not None]
        accs = []
        for s, r in zip(seeds, mine):
            if r and r.get("ok") and s in ends:
                acc = value_at_wall([p[0] for p in r["val"]], [p[3] for p in r["val"]], ends[s])
                if acc is not None:
                    accs.append(acc)
        means = {}
        for key in MEAN_COLUMNS:
            values = [
                r["row"][key]
                for r in good
                if isinstance(r["row"].get(key), (int, float)) and math.isfinite(r["row"][key])
            ]
            means[key] = statistics.fmean(values) if values else math.nan
        terms: dict[str, list[float]] = {}
        for r in good:
            for k, v in (r["row"].get("error_decomposition") or {}).items():
                terms.setdefault(k, []).append(v)
        means["error_decomposition"] = {k: statistics.fmean(v) for k, v in sorted(terms.items())}  # type: ignore
        lr, momentum = settings.get(arm.key) or (None, None)
        summaries.append(
            ArmSummary(
                arm.key,
                arm.label,
                lr,
                momentum,
                len(done),
                len(good),
                len(reached),
                math.exp(statistics.fmean(math.log(t) for t in reached)) if reached and min(reached) > 0 else math.nan,
                _paired(times[arm.key], times.get("dgd", [])) if arm.key != "dgd" else None,
                _paired(times[arm.key], times.get("ddp", [])) if arm.key != "ddp" else None,
                statistics.fmean(accs) if accs else math.nan,
                means,
                _paired(steps[arm.key], steps.get("dgd", [])) if arm.key != "dgd" else None,
                _paired(step_times[arm.key], step_times.get("dgd", [])) if arm.key != "dgd" else None,
            )
        )
    cell: dict[str, Any] = {
        "runs_expected": expected,
        "runs_finished": finished,
        "runs_ok": ok_runs,
        "arms": [a.as_dict() for a in summaries],
        "winner": None,
        "runner_up": None,
        "margin": None,
    }
    if finished < expected:
        cell["status"] = "incomplete"
        return cell
    cell["status"] = "complete"
    contenders = sorted(
        (a for a in summaries if a.reached == len(seeds) and math.isfinite(a.time_to_target_s)),
        key=lambda a: a.time_to_target_s,
    )
    if not contenders:
        cell["status"] = "no arm reached the target on every seed"
        return cell
    cell["winner"] = contenders[0].arm
    if len(contenders) > 1:
        cell["runner_up"] = contenders[1].arm
        margin = _paired(times[contenders[0].arm], times[contenders[1].arm])
        cell["margin"] = margin.as_dict() if margin else None
    return cell


# ============================================================================================== rendering
MARK_BEGIN = "<!-- gridmap:begin (generated by benchmarks/grid.py; edits between the markers are overwritten) -->"
MARK_END = "<!-- gridmap:end -->"


def _num(x: Optional[float], spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _interval(iv: Optional[Mapping[str, Any]]) -> str:
    if not iv:
        return "-"
    return f"{iv['estimate']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}]"


def map_cell_text(cell: Mapping[str, Any]) -> str:
    """What the map shows for one cell: the winner with its margin and interval, or why there is none."""
    if cell["status"] == "incomplete":
        return f"incomplete ({cell['runs_finished']}/{cell['runs_expected']} runs)"
    failed = cell["runs_finished"] - cell["runs_ok"]
    note = f" ({failed} failed runs)" if failed else ""
    if cell["winner"] is None:
        return cell["status"] + note
    text = f"**{cell['winner']}**"
    if cell["runner_up"]:
        text += f" over {cell['runner_up']}: {_interval(cell['margin'])}"
        if not separated(cell["margin"]):
            text += " (not separated)"
    return text + note


def separated(margin: Optional[Mapping[str, Any]]) -> bool:
    """Whether a margin's interval excludes 1 (no interval, e.g. one seed: not separated)."""
    return bool(margin) and (margin["high"] < 1.0 or margin["low"] > 1.0)  # type: ignore[index]


def cell_table(cell: Mapping[str, Any]) -> str:
    """One cell's arms: setting, reach, time to target, paired ratios against dgd (with its split into steps and
    seconds per step) and ddp, and the work columns."""
    lines = [
        "| arm | lr | momentum | reached | time to target (s) | vs dgd | = steps vs dgd | x s/step vs dgd | "
        "vs ddp | val acc at equal wall | grad evals to target | utilization | max age |",
        "|---|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    for a in cell["arms"]:
        m = a["means"]
        lines.append(
            f"| {a['label']} | {_num(a['lr'], 'g')} | {_num(a.get('momentum'), 'g')} | "
            f"{a['reached']}/{a['runs']} | "
            f"{_num(a['time_to_target_s'], '.2f')} | {_interval(a['vs_dgd'])} | "
            f"{_interval(a.get('steps_vs_dgd'))} | {_interval(a.get('step_time_vs_dgd'))} | "
            f"{_interval(a['vs_ddp'])} | {_num(a['acc_at_equal_wall'], '.3f')} | "
            f"{_num(m['grad_evals_to_target'], '.0f')} | {_num(m['utilization_mean'], '.2f')} | "
            f"{_num(m['max_age'], '.0f')} |"
        )
    return "\n".join(lines)


def against_dgd_text(arm: Mapping[str, Any]) -> str:
    """One arm's paired time ratio against ``dgd`` in a cell, marked **faster** or slower where its interval
    excludes 1; an arm that missed the target on a seed has no interval."""
    if arm["reached"] < arm["runs"] or not arm["vs_dgd"]:
        return f"reached {arm['reached']}/{arm['runs']}"
    iv = arm["vs_dgd"]
    text = _interval(iv)
    return f"**{text} faster**" if iv["high"] < 1.0 else f"{text} slower" if iv["low"] > 1.0 else text


def arms_table(cells: Mapping[str, Mapping[str, Any]], keys: Sequence[str]) -> str:
    """Every arm (``dgd`` aside) against ``dgd`` in each of the cells ``keys``: where each scheme wins and loses."""
    labels = {a["arm"]: a["label"] for key in keys for a in cells[key]["arms"]}
    by_cell = {key: {a["arm"]: a for a in cells[key]["arms"]} for key in keys}
    lines = ["| arm | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for arm, label in labels.items():
        if arm == "dgd":
            continue
        row = [against_dgd_text(by_cell[k][arm]) if arm in by_cell[k] else "-" for k in keys]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_markdown(result: Mapping[str, Any]) -> str:
    """The generated block of docs/results/benchmarks.md from the grid's result (``docs/results/grid_map.json``) alone."""
    s = result["settings"]
    cells = result["cells"]
    complete = [k for k, c in cells.items() if c["status"] != "incomplete"]
    lines = [
        MARK_BEGIN,
        "",
        f"Rendered {result['rendered']} from the run records in `{result['runs_folder']}` "
        f"({result['records']} records) by `{result['command']}`; everything below is in "
        "[grid_map.json](grid_map.json).",
        "",
        f"- **Complete cells: {len(complete)} of {len(cells)}**"
        + (f" ({', '.join(complete)})." if complete else ". No cell is complete: no winner is named yet."),
        f"- Sweep: {result['sweep_runs_finished']} of {result['sweep_runs_expected']} runs finished; rates "
        f"{s['lrs']} at momentum {RECIPE_MOMENTUM}"
        + "".join(
            f", the same effective rates (lr / (1 - m)) at momentum {m:g}"
            for m in s.get("momenta", [RECIPE_MOMENTUM])
            if m != RECIPE_MOMENTUM
        )
        + f"; seeds {s['sweep_seeds']}, {s['sweep_steps']} steps, under `{s['sweep_delay']}`.",
        f"- Main runs: round {s.get('round', 1)}, n = {s['devices']} CPU ranks, {s['steps']} steps, seeds "
        f"{s['seeds']}, target validation loss {s['target']}, validation every {s['val_every']} steps.",
        "- Winner: lowest geometric-mean time to the target validation loss among arms that reached it on "
        "every seed; margin: the paired ratio of its time over the runner-up's with a 95 % t interval "
        "over the seeds (below 1: faster).",
        "- Why, per arm: `vs dgd` = `steps vs dgd` x `s/step vs dgd` (paired over the seeds, up to the "
        "target): steps to the target measure what staleness or dropped partitions cost, seconds per step "
        "what not waiting for stragglers (or extra work per step) buys or costs.",
        "",
        "| straggler model | " + " | ".join(result["cost_labels"][c] for c in result["costs"]) + " |",
        "|---|" + "---|" * len(result["costs"]),
    ]
    for delay in result["delays"]:
        row = [delay]
        for cost in result["costs"]:
            key = f"{DELAY_KEYS[delay]}-{cost}"
            row.append(map_cell_text(cells[key]) if key in cells else "not planned")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "![crossover map](grid_map.png)", ""]
    if complete:
        lines += [
            "Every arm's time to the target against `dgd`'s in each complete cell (paired ratio, 95 % t "
            "interval over the seeds; **faster** or slower: the interval excludes 1):",
            "",
            arms_table(cells, complete),
            "",
        ]
    for key in complete:
        cell = cells[key]
        lines += [f"Cell `{key}` (all {cell['runs_expected']} runs finished):", "", cell_table(cell)]
        lines.append("")
    if result["skipped"]:
        lines += ["Not run: " + "; ".join(result["skipped"]) + ".", ""]
    lines.append(MARK_END)
    return "\n".join(lines)


def plot_map(result: Mapping[str, Any]) -> Any:
    """The heat map: one square per cell, coloured by the winner's family (grey: incomplete or no winner),
    annotated with the winner, its margin over the runner-up and the interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    delays, costs, cells = result["delays"], result["costs"], result["cells"]
    colors = {f: f"C{i}" for i, f in enumerate(FAMILIES)}
    fig, ax = plt.subplots(figsize=(3.2 * len(costs) + 3.0, 1.6 * len(delays) + 1.8))
    used = set()
    for i, delay in enumerate(delays):
        for j, cost in enumerate(costs):
            cell = cells.get(f"{DELAY_KEYS[delay]}-{cost}")
            winner = cell["winner"] if cell else None
            family = next((f for f in sorted(FAMILIES, key=len, reverse=True) if winner and winner.startswith(f)), None)
            if family:
                used.add(family)
            ax.add_patch(
                plt.Rectangle(
                    (j, i),
                    1,
                    1,
                    color=colors[family] if family else "0.85",
                    alpha=0.55 if family else 1.0,
                    ec="white",
                    lw=2,
                )
            )
            if cell is None:
                text = "not planned"
            elif cell["status"] == "incomplete":
                text = f"incomplete\n{cell['runs_finished']}/{cell['runs_expected']} runs"
            elif winner is None:
                text = "no arm reached\nthe target on\nevery seed"
            else:
                text = winner
                if cell["margin"]:
                    m = cell["margin"]
                    text += f"\n{m['estimate']:.2f}x {cell['runner_up']}\n[{m['low']:.2f}, {m['high']:.2f}]"
                    text += "" if separated(m) else "\nnot separated"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(costs))
    ax.set_ylim(len(delays), 0)
    ax.set_xticks([j + 0.5 for j in range(len(costs))], [result["cost_labels"][c] for c in costs], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(delays))], delays, fontsize=8)
    ax.set_xlabel("cost of a gradient evaluation")
    ax.set_ylabel("straggler model")
    if used:
        ax.legend(
            handles=[Patch(color=colors[f], alpha=0.55, label=f) for f in FAMILIES if f in used],
            loc="upper left",
            bbox_to_anchor=(1.01, 1),
            fontsize=8,
        )
    ax.set_title(
        f"fastest to validation loss {result['settings']['target']} (n = {result['settings']['devices']},"
        f" {len(result['settings']['seeds'])} seeds)\nmargin: paired time ratio vs the runner-up, 95 % t "
        "interval; grey: incomplete",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
