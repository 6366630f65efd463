"""The confirmation stage of the emulated map: the screen's candidate, its runner-up and ddp again, on fresh seeds.

The screen (every arm of a cell on the round's evaluation seeds, :mod:`~lightning_pgc.emulator.summary`) tests some
40 arms against ddp under one Holm family; with the spread of the per-seed log ratios the map measures, its 20 seeds
detect about 15-20 % effects there, not 10 %. So each cell has a second, confirmatory stage, planned from the screen
alone before it runs: the *candidate* (the ranked arm with the smallest restricted mean late time), its *runner-up*
(the next best ranked arm at the same ``s``) and ddp, at the settings the screen tuned (no tuning), on
:data:`CONFIRM_FIRST` onwards, seeds disjoint from the screen's tuning and evaluation seeds. Their number is what the
power computation asks for a 10 % effect with a family of two tests (candidate vs ddp, candidate vs runner-up) from
the screen's spread (:func:`~lightning_pgc.emulator.scoring.required_seeds`), within :data:`CONFIRM_SEEDS`.

The decision is the confirmation's alone (the screen chose what to test, the fresh seeds test it): the candidate wins
its cell when it beats ddp with a Holm-adjusted p below ``alpha`` over the two tests; it is ``separated`` from its
runner-up when that test is below ``alpha`` too. A cell whose screen ranked nothing (ddp a bound, or no ranked arm)
is not confirmed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from lightning_pgc.emulator.cells import MapArm, MapCell, Protocol
from lightning_pgc.emulator.scoring import compare, detectable_effect, holm, required_seeds
from lightning_pgc.emulator.summary import ALPHA, EFFECT, POWER, cell_label

__all__ = ["CONFIRM_FIRST", "CONFIRM_SEEDS", "arm_of", "confirm_plan", "confirm_summary"]

#: the first seed of the confirmation (above every screen seed)
CONFIRM_FIRST = 100
#: the fewest and the most seeds a cell's confirmation runs
CONFIRM_SEEDS: tuple[int, int] = (40, 160)


def arm_of(record: dict[str, Any]) -> MapArm:
    """The :class:`~lightning_pgc.emulator.cells.MapArm` a record's ``arm`` field states."""
    a = record["arm"]
    return MapArm(
        a["strategy"],
        a["c"],
        a.get("correction", "none"),
        a.get("lookahead_steps"),
        a.get("dc_lambda", 0.04),
        a.get("replication", 2),
    )


def _cell_of(record: dict[str, Any]) -> MapCell:
    c = dict(record["cell"])
    for key in ("costs", "cs", "fixed"):
        if c.get(key) is not None:
            c[key] = tuple(tuple(x) if isinstance(x, list) else x for x in c[key])
    return MapCell(**c)


def confirm_plan(
    summary: dict[str, Any], records: Sequence[dict[str, Any]], protocol: Protocol
) -> list[tuple[MapCell, list[MapArm], Protocol]]:
    """Per screened cell (not the mirror cells): the cell with the three arms' settings fixed, the arms, and the
    confirmation's protocol (``protocol`` with its evaluation seeds replaced)."""
    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_cell.setdefault(cell_label(r["cell"]), {})[r["arm"]["label"]] = r
    plan = []
    for cell in summary["cells"]:
        if not cell["complete"] or cell["cell"].get("fixed") is not None or cell["ddp_missed"]:
            continue
        ranked = [a for a in cell["arms"] if a.get("vs_ddp_late") and a["vs_ddp_late"]["p_holm"] is not None]
        if not ranked:
            continue
        candidate = min(ranked, key=lambda a: (a["rmean_late_s"], a["arm"]))
        same_s = sorted(
            (a for a in ranked if a["s"] == candidate["s"] and a["arm"] != candidate["arm"]),
            key=lambda a: (a["rmean_late_s"], a["arm"]),
        )
        chosen = [cell["ddp"], candidate] + same_s[:1]
        recs = by_cell[cell["label"]]
        sd = candidate["vs_ddp_late"].get("sd_log", 0.0)
        if same_s:
            sd = max(
                sd,
                compare(
                    recs[candidate["arm"]]["eval"]["time_late"],
                    recs[same_s[0]["arm"]]["eval"]["time_late"],
                    cell["budget_s"],
                ).sd_log,
            )
        seeds = min(CONFIRM_SEEDS[1], max(CONFIRM_SEEDS[0], required_seeds(sd, EFFECT, 2, ALPHA, POWER)))
        base = _cell_of(recs["ddp"])
        fixed = tuple((a["arm"], a["lr"], a["momentum"]) for a in chosen)
        arms = [arm_of(recs[a["arm"]]) for a in chosen]
        plan.append(
            (
                replace(base, fixed=fixed),
                arms,
                replace(protocol, eval_seeds=tuple(range(CONFIRM_FIRST, CONFIRM_FIRST + seeds))),
            )
        )
    return plan


