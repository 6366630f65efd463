"""The demo's race: its arms (the default race's and the full race's), each at its own tuned setting, its two cells
of the map grid, and how a race is judged (the winner of the run, the map's verdict over its seeds, the guide's
row). No Lightning, nothing run here: :mod:`pgc_lab.demo` runs the race and prints it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional

ROOT = Path(__file__).resolve().parents[2]
#: the map grid's rendered results, when this is a checkout (not part of an installed package)
MAP = ROOT / "docs" / "results" / "grid_map.json"
#: the staleness benchmark's results: the tuning of the corrected arm, which the map grid does not sweep
STALENESS = ROOT / "docs" / "results" / "staleness.json"
#: the recipe's SGD momentum (``DigitsModule``): not written into a job's model arguments, as in the map grid
RECIPE_MOMENTUM = 0.9
#: the map grid's cost of both cells: simulated compute per gradient evaluation
COMPUTE_S_PER_EVAL = 0.025


@dataclass(frozen=True)
class DemoArm:
    """One strategy of the race, at the learning rate and momentum its tuning chose."""

    key: str  # what ``--only`` names
    label: str
    strategy: str  # a registered strategy name
    stragglers: Optional[int]  # s of a coded scheme (``staleness`` for bounded_staleness); None for ddp
    lr: float
    momentum: float
    map_arm: str  # the map grid's arm key (``crossover.GridArm.key``): its setting, or the uncorrected arm's
    tuned_by: str  # where ``lr`` and ``momentum`` come from
    correction: dict[str, Any] = field(default_factory=dict, hash=False)  # the ``coding`` group's correction and k
    #: the staleness benchmark's arm (its label in docs/results/staleness.json) whose tuned setting this arm runs
    #: at; None: the map grid's sweep chose it
    staleness_arm: Optional[str] = None

    @property
    def in_map(self) -> bool:
        """Whether the map grid ran this arm itself (not a corrected arm, not ``pgc_auto``)."""
        return self.staleness_arm is None and self.strategy != "pgc_auto"

    def strategy_kwargs(self, seed: int) -> dict[str, Any]:
        if self.strategy == "ddp":
            return {}
        if self.strategy == "bounded_staleness":
            assert self.stragglers is not None
            return {"seed": seed, "coordinator": {"replication": 2, "staleness": self.stragglers + 1}}
        if self.strategy == "pgc_auto":
            return {"seed": seed, "auto": {"max_stragglers": self.stragglers}}
        return {"seed": seed, "stragglers": self.stragglers, **self.correction}


@dataclass(frozen=True)
class Setting:
    """A cell of the map grid the demo races in, and what the map and the guide say of it."""

    key: str  # what ``--settings`` names
    title: str
    map_cell: str
    delay: str  # the straggler model (``sim_grid.DELAYS``, for 4 ranks)
    why: str  # what this cell shows, from the map
    guide_row: str  # the README "Which strategy" row for this kind of cluster
    guide_note: str  # how the guide's row relates to this 4-rank cell

    @property
    def headline(self) -> str:
        return f"{self.title} (map cell {self.map_cell})"


GRID = "the map grid's sweep (docs/results/grid_map.json)"
#: the staleness benchmark's look-ahead arm: pgc_fr c=2 with look-ahead k=1, one slow rank, 4 real ranks
LOOKAHEAD = "pgc_fr c=2 lookahead k=1"
STALENESS_SWEEP = "the staleness benchmark's sweep (docs/results/staleness.json)"
#: every arm the demo can race (``--arms all``), in run order
ARMS: tuple[DemoArm, ...] = (
    DemoArm("ddp", "ddp", "ddp", None, 0.1, 0.9, "ddp", GRID),
    DemoArm("ignore", "ignore_stragglers c=2", "ignore_stragglers", 1, 0.5, 0.0, "ignore_c2", GRID),
    DemoArm("gc", "gc_fr c=2", "gc_fr", 1, 0.1, 0.9, "gc_fr_c2", GRID),
    DemoArm("pgc_fr", "pgc_fr c=2", "pgc_fr", 1, 0.5, 0.0, "pgc_fr_c2", GRID),
    DemoArm(
        "pgc_fr_lookahead",
        "pgc_fr c=2 + lookahead k=1",
        "pgc_fr",
        1,
        0.1,
        0.9,
        "pgc_fr_c2",
        STALENESS_SWEEP,
        {"coding": {"staleness_correction": "lookahead", "lookahead_steps": 1.0}},
        staleness_arm=LOOKAHEAD,
    ),
    # the registered name: pgc_cr (s=1) with look-ahead at its default k = c - 1 = 1. The map grid swept pgc_cr
    # only uncorrected and the staleness benchmark only pgc_fr: the look-ahead arm's setting there
    DemoArm(
        "pgc",
        "pgc (pgc_cr c=2 + lookahead k=1)",
        "pgc",
        1,
        0.1,
        0.9,
        "pgc_cr_c2",
        f"the look-ahead arm ({LOOKAHEAD}) of {STALENESS_SWEEP}: the map grid did not sweep pgc_cr with look-ahead",
        staleness_arm=LOOKAHEAD,
    ),
    DemoArm("bounded", "bounded_staleness r=2 c=2", "bounded_staleness", 1, 0.05, 0.9, "bounded_c2", GRID),
    # starts as dgd and keeps the user's optimizer: dgd's tuned setting
    DemoArm("auto", "pgc_auto max_stragglers=1", "pgc_auto", 1, 0.1, 0.9, "dgd", GRID),
)
#: the arms ``make demo`` races (``--arms default``): the ones a user weighs, ``pgc`` the recommended pipelined arm
DEFAULT_ARMS: tuple[str, ...] = ("ddp", "ignore", "pgc", "bounded", "auto")
#: the arm sets ``--arms`` names
ARM_SETS: dict[str, tuple[str, ...]] = {"default": DEFAULT_ARMS, "all": tuple(a.key for a in ARMS)}
#: how the race's pgc arm is tuned, against the guide's MLP tuning
PGC_TUNING = " (at the digits CNN's look-ahead tuning, not the MLP's)"
SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            "slow",
            "one slow rank",
            "slowrank-sleep",
            "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[3], seconds=0.1)",
            "rank 3 is 0.1 s slower on every step. Every tolerant arm stops waiting for it and pays with dropped or "
            "one-version-old gradients (an exact gradient code, gc_fr in the full race, pays a second gradient per "
            "step instead). 4 ranks share 2 cores: the sleeping rank frees a core, which flatters every arm that does "
            "not wait for it.",
            "one node is persistently slower",
            "the guide's row for 4 workers (docs/guide.md, emulated on the digits MLP) recommends pgc_cr c=2 with "
            f"look-ahead, the registered pgc this race runs{PGC_TUNING}",
        ),
        Setting(
            "rare",
            "stragglers are rare",
            "stalls-sleep",
            "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.002, low=1.0, high=3.0)",
            "small jitter and a 1-3 s stall with probability 0.002 per rank and step: there is little waiting to "
            "hide, so what a tolerant arm saves per step is about what its dropped or stale gradients cost in steps.",
            "single workers stall for 1-3 s now and then",
            "the guide's row for 4 workers (docs/guide.md, emulated on the digits MLP) recommends pgc_cr c=2 with "
            f"look-ahead, the registered pgc this race runs{PGC_TUNING}, under its own stall model "
            "(docs/results/emulator.md, rank stalls); this cell's stalls come with probability 0.002 per rank and step",
        ),
    )
}


@dataclass
class Outcome:
    """One strategy's result in one setting, read from the files its job wrote."""

    label: str
    wall_s: float
    steps: int
    time_to_target: Optional[float]  # wall seconds at the first crossing of the target validation loss (linear)
    steps_to_target: Optional[float]  # the step at that crossing (fractional)
    val_acc: float
    final_loss: float  # the last validation loss
    curve: list[tuple[float, int, float]]  # (wall, step, decoded training loss): not used for the target
    skipped: list[int]
    identical: bool
    val_curve: list[tuple[float, int, float]] = field(default_factory=list)  # (wall, step, validation loss)
    job_wall_s: float = math.nan  # the whole job: its processes' start to their exit
    setting: str = ""  # a key of SETTINGS
    key: str = ""  # the arm's key
    lr: float = math.nan
    momentum: float = math.nan
    #: the map's paired ratio to ddp over its seeds (estimate, low, high, seeds), when docs/results/grid_map.json is there
    map_vs_ddp: Optional[dict[str, Any]] = None

    @property
    def s_per_step(self) -> Optional[float]:
        """Seconds per step up to the target (the map grid's per-step split)."""
        if self.time_to_target is None or not self.steps_to_target:
            return None
        return self.time_to_target / self.steps_to_target


