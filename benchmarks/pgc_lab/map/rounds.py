"""The rounds of the emulated crossover map: the cells and tuning protocol of each, which round the docs show, and
what a round costs in CPU time.

The cells that mirror the real 4-rank map read it (``docs/results/grid_map.json``: each arm's chosen lr and momentum) and the
simulated clock's fit to real runs (``docs/results/sim_validation.json``), so the rounds need a checkout's ``docs/results/``.
``benchmarks/emulated_map.py`` runs a round, ``benchmarks/emulated_render.py`` renders it (and its :func:`cost`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_pgc.emulator.cells import MapCell, Protocol
from lightning_pgc.emulator.cluster import PATTERNS
from pgc_lab.map.crossmap import plan_items, read_records
from lightning_pgc.emulator.summary import cell_label

__all__ = [
    "DOCS",
    "REAL_ARMS",
    "REAL_DELAYS",
    "DEFAULT_TASKS",
    "FIRST_MAP",
    "HARD_TASKS",
    "cost",
    "full_cells",
    "hard_cells",
    "is_complete",
    "mirror_cells",
    "mirror_costs",
    "protocol_for",
    "records_path",
    "reduced_cells",
    "round_records",
    "rounds",
    "SHARED_FILES",
    "shipped_summary",
    "summary_path",
    "tiny_protocol",
]

#: the checkout's docs/ (the real map, the clock's fit, the rounds' files)
DOCS = Path(__file__).resolve().parents[3] / "docs" / "results"
#: The three delay models of the real 4-rank map (docs/results/grid_map.json), for the cells that mirror it.
REAL_DELAYS = {
    "stalls": ("lognormal + stalls", "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.002, low=1.0, high=3.0)"),
    "slowrank": ("slow node", "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[{last}], seconds=0.1)"),
    "exp": ("exponential", "exponential(mean=0.1)"),
}
#: our arm label -> the real map's arm key (its ``dgd`` is our ddp: the same mathematics)
REAL_ARMS = {
    "ddp": "dgd",
    "ignore_stragglers c=2": "ignore_c2",
    "gc_fr c=2": "gc_fr_c2",
    "gc_cr c=2": "gc_cr_c2",
    "pgc_fr c=2": "pgc_fr_c2",
    "pgc_cr c=2": "pgc_cr_c2",
}


def mirror_costs(docs: Path = DOCS) -> tuple[float, float, float, float]:
    """The simulated clock's costs fitted to real 4-rank runs (docs/results/sim_validation.json), with the real map's
    25 ms of simulated compute per gradient in place of the fit's own."""
    fit = json.loads((docs / "sim_validation.json").read_text())
    c = fit["costs"]
    return (c["compute_s"] - fit["compute_per_eval"] + 0.025, c["overhead_s"], c["code_s"], c["aggregate_s"])


def mirror_cells(docs: Path = DOCS) -> list[MapCell]:
    """The real map's three sleep-cost cells at n = 4: its delays, model, batch, and each arm's chosen lr and
    momentum (no tuning here), on the simulated clock fitted to real runs."""
    costs = mirror_costs(docs)
    chosen = json.loads((docs / "grid_map.json").read_text())["chosen_setting"]
    fixed = tuple(
        (ours, chosen[f"sleep/{theirs}"]["lr"], chosen[f"sleep/{theirs}"]["momentum"])
        for ours, theirs in REAL_ARMS.items()
    )
    return [
        MapCell(4, f"real map: {name}", "compute", task="cnn", delay=spec, costs=costs, cs=(2,), fixed=fixed)
        for name, (_, spec) in REAL_DELAYS.items()
    ]


#: the proxy tasks a round runs by default (``--tasks`` of ``benchmarks/emulated_map.py`` overrides them)
DEFAULT_TASKS: tuple[str, ...] = ("mlp",)


def reduced_cells(tasks: Sequence[str] = DEFAULT_TASKS) -> list[MapCell]:
    """The reduced round, per task: cells that a scheme can win at small n. n = 4: no stragglers (the control),
    single-rank stalls (iid and Dirichlet-skewed), slow spells, a slow node (one worker: ``s = 1`` covers it);
    n = 16: a slow node of 4 workers (``c`` 2, 4, 5 and 8: ``s`` below, at and above the node)."""
    cells = []
    for task in tasks:
        cells += [MapCell(4, p, "compute", task=task) for p in ("none", "rank stalls", "slow spells", "slow node")]
        cells += [MapCell(4, "rank stalls", "compute", data="dirichlet", task=task)]
        cells += [MapCell(16, "slow node", "compute", task=task)]
    return cells


#: the harder proxy tasks (docs/results/tasks.md: ddp needs hundreds of versions to their late targets) the ``hard`` round runs
HARD_TASKS: tuple[str, ...] = ("bncnn", "lm")