def confirm_summary(records: Sequence[dict[str, Any]], alpha: float = ALPHA) -> dict[str, dict[str, Any]]:
    """Per cell label: the confirmation's candidate, runner-up and their comparisons on its seeds (ratio, interval,
    raw and Holm-adjusted p over the two tests), whether the candidate wins, and how sure."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_cell.setdefault(cell_label(r["cell"]), []).append(r)
    out = {}
    for label, recs in by_cell.items():
        # a cell confirmed again (its screen gained an arm) keeps only its newest plan's records
        plan = recs[-1]["cell"]["fixed"]
        recs = [r for r in recs if r["cell"]["fixed"] == plan]
        order = [f[0] for f in plan]  # ddp, the candidate, the runner-up (if any)
        by_label = {r["arm"]["label"]: r for r in recs}
        if any(name not in by_label for name in order):
            continue  # not finished
        budget = recs[0]["budget_s"]
        ddp, cand = by_label[order[0]], by_label[order[1]]
        runner: Optional[dict[str, Any]] = by_label[order[2]] if len(order) > 2 else None
        tests = [compare(cand["eval"]["time_late"], ddp["eval"]["time_late"], budget)]
        if runner is not None:
            tests.append(compare(cand["eval"]["time_late"], runner["eval"]["time_late"], budget))
        adjusted = holm([t.p for t in tests])
        rows = [
            {
                "ratio": t.ratio,
                "low": t.low,
                "high": t.high,
                "p": t.p,
                "p_holm": p,
                "seeds": t.seeds,
                "sd_log": t.sd_log,
            }
            for t, p in zip(tests, adjusted)
        ]
        vs_ddp, vs_runner = rows[0], (rows[1] if runner is not None else None)
        wins = vs_ddp["ratio"] < 1 and vs_ddp["p_holm"] < alpha
        separated = vs_runner is not None and vs_runner["ratio"] < 1 and vs_runner["p_holm"] < alpha
        if wins:
            sure = (
                "confirmed; separated from the runner-up"
                if separated
                else "confirmed; not separated from the runner-up"
            )
        elif vs_ddp["ratio"] < 1:
            sure = "not confirmed: not separably faster than ddp on fresh seeds"
        elif vs_ddp["p_holm"] < alpha:
            sure = "ddp is faster: the best other arm is separably slower than ddp on fresh seeds"
        else:
            sure = "not confirmed: not faster than ddp on fresh seeds"
        out[label] = {
            "candidate": cand["arm"]["label"],
            "strategy": cand["arm"]["strategy"],
            "s": cand["arm"]["s"],
            "lr": cand["tuning"]["chosen"]["lr"],
            "momentum": cand["tuning"]["chosen"]["momentum"],
            "runner_up": None if runner is None else runner["arm"]["label"],
            "seeds": vs_ddp["seeds"],
            "vs_ddp": vs_ddp,
            "vs_runner_up": vs_runner,
            "wins": wins,
            "sure": sure,
            "detectable_effect": detectable_effect(
                max(t.sd_log for t in tests), tests[0].seeds, len(tests), alpha, POWER
            ),
        }
    return out
