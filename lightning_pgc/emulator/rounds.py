"""The rounds of the emulated crossover map: the cells and tuning protocol of each, which round the docs show, and
what a round costs in CPU time.

The cells that mirror the real 4-rank map read it (``docs/grid_map.json``: each arm's chosen lr and momentum) and the
simulated clock's fit to real runs (``docs/sim_validation.json``), so the rounds need a checkout's ``docs/``.
``benchmarks/emulated_map.py`` runs a round, ``benchmarks/emulated_render.py`` renders it (and its :func:`cost`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from lightning_pgc.emulator.cells import Cell, Protocol
from lightning_pgc.emulator.cluster import PATTERNS
from lightning_pgc.emulator.crossmap import plan_items

__all__ = [
    "DOCS",
    "REAL_ARMS",
    "REAL_DELAYS",
    "DEFAULT_TASKS",
    "cost",
    "full_cells",
    "is_complete",
    "mirror_cells",
    "mirror_costs",
    "protocol_for",
    "records_path",
    "reduced_cells",
    "rounds",
    "shipped_summary",
    "tiny_protocol",
]

#: the checkout's docs/ (the real map, the clock's fit, the rounds' files)
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The three delay models of the real 4-rank map (docs/grid_map.json), for the cells that mirror it.
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
    """The simulated clock's costs fitted to real 4-rank runs (docs/sim_validation.json), with the real map's
    25 ms of simulated compute per gradient in place of the fit's own."""
    fit = json.loads((docs / "sim_validation.json").read_text())
    c = fit["costs"]
    return (c["compute_s"] - fit["compute_per_eval"] + 0.025, c["overhead_s"], c["code_s"], c["aggregate_s"])


def mirror_cells(docs: Path = DOCS) -> list[Cell]:
    """The real map's three sleep-cost cells at n = 4: its delays, model, batch, and each arm's chosen lr and
    momentum (no tuning here), on the simulated clock fitted to real runs."""
    costs = mirror_costs(docs)
    chosen = json.loads((docs / "grid_map.json").read_text())["chosen_setting"]
    fixed = tuple(
        (ours, chosen[f"sleep/{theirs}"]["lr"], chosen[f"sleep/{theirs}"]["momentum"])
        for ours, theirs in REAL_ARMS.items()
    )
    return [
        Cell(4, f"real map: {name}", "compute", task="cnn", delay=spec, costs=costs, cs=(2,), fixed=fixed)
        for name, (_, spec) in REAL_DELAYS.items()
    ]


#: the proxy tasks a round runs by default (``--tasks`` of ``benchmarks/emulated_map.py`` overrides them)
DEFAULT_TASKS: tuple[str, ...] = ("mlp",)


def reduced_cells(tasks: Sequence[str] = DEFAULT_TASKS) -> list[Cell]:
    """The reduced round, per task: cells that a scheme can win at small n. n = 4: no stragglers (the control),
    single-rank stalls (iid and Dirichlet-skewed), slow spells, a slow node (one worker: ``s = 1`` covers it);
    n = 16: a slow node of 4 workers (``c`` 2, 4, 5 and 8: ``s`` below, at and above the node) and slow spells."""
    cells = []
    for task in tasks:
        cells += [Cell(4, p, "compute", task=task) for p in ("none", "rank stalls", "slow spells", "slow node")]
        cells += [Cell(4, "rank stalls", "compute", data="dirichlet", task=task)]
        cells += [Cell(16, p, "compute", task=task) for p in ("slow node", "slow spells")]
    return cells


def full_cells(tasks: Sequence[str] = DEFAULT_TASKS) -> list[Cell]:
    """The full round, per task: n = 4, 16, 64 x every pattern, compute-bound (and comm-bound for the patterns a
    scheme can win: a slow node, slow spells, rank stalls), Dirichlet skew at n = 4 and 16 for no stragglers, rank
    stalls and a slow node; n = 256 for log-normal jitter, a slow node and node stalls."""
    cells = []
    for task in tasks:
        for n in (4, 16, 64):
            cells += [Cell(n, p, "compute", task=task) for p in PATTERNS]
            cells += [Cell(n, p, "comm", task=task) for p in ("slow node", "slow spells", "rank stalls")]
        for n in (4, 16):
            cells += [Cell(n, p, "compute", "dirichlet", task=task) for p in ("none", "rank stalls", "slow node")]
        cells += [Cell(256, p, "compute", task=task) for p in ("lognormal", "slow node", "node stalls")]
    return cells