def hard_cells(tasks: Sequence[str] = HARD_TASKS) -> list[MapCell]:
    """The hard round, per task, at n = 4 with c = 2 (s = 1 covers one slow worker): single-rank stalls first (the
    cell a pipelined scheme won on the digits MLP), then one persistently slow worker, then no stragglers (the
    control). Every arm of the map runs in each cell; its items run in this order, so a partial run covers whole
    cells from the first."""
    return [
        MapCell(4, pattern, "compute", task=task, cs=(2,))
        for pattern in ("rank stalls", "slow node", "none")
        for task in tasks
    ]


def full_cells(tasks: Sequence[str] = DEFAULT_TASKS) -> list[MapCell]:
    """The full round, per task: n = 4, 16, 64 x every pattern, compute-bound (and comm-bound for the patterns a
    scheme can win: a slow node, slow spells, rank stalls), Dirichlet skew at n = 4 and 16 for no stragglers, rank
    stalls and a slow node; n = 256 for log-normal jitter, a slow node and node stalls."""
    cells = []
    for task in tasks:
        for n in (4, 16, 64):
            cells += [MapCell(n, p, "compute", task=task) for p in PATTERNS]
            cells += [MapCell(n, p, "comm", task=task) for p in ("slow node", "slow spells", "rank stalls")]
        for n in (4, 16):
            cells += [MapCell(n, p, "compute", "dirichlet", task=task) for p in ("none", "rank stalls", "slow node")]
        cells += [MapCell(256, p, "compute", task=task) for p in ("lognormal", "slow node", "node stalls")]
    return cells


def rounds(docs: Path = DOCS, tasks: Sequence[str] = DEFAULT_TASKS) -> dict[str, list[MapCell]]:
    """The cells of each round: ``tiny`` (the tests'), ``hard`` (:func:`hard_cells`: the harder tasks, whatever
    ``tasks`` says), ``reduced`` and ``full`` (:func:`reduced_cells`,
    :func:`full_cells`, each with the ``mirror`` cells: the real 4-rank map's three cells at the settings chosen there,
    the check against real runs), and ``pilot``, the reduced round's iid cells at n = 4 (a prefix of its items, in its
    file: what a loaded shared machine finishes in an hour)."""
    tiny = [MapCell(4, "slow node", "compute", cs=(2,)), MapCell(4, "none", "compute", data="dirichlet", cs=(2,))]
    mirror = mirror_cells(docs)
    pilot = [c for c in reduced_cells(tasks) if c.n == 4 and c.data == "iid"]
    return {
        "tiny": tiny,
        "pilot": pilot,
        "reduced": reduced_cells(tasks) + mirror,
        "full": full_cells(tasks) + mirror,
        "mirror": mirror,
        "hard": hard_cells(),
    }


def tiny_protocol() -> Protocol:
    """The ``tiny`` round's protocol: a few steps, seeds and settings (what the tests run)."""
    return Protocol(
        budget_steps=60,
        max_versions=80,
        tuning_seeds=(1000,),
        eval_seeds=(0, 1, 2),
        lrs=(0.2, 0.4),
        momenta=(0.0, 0.9),
        targets=(1.2, 0.8),
        extend=False,
    )


def protocol_for(round_name: str) -> Protocol:
    """The tuning protocol of a round (every round but ``tiny``: the default, 20 evaluation seeds and the edge rule)."""
    if round_name == "tiny":
        return tiny_protocol()
    return Protocol()


#: rounds whose items are a part of another round's, kept in that round's records file
SHARED_FILES = {"pilot": "reduced"}


def records_path(round_name: str, docs: Path = DOCS) -> Path:
    """The round's JSON Lines file (a round of :data:`SHARED_FILES`: the other round's)."""
    return docs / f"emulated_map_{SHARED_FILES.get(round_name, round_name)}.jsonl"


def summary_path(round_name: str, docs: Path = DOCS) -> Path:
    """The round's summary, ``docs/results/emulated_map_<round>.json``."""
    return docs / f"emulated_map_{round_name}.json"


def is_complete(summary: dict[str, Any]) -> bool:
    """Whether every planned (cell, arm) item of the summary's round has a record, its confirmation stage's too."""
    screened = summary.get("items_planned") is not None and summary["items_done"] >= summary["items_planned"]
    return screened and summary.get("confirm_done", 0) >= summary.get("confirm_planned", 0)


def round_records(summary: dict[str, Any], docs: Path = DOCS, confirm: bool = False) -> list[dict[str, Any]]:
    """The records of a summary's round (or of its confirmation stage): its records file's, of the round's cells
    only (a file of :data:`SHARED_FILES` holds other rounds' too)."""
    field = "confirm_source" if confirm else "source"
    if not summary.get(field):
        return []
    labels = {cell["label"] for cell in summary["cells"]}
    return [r for r in read_records(docs.parents[1] / summary[field]) if cell_label(r["cell"]) in labels]


def shipped_summary(docs: Path = DOCS) -> Path:
    """The round the docs show: the full round once it is complete, else the reduced one once it is, else the
    pilot."""
    for name in ("full", "reduced"):
        path = summary_path(name, docs)
        if path.exists() and is_complete(json.loads(path.read_text())):
            return path
    return summary_path("pilot", docs)