def map_reference(path: Path = MAP) -> dict[tuple[str, str], dict[str, Any]]:
    """(cell, arm) -> the map's paired ratio of time to target against ddp, from ``grid_map.json`` (empty if
    absent)."""
    if not path.is_file():
        return {}
    cells = json.loads(path.read_text())["cells"]
    return {
        (cell, a["arm"]): {k: a["vs_ddp"][k] for k in ("estimate", "low", "high", "seeds")}
        for cell, c in cells.items()
        for a in c["arms"]
        if a.get("vs_ddp")
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def split_vs_ddp(o: Outcome, outcomes: list[Outcome]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(time, steps, seconds per step) to the target as ratios to ddp's in the same setting (None: not reached,
    or ddp not run)."""
    ddp = next((d for d in outcomes if d.setting == o.setting and d.key == "ddp"), None)
    if ddp is None:
        return None, None, None
    return (
        _ratio(o.time_to_target, ddp.time_to_target),
        _ratio(o.steps_to_target, ddp.steps_to_target),
        _ratio(o.s_per_step, ddp.s_per_step),
    )


def map_winner(
    setting: Setting, path: Path = MAP, keys: Optional[Collection[str]] = None
) -> Optional[tuple[DemoArm, dict[str, Any]]]:
    """The race's arm (of those ``keys`` names; default: every arm) the map finds fastest against ddp in this cell
    (smallest paired ratio), with that ratio; None without the map's file or an arm the map ran."""
    reference = map_reference(path)
    rated = [
        (a, reference[(setting.map_cell, a.map_arm)])
        for a in ARMS
        if a.in_map
        and a.key != "ddp"
        and (keys is None or a.key in keys)
        and (setting.map_cell, a.map_arm) in reference
    ]
    return min(rated, key=lambda ar: ar[1]["estimate"]) if rated else None


def verdict(setting: Setting, outcomes: list[Outcome], path: Path = MAP) -> str:
    """The winner of this run in ``setting`` (and its ratio to ddp, split into steps and seconds per step), the
    map's verdict over its seeds on the arms this run raced, whether the two disagree, and the guide's row."""
    mine = [o for o in outcomes if o.setting == setting.key]
    reached = [o for o in mine if o.time_to_target is not None]
    if not reached:
        text = "This run: no arm reached the target."
        best = None
    else:
        best = min(reached, key=lambda o: o.time_to_target or math.inf)
        text = f"This run: {best.label} reached the target first, in {best.time_to_target:.1f} s"
        time, steps, per_step = split_vs_ddp(best, outcomes)
        if best.key != "ddp" and time is not None and steps is not None and per_step is not None:
            text += f" ({time:.2f}x ddp's time: {steps:.2f}x its steps at {per_step:.2f}x its seconds per step)"
        text += "."
    found = map_winner(setting, path, {o.key for o in mine})
    if found is not None:
        arm, m = found
        text += f" The map over {m['seeds']} seeds, of the arms raced here: {arm.label} is fastest at "
        text += f"{m['estimate']:.2f}x ddp's time "
        text += f"[{m['low']:.2f}, {m['high']:.2f}]"
        if m["high"] < 1:
            text += "."
            winner = next((a for a in ARMS if best is not None and a.key == best.key), None)
            if winner is not None and not winner.in_map:
                text += f" The map grid did not run {winner.label}, so it has no verdict on this run's winner."
            elif best is not None and best.key != arm.key:
                text += " This run disagrees with the map: one seed on a shared 2-core machine, where the map has 5."
        else:
            text += ", and no arm is separably faster than ddp: a different winner in one seed is noise."
    text += f' The guide\'s row: "{setting.guide_row}" ({setting.guide_note}).'
    return text