def rounds(docs: Path = DOCS, tasks: Sequence[str] = DEFAULT_TASKS) -> dict[str, list[Cell]]:
    """The cells of each round: ``tiny`` (the tests'), ``reduced`` and ``full`` (:func:`reduced_cells`,
    :func:`full_cells`, each with the ``mirror`` cells: the real 4-rank map's three cells at the settings chosen there,
    the check against real runs)."""
    tiny = [Cell(4, "slow node", "compute", cs=(2,)), Cell(4, "none", "compute", data="dirichlet", cs=(2,))]
    mirror = mirror_cells(docs)
    return {
        "tiny": tiny,
        "reduced": reduced_cells(tasks) + mirror,
        "full": full_cells(tasks) + mirror,
        "mirror": mirror,
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


def records_path(round_name: str, docs: Path = DOCS) -> Path:
    """The round's JSON Lines file (its summary: the same name with ``.json``)."""
    return docs / "results" / f"emulated_map_{round_name}.jsonl"


def is_complete(summary: dict[str, Any]) -> bool:
    """Whether every planned (cell, arm) item of the summary's round has a record, its confirmation stage's too."""
    screened = summary.get("items_planned") is not None and summary["items_done"] >= summary["items_planned"]
    return screened and summary.get("confirm_done", 0) >= summary.get("confirm_planned", 0)


def shipped_summary(docs: Path = DOCS) -> Path:
    """The round the docs show: the full round once it is complete, else the reduced one."""
    full = records_path("full", docs).with_suffix(".json")
    if full.exists() and is_complete(json.loads(full.read_text())):
        return full
    return records_path("reduced", docs).with_suffix(".json")


def cost(summary: dict[str, Any], records: list[dict[str, Any]], docs: Path = DOCS) -> dict[str, Any]:
    """The round's measured CPU seconds (each item's process time, summed; per item by n and task) and, for a round
    other than the full one, an estimate of the full round: measured means where the round measured that n, else a
    least-squares line ``a + b n`` through the measured MLP means."""
    per: dict[tuple[int, str], list[float]] = {}
    for r in records:
        per.setdefault((r["cell"]["n"], r["cell"]["task"]), []).append(r["cpu_s"])
    means = {k: sum(v) / len(v) for k, v in per.items()}
    settings = {len(r["protocol"]["lrs"]) * len(r["protocol"]["momenta"]) for r in records}
    out: dict[str, Any] = {
        "round": summary.get("round"),
        "items": len(records),
        "tuning_settings": sorted(settings),
        "cpu_s_total": sum(r["cpu_s"] for r in records),
        "largest_item_cpu_s": max((r["cpu_s"] for r in records), default=0.0),
        "per_item_cpu_s": {
            f"n={n} {task}": {"mean": m, "items": len(per[(n, task)])} for (n, task), m in sorted(means.items())
        },
    }
    if summary.get("round") == "full":
        return out
    pts = [(n, m) for (n, task), m in means.items() if task == "mlp"]
    if len(pts) >= 2:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
    else:
        a, b = 0.0, float("nan")
    full = protocol_for("full")
    tasks = sorted({task for _, task in means}) or list(DEFAULT_TASKS)
    items, _ = plan_items(full_cells(tasks), full)
    total, measured_items = 0.0, 0
    for cell, _arm in items:
        key = (cell.n, cell.task)
        if key in means:
            total += means[key]
            measured_items += 1
        else:
            total += a + b * cell.n
    out.update(
        {
            "line_a_s": a,
            "line_b_s_per_worker": b,
            "full_items": len(items),
            "full_items_at_measured_n": measured_items,
            "full_tuning_settings": len(full.lrs) * len(full.momenta),
            "full_cpu_s_estimate": total,
        }
    )
    return out