#: the first map's full round (30 settings x 2 tuning seeds + 10 evaluation seeds, c = 2 and n / 8, no corrections):
#: its summary keeps that round's measured CPU seconds per item at every n up to 256 (``cost.per_item_cpu_s``), the
#: shape by which :func:`cost` prices the n a round did not measure
FIRST_MAP = "emulated_map_first_full.json"


def _per_item(records: list[dict[str, Any]]) -> dict[tuple[int, str], list[float]]:
    per: dict[tuple[int, str], list[float]] = {}
    for r in records:
        per.setdefault((r["cell"]["n"], r["cell"]["task"]), []).append(r["cpu_s"])
    return per


def cost(
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    docs: Path = DOCS,
    confirm_records: Optional[list[dict[str, Any]]] = None,
) -> dict[str, Any]:
    """The round's measured CPU seconds (each item's process time, summed; per item by n and task; the confirmation
    stage's per cell) and, for a round other than the full one, an estimate of the full round: measured means where
    the round measured that (n, task); elsewhere the first map's measured mean at that n (:data:`FIRST_MAP`) times the
    median ratio of this round's means to the first map's at the n both measured."""
    tuned = [r for r in records if r["cell"].get("fixed") is None]
    per = _per_item(records)
    means = {k: sum(v) / len(v) for k, v in per.items()}
    settings = {len(r["protocol"]["lrs"]) * len(r["protocol"]["momenta"]) for r in tuned}
    confirm_records = confirm_records or []
    confirm_cells: dict[str, float] = {}
    for r in confirm_records:
        key = json.dumps(
            [r["cell"]["n"], r["cell"]["task"], r["cell"]["pattern"], r["cell"]["bound"], r["cell"]["data"]]
        )
        confirm_cells[key] = confirm_cells.get(key, 0.0) + r["cpu_s"]
    per_confirm: dict[tuple[int, str], list[float]] = {}
    for key, total in confirm_cells.items():
        n, task = json.loads(key)[:2]
        per_confirm.setdefault((n, task), []).append(total)
    out: dict[str, Any] = {
        "round": summary.get("round"),
        "items": len(records),
        "tuning_settings": sorted(settings),
        "cpu_s_total": sum(r["cpu_s"] for r in records),
        "largest_item_cpu_s": max((r["cpu_s"] for r in records), default=0.0),
        "per_item_cpu_s": {
            f"n={n} {task}": {"mean": m, "items": len(per[(n, task)])} for (n, task), m in sorted(means.items())
        },
        "confirm_cpu_s_total": sum(r["cpu_s"] for r in confirm_records),
        "per_confirmed_cell_cpu_s": {
            f"n={n} {task}": {"mean": sum(v) / len(v), "cells": len(v)} for (n, task), v in sorted(per_confirm.items())
        },
    }
    if summary.get("round") == "full":
        return out
    first = json.loads((docs / FIRST_MAP).read_text())["cost"]["per_item_cpu_s"]
    first_mean = {int(k.split()[0][2:]): v["mean"] for k, v in first.items() if k.endswith(" mlp")}
    tuned_means = {k: sum(v) / len(v) for k, v in _per_item(tuned).items()}
    ratios = sorted(m / first_mean[n] for (n, _), m in tuned_means.items() if n in first_mean)
    scale = ratios[len(ratios) // 2] if ratios else float("nan")
    confirm_ratio = sorted((sum(v) / len(v)) / tuned_means[k] for k, v in per_confirm.items() if k in tuned_means)
    confirm_scale = confirm_ratio[len(confirm_ratio) // 2] if confirm_ratio else 0.0

    def item_s(n: int, task: str) -> float:
        if (n, task) in tuned_means:
            return tuned_means[(n, task)]
        nearest = min(first_mean, key=lambda m: abs(m - n))  # the first map measured n = 4 to 256
        return first_mean[nearest] * scale

    full = protocol_for("full")
    tasks = sorted({task for _, task in tuned_means}) or list(DEFAULT_TASKS)
    cells = full_cells(tasks)
    items, _ = plan_items(cells, full)
    screen = sum(item_s(cell.n, cell.task) for cell, _ in items if cell.fixed is None)
    confirm = sum(item_s(cell.n, cell.task) * confirm_scale for cell in cells if cell.fixed is None)
    out.update(
        {
            "first_map_scale": scale,
            "confirm_cell_over_item": confirm_scale,
            "full_items": len(items),
            "full_items_at_measured_n": sum((cell.n, cell.task) in tuned_means for cell, _ in items),
            "full_cells": sum(cell.fixed is None for cell in cells),
            "full_tuning_settings": len(full.lrs) * len(full.momenta),
            "full_cpu_s_estimate": screen + confirm,
            "full_confirm_cpu_s_estimate": confirm,
        }
    )
    return out
